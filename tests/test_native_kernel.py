"""The native kernels' library: the one built at install time loaded as it is, the build at
run time only as a fallback (cached in $XDG_CACHE_HOME under a lock, keyed by what the compiler
targets, old builds pruned), torch's OpenMP runtime and no other, threads starting together
all getting the kernel, and the library kernels (never an error) where none can run."""

import ctypes
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fairseq_pardec.native import library as native, build as native_build, cache as native_cache, file_check as native_file
from fairseq_pardec.decoding.cpu.products import MKL, NATIVE, Linear


def _fresh(monkeypatch, cache_dir, installed=True):
    """native_kernel() as on a first call, building (if it must) into ``cache_dir``; without
    the installed library unless ``installed``."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setenv("FAIRSEQ_PARDEC_CACHE", str(cache_dir))
    monkeypatch.delenv(native.ARCH_VARIABLE, raising=False)
    monkeypatch.delenv("FAIRSEQ_PARDEC_NATIVE", raising=False)
    if not installed:
        monkeypatch.setattr(native, "INSTALLED", Path(cache_dir) / "no-such-library.so")


def _needs_compiler():
    if not any(shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc") if c):
        pytest.skip("no C compiler on this machine")


def _needs_installed():
    if not native.INSTALLED.exists():
        pytest.skip("the package was installed without its native library (no compiler then)")


def _compilations(monkeypatch):
    """The compiler runs that build a library, recorded (its queries are not counted)."""
    runs = []
    run = native._run

    def recorded(command, what):
        if "-shared" in command:
            runs.append(command)
        return run(command, what)

    monkeypatch.setattr(native, "_run", recorded)
    return runs


def _agrees_with_torch(kernel):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 33, generator=g), torch.randn(70, generator=g)
    x = torch.randn(11, 33, generator=g)
    got = kernel.linear(x, kernel.pack(weight), 70, bias)
    return torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5)


def test_the_installed_library_is_loaded_not_built(monkeypatch, tmp_path):
    _needs_installed()
    _fresh(monkeypatch, tmp_path)
    builds = _compilations(monkeypatch)
    before = native.openmp_runtimes()
    kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    assert kernel.installed and kernel.path == native.INSTALLED
    assert native_file.problem(native.INSTALLED) is None  # setup.py wrote its checksum
    assert kernel.variant in {name for name, _ in native_build.variants()}
    assert not builds and not list(tmp_path.glob("*.so"))
    # the library brings no OpenMP runtime and runs on torch's (other packages may have
    # loaded their own copies: scikit-learn's wheel does)
    assert native.openmp_runtimes() == before
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    torch_runtimes = [path for path in before if os.path.realpath(path).startswith(torch_dir)]
    if len(torch_runtimes) == 1:
        assert kernel.openmp == torch_runtimes[0]
    assert _agrees_with_torch(kernel)


def test_every_variant_the_cpu_runs_computes_the_same_products(monkeypatch, tmp_path):
    """$FAIRSEQ_PARDEC_NATIVE_ARCH naming an x86-64 level caps the installed library's variant
    (the suite's AVX2 pass): each variant this CPU runs agrees with torch."""
    _needs_installed()
    if not native_build.is_x86_64():
        pytest.skip("x86-64 levels")
    seen = set()
    for level in ("x86-64", "x86-64-v3", "x86-64-v4"):
        _fresh(monkeypatch, tmp_path)
        monkeypatch.setenv(native.ARCH_VARIABLE, level)
        kernel = native.native_kernel()
        assert kernel is not None and kernel.installed, native.native_unavailable_reason()
        assert _agrees_with_torch(kernel)
        seen.add(kernel.variant)
    assert "x86_64" in seen


def test_threads_share_the_products_rows_bit_for_bit(monkeypatch, tmp_path):
    """The product split among threads equals the one-thread product bit for bit: exact by
    construction, each output is summed by one thread in the same order whatever the split."""
    _fresh(monkeypatch, tmp_path)
    kernel = native.native_kernel()
    if kernel is None:
        pytest.skip(native.native_unavailable_reason())
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=g)
    panels, x = kernel.pack(weight), torch.randn(5, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel.linear(x, panels, 300)
        torch.set_num_threads(2)
        shared = kernel.linear(x, panels, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


_SLEEPING_THREADS = """
import hashlib, torch
torch.set_num_threads(2)
from fairseq_pardec.native import library as native
kernel = native.native_kernel()
g = torch.Generator().manual_seed(1)
weight = torch.randn(300, 64, generator=g)
x = torch.randn(5, 64, generator=g)
product = kernel.linear(x, kernel.pack(weight), 300)
print(kernel.serial_loops, kernel.region_microseconds,
      hashlib.sha256(product.numpy().tobytes()).hexdigest())
"""


def test_sleeping_openmp_threads_run_the_loops_on_one_thread(tmp_path):
    """Where OpenMP's threads sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``),
    every region wakes them, and a decoder step opens one per product: the library measures
    that when it binds the runtime and runs its loops on the calling thread, with the same
    products bit for bit (each output is summed by one thread either way)."""
    import hashlib

    kernel = native.native_kernel()
    if kernel is None or kernel.openmp is None:
        pytest.skip("no native kernel on OpenMP threads here")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="2",
               FAIRSEQ_PARDEC_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _SLEEPING_THREADS], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    serial, microseconds, digest = out[-3:]
    assert serial == "True" and float(microseconds) > 10
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=g)
    x = torch.randn(5, 64, generator=g)
    product = kernel.linear(x, kernel.pack(weight), 300)
    assert hashlib.sha256(product.numpy().tobytes()).hexdigest() == digest


