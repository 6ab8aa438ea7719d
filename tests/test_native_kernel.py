"""The native product kernel's build: cached per source and machine, checked before use, and
replaced by the library kernels (never an error) where it cannot be built."""

import os
import platform
import shutil
import stat

import pytest
import torch

from fairseq_pardec.decoding.step import native
from fairseq_pardec.decoding.step.products import MKL, NATIVE, Linear


def _fresh(monkeypatch, cache_dir):
    """native_kernel() as on a first call, building into ``cache_dir``."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setenv("FAIRSEQ_PARDEC_CACHE", str(cache_dir))


def _needs_compiler():
    if not any(shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc") if c):
        pytest.skip("no C compiler on this machine")


def test_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path):
    _needs_compiler()
    _fresh(monkeypatch, tmp_path)
    kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    built = list(tmp_path.glob("native_linear-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("tmp*"))  # no half-written leftovers
    stamp = built[0].stat().st_mtime_ns
    _fresh(monkeypatch, tmp_path)
    assert native.native_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 33, generator=g), torch.randn(70, generator=g)
    x = torch.randn(11, 33, generator=g)
    got = kernel.linear(x, kernel.pack(weight), 70, bias)
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5)


def test_switched_off_by_the_environment(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("FAIRSEQ_PARDEC_NATIVE", "0")
    assert native.native_kernel() is None
    assert native.native_unavailable_reason() == "FAIRSEQ_PARDEC_NATIVE=0"
    linear = Linear(torch.randn(8, 4), None)
    assert NATIVE not in linear.kernels()
    x = torch.randn(2, 4)
    # asked for the native kernel where there is none, a map runs on the library's
    assert torch.allclose(linear(x, NATIVE), linear(x, MKL))


def test_no_compiler_means_library_kernels(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native.native_kernel() is None
    assert "no C compiler" in native.native_unavailable_reason()
    assert not list(tmp_path.iterdir())


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    script = tmp_path / "broken-cc"
    script.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'cc: out of luck' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    _fresh(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("CC", str(script))
    assert native.native_kernel() is None
    assert "out of luck" in native.native_unavailable_reason()
    assert not list((tmp_path / "cache").glob("*.so"))


def test_another_instruction_set_is_another_build(monkeypatch, tmp_path):
    """FAIRSEQ_PARDEC_NATIVE_ARCH builds for a named instruction set (the suite's AVX2 pass),
    cached apart from the machine's own build."""
    _needs_compiler()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64-v3 is an x86 instruction set")
    _fresh(monkeypatch, tmp_path)
    monkeypatch.delenv("FAIRSEQ_PARDEC_NATIVE_ARCH", raising=False)
    assert native.native_kernel() is not None, native.native_unavailable_reason()
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("FAIRSEQ_PARDEC_NATIVE_ARCH", "x86-64-v3")
    kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    assert len(list(tmp_path.glob("native_linear-*.so"))) == 2
    x, weight = torch.randn(3, 9), torch.randn(40, 9)
    assert torch.allclose(kernel.linear(x, kernel.pack(weight), 40), x @ weight.t(), atol=1e-5)
