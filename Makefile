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

# Tests that train a model (pytest -m trains) run a second time on AVX2 kernels: what a model
# learns depends on how the CPU's kernels round, so the suite must hold on AVX2 and AVX-512
# machines alike (MKL and oneDNN pick their own code paths: capped as well; the fast step's native
# kernel is built for x86-64-v3, AVX2 with FMA).
ANYCPU  := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
           FAIRSEQ_PARDEC_NATIVE_ARCH=x86-64-v3

# --durations: the slowest tests, so that a slow one is seen when it lands
test: $(VENV)/.installed
	OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/python -m pytest -q --durations=15 tests
	$(ANYCPU) OMP_NUM_THREADS=$(THREADS) $(VENV)/bin/python -m pytest -q -m trains tests

demo: $(VENV)/.installed
	PATH="$(abspath $(VENV))/bin:$$PATH" THREADS=$(THREADS) bash examples/demo.sh

clean:
	rm -rf $(VENV) demo-out
