# fairseq_pardec: `make test` and `make demo` each set themselves up from nothing (a venv in .venv).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
THREADS ?= 2
TORCH   ?= torch==2.13.0
FAIRSEQ ?= fairseq-fixed==0.12.3.1

.PHONY: install test demo clean

# torch first, then fairseq built against it without build isolation: an isolated build would
# download a second, multi-GB CUDA torch just to compile fairseq's extensions.
$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23" setuptools wheel
	$(PIP) install -q "$(TORCH)" "numpy>=1.26" cython
	$(PIP) install -q --no-build-isolation "$(FAIRSEQ)"
	$(PIP) install -q --no-build-isolation -e ".[test,ct2]"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/python -m pytest -q tests

demo: $(VENV)/.installed
	PATH="$(abspath $(VENV))/bin:$$PATH" THREADS=$(THREADS) bash examples/demo.sh

clean:
	rm -rf $(VENV) demo-out