def test_run_time_build_cached_once_in_the_xdg_cache(monkeypatch, tmp_path):
    _needs_compiler()
    _fresh(monkeypatch, tmp_path, installed=False)
    monkeypatch.delenv(native_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    builds = _compilations(monkeypatch)
    kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    assert not kernel.installed and kernel.variant == "native"
    root = tmp_path / "xdg" / "fairseq_pardec"
    built = list(root.glob("native-*.so"))
    assert built == [kernel.path] and len(builds) == 1
    assert native_file.problem(kernel.path) is None  # its checksum beside it
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", "tmp"))]
    _fresh(monkeypatch, tmp_path, installed=False)
    monkeypatch.delenv(native_cache.CACHE_VARIABLE)
    assert native.native_kernel().path == kernel.path
    assert len(builds) == 1  # loaded from the cache, not compiled again
    assert _agrees_with_torch(kernel)


def test_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(native_cache.CACHE_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_cache.cache_root() == tmp_path / "xdg" / "fairseq_pardec"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid by the XDG spec
    assert native_cache.cache_root() == Path.home() / ".cache" / "fairseq_pardec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert native_cache.cache_root() == Path.home() / ".cache" / "fairseq_pardec"
    monkeypatch.setenv(native_cache.CACHE_VARIABLE, str(tmp_path / "mine"))
    assert native_cache.cache_root() == tmp_path / "mine"


def test_the_build_is_keyed_by_what_the_compiler_targets(monkeypatch, tmp_path):
    """Another -march (what the compiler may emit changes) is another build; the installed
    library is bypassed for a target that is not one of its levels."""
    _needs_compiler()
    if not native_build.is_x86_64():
        pytest.skip("x86 targets")
    _fresh(monkeypatch, tmp_path, installed=False)
    assert native.native_kernel() is not None, native.native_unavailable_reason()
    _fresh(monkeypatch, tmp_path)  # the installed library too, where there is one
    monkeypatch.setenv(native.ARCH_VARIABLE, "haswell")
    kernel = native.native_kernel()
    assert kernel is not None and not kernel.installed, native.native_unavailable_reason()
    assert len(list(tmp_path.glob("native-*.so"))) == 2
    x, weight = torch.randn(3, 9), torch.randn(40, 9)
    assert torch.allclose(kernel.linear(x, kernel.pack(weight), 40), x @ weight.t(), atol=1e-5)


def test_an_in_place_build_older_than_its_sources_is_not_loaded(monkeypatch, tmp_path):
    _needs_installed()
    _needs_compiler()
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(native_build, "source_digest", lambda: "0123456789abcdef")
    kernel = native.native_kernel()
    assert kernel is not None and not kernel.installed, native.native_unavailable_reason()
    assert kernel.path.name.startswith("native-0123456789abcdef-")


def test_threads_starting_together_all_get_the_kernel_built_once(monkeypatch, tmp_path):
    """A cold process: threads asking at once wait for the first one's build and load."""
    _needs_compiler()
    _fresh(monkeypatch, tmp_path, installed=False)
    builds = _compilations(monkeypatch)
    start = threading.Barrier(4)
    got = []

    def first_use():
        start.wait()
        got.append(native.native_kernel())

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 4 and got[0] is not None, native.native_unavailable_reason()
    assert all(kernel is got[0] for kernel in got)
    assert len(builds) == 1


_HOLD_THE_LOCK = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("native_cache", sys.argv[1])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
from pathlib import Path
with cache.locked(Path(sys.argv[2])):
    print("locked", flush=True)
    time.sleep(float(sys.argv[3]))
print("released", time.time(), flush=True)
"""


def test_the_cache_lock_holds_across_processes(tmp_path):
    """A second process waits for the first to release the cache's lock (the run-time build
    and the stored choices are written under it)."""
    module = native_cache.__file__
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, module, str(tmp_path), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    waiter = subprocess.run([sys.executable, "-c", _HOLD_THE_LOCK, module, str(tmp_path), "0"],
                            capture_output=True, text=True, timeout=120)
    released = float(holder.stdout.readline().split()[1])
    holder.wait(timeout=60)
    locked_at = waiter.stdout.splitlines()
    assert locked_at[0] == "locked"
    # the waiter's lock came after the holder's release
    assert float(locked_at[1].split()[1]) >= released


def test_old_builds_and_their_choices_are_pruned(tmp_path):
    now = time.time()
    day = 24 * 3600
    current = "c" * 16

    def made(name, age_days, directory=False):
        path = tmp_path / name
        if directory:
            path.mkdir()
        else:
            path.write_bytes(b"")
        os.utime(path, (now - age_days * day, now - age_days * day))
        return path

    kept = [made(native_cache.build_name(current, "a" * 16), 20),  # these sources, another CPU
            made(native_cache.build_name(current, "a" * 16) + ".sha256", 40),  # its checksum
            made(native_cache.build_name("o" * 16, "a" * 16), 0.5),  # another version, in use
            made("choices-installed-%s.json" % current, 10),
            made("choices-%s.json" % native_cache.build_name(current, "a" * 16)[:-3], 10),
            made(".lock", 100)]
    gone = [made("native_linear-0123.so", 0),  # the previous naming
            made(native_cache.build_name("o" * 16, "b" * 16), 2),  # another version, unused
            made(native_cache.build_name(current, "d" * 16), 31),  # unused for a month
            made(native_cache.build_name(current, "d" * 16) + ".sha256", 0),  # ... its checksum
            made(native_cache.build_name(current, "e" * 16) + ".sha256", 0),  # no build
            made("choices-native-gone-%s.json" % current, 1),  # its build is gone
            made("choices-installed-old.json", 31),
            made(".tmp-dead-build", 1, directory=True)]
    native_cache.prune(tmp_path, current, now=now)
    assert all(path.exists() for path in kept)
    assert not any(path.exists() for path in gone)


def test_a_second_openmp_runtime_is_refused(monkeypatch, tmp_path):
    """Loading a library that brings an OpenMP runtime of its own into the process leaves the
    fast step on the library kernels, with the reason."""
    _needs_installed()
    _fresh(monkeypatch, tmp_path)
    calls = iter([["/lib/libgomp.so.1"], ["/lib/libgomp.so.1", "/elsewhere/libomp.so"]])
    monkeypatch.setattr(native, "openmp_runtimes", lambda: next(calls))
    monkeypatch.setattr(native, "_built", lambda: pytest.fail("no fallback for this"))
    monkeypatch.setattr(native, "_load", lambda notes: native._installed())
    assert native.native_kernel() is None
    assert "OpenMP runtime of its own" in native.native_unavailable_reason()


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


def test_no_library_and_no_compiler_means_library_kernels(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path, installed=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native.native_kernel() is None
    assert "no C compiler" in native.native_unavailable_reason()
    assert not list(tmp_path.glob("*.so"))


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    script = tmp_path / "broken-cc"
    script.write_text("#!/bin/sh\ncase \"$*\" in *-shared*) echo 'cc: out of luck' >&2; exit 1;; "
                      "esac\nexit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    _fresh(monkeypatch, tmp_path / "cache", installed=False)
    monkeypatch.setenv("CC", str(script))
    assert native.native_kernel() is None
    assert "out of luck" in native.native_unavailable_reason()
    assert not list((tmp_path / "cache").glob("*.so"))


def test_setup_builds_the_library_from_the_shipped_sources():
    """Every source the library is compiled from ships with the package (setup.py's
    package_data), so that the run-time build has them wherever the package is installed."""
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert '"fairseq_pardec.native": ["*.c", "*.h"]' in setup
    for name in (native_build.COMMON_SOURCES + native_build.KERNEL_SOURCES
                 + native_build.HEADERS):
        assert (native_build.HERE / name).exists()
        assert name.endswith((".c", ".h"))


@pytest.mark.parametrize("unk_penalty", [0.0, 1.5])
def test_best_two_makes_fairseqs_token_edits(unk_penalty):
    """With the search rules, the best-two pass makes fairseq's first edits in place (NaN to
    -inf, padding never chosen, --unkpen) and reads the edited rows: as token_rules then topk.
    Compared bit for bit: the edits are assignments and one IEEE subtraction, and the best two
    are the rows' own values, so no kernel's rounding enters."""
    from fairseq_pardec.decoding.fairseq_rules import SearchRules, token_rules

    kernel = native.native_kernel()
    if kernel is None:
        pytest.skip("no native kernel here")
    g = torch.Generator().manual_seed(3)
    scores = torch.log_softmax(torch.randn(7, 50, generator=g) * 4, dim=-1)
    scores[0, 1] = 5.0  # padding would win
    scores[1, 3] = 5.0  # the unknown word would win, less its penalty or not
    scores[2, 9] = float("nan")
    scores[3, :] = float("nan")
    scores[3, 4] = -2.0
    rules = SearchRules(pad=1, unk=3, eos=2, unk_penalty=unk_penalty, min_len=1)
    expected = token_rules(scores.clone(), 1, 3, unk_penalty)
    edited = scores.clone()
    values, best = kernel.best_two(edited, rules)[:2]
    assert torch.equal(edited, expected)
    top = expected.topk(2, dim=-1)
    assert values.tolist() == top.values.tolist()
    assert best.tolist() == expected.argmax(-1).tolist()


def test_an_argument_table_in_another_order_is_refused(monkeypatch):
    """native_decide.c names its decision table's slots; a table native/library.py keeps in another
    order, of the same length, is refused when the library is loaded, not misread."""
    _needs_installed()
    kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    groups = [list(group) for group in native.DECIDE_NAMES]
    groups[0][0], groups[0][1] = groups[0][1], groups[0][0]  # TOP and BEST swapped
    monkeypatch.setattr(native, "DECIDE_NAMES", tuple(tuple(g) for g in groups))
    library = ctypes.CDLL(str(kernel.path))
    with pytest.raises(RuntimeError, match="disagree on the argument table"):
        native.NativeKernel(library, kernel.path, kernel.installed, kernel.openmp,
                            kernel.build_id)
