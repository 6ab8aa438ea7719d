"""A damaged native library never takes the process down: a library file cut short, random
bytes, a missing or wrong checksum, in the run-time cache or installed, is never handed to
dlopen (a file cut short kills the process there, SIGBUS); the cached one is built again, the
installed one passed over, with one warning line naming the file, and the kernel that runs
computes right. And $FAIRSEQ_PARDEC_NATIVE reads the usual yes/no spellings, refusing others.

One good build is compiled for the module; the rebuilds here copy it in place of compiling
(the compiles themselves are test_native_kernel.py's)."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_pardec import env_flags
from fairseq_pardec.native import library as native, file_check as native_file
from fairseq_pardec.errors import UsageError, one_line
from test_native_kernel import _agrees_with_torch, _fresh, _needs_compiler, _needs_installed


@pytest.fixture(scope="module")
def good_build(tmp_path_factory):
    """A run-time build of the kernels for this machine, compiled once for the module: its
    file, to copy wherever a test needs a good library."""
    _needs_compiler()
    with pytest.MonkeyPatch.context() as monkeypatch:
        cache = tmp_path_factory.mktemp("good-build")
        _fresh(monkeypatch, cache, installed=False)
        kernel = native.native_kernel()
        assert kernel is not None, native.native_unavailable_reason()
    return kernel.path


def _builds_copied_from(monkeypatch, good):
    """Replace compiling the run-time build by copying ``good`` to the output; the builds made
    are recorded (the compiler's queries still run)."""
    builds = []
    run = native._run

    def copied(command, what):
        if "-shared" not in command:
            return run(command, what)
        builds.append(command)
        shutil.copyfile(good, command[command.index("-o") + 1])
        return ""

    monkeypatch.setattr(native, "_run", copied)
    return builds


def _cached(monkeypatch, cache, good):
    """A cache holding a good build, put in place as the run-time build puts it (with its
    checksum), under the name this machine's build has: its path."""
    _fresh(monkeypatch, cache, installed=False)
    path = cache / good.name
    cache.mkdir(parents=True, exist_ok=True)
    native_file.install(good, path)
    assert native_file.problem(path) is None
    return path


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _cut_in_half(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


DAMAGE = {
    "random bytes": (lambda path: path.write_bytes(os.urandom(path.stat().st_size)),
                     "not an ELF file"),
    "no checksum": (lambda path: native_file.checksum_path(path).unlink(), "no checksum"),
    "another checksum": (lambda path: native_file.checksum_path(path).write_text(
        "%s  %s\n" % ("0" * 64, path.name)), "do not match its checksum"),
    "cut in half, its checksum written for what is left": (
        lambda path: (_cut_in_half(path), native_file.install(path, path)), "truncated"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cached_build_is_built_again(monkeypatch, tmp_path, caplog, good_build,
                                               damage):
    damaged, said = DAMAGE[damage]
    path = _cached(monkeypatch, tmp_path, good_build)
    damaged(path)
    builds = _builds_copied_from(monkeypatch, good_build)
    with caplog.at_level(logging.WARNING):
        kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    assert kernel.path == path and len(builds) == 1
    assert native_file.problem(path) is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0] and said in warnings[0], warnings
    assert _agrees_with_torch(kernel)


def test_a_cached_build_for_another_architecture_is_built_again(monkeypatch, tmp_path, caplog,
                                                              good_build):
    """A library of another machine under this one's name, its checksum matching: it checks out,
    and glibc's dlopen calls it "No such file or directory". It was never removed, so every run
    warned; now it is removed and built again, as a damaged one, and the next run is quiet."""
    path = _cached(monkeypatch, tmp_path, good_build)
    foreign = bytearray(path.read_bytes())
    foreign[18:20] = (183).to_bytes(2, "little")  # e_machine: AArch64
    path.write_bytes(bytes(foreign))
    native_file.install(path, path)  # its checksum, written for the foreign file
    assert native_file.problem(path) is None
    builds = _builds_copied_from(monkeypatch, good_build)
    with caplog.at_level(logging.WARNING):
        kernel = native.native_kernel()
    assert kernel is not None, native.native_unavailable_reason()
    assert kernel.path == path and len(builds) == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    assert "cannot be loaded (built for another architecture (ELF machine 183" in warnings[0]
    assert "removed and built again" in warnings[0]
    assert _agrees_with_torch(kernel)
    caplog.clear()
    _fresh(monkeypatch, tmp_path, installed=False)  # the next run
    with caplog.at_level(logging.WARNING):
        assert native.native_kernel().path == path
    assert len(builds) == 1 and not _warnings(caplog)


def test_a_good_cached_build_is_loaded_as_it_is(monkeypatch, tmp_path, caplog, good_build):
    path = _cached(monkeypatch, tmp_path, good_build)
    builds = _builds_copied_from(monkeypatch, good_build)
    with caplog.at_level(logging.WARNING):
        kernel = native.native_kernel()
    assert kernel is not None and kernel.path == path and not builds
    assert not _warnings(caplog)


@pytest.mark.parametrize("damage", ["no checksum", "another checksum"])
def test_a_damaged_installed_library_is_passed_over(monkeypatch, tmp_path, caplog, good_build,
                                                    damage):
    """The installed library is never rewritten (it may be read-only, shared): the run-time
    build runs instead, with one warning naming the installed file."""
    _needs_installed()
    damaged, said = DAMAGE[damage]
    installed = tmp_path / "package" / native.INSTALLED.name
    installed.parent.mkdir()
    native_file.install(native.INSTALLED, installed)
    damaged(installed)
    _fresh(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(native, "INSTALLED", installed)
    builds = _builds_copied_from(monkeypatch, good_build)
    with caplog.at_level(logging.WARNING):
        kernel = native.native_kernel()
    assert kernel is not None and not kernel.installed, native.native_unavailable_reason()
    assert len(builds) == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(installed) in warnings[0] and said in warnings[0], warnings
    assert _agrees_with_torch(kernel)


def test_a_damaged_library_and_no_compiler_mean_the_library_kernels(monkeypatch, tmp_path,
                                                                     caplog):
    installed = tmp_path / native.INSTALLED.name
    installed.write_bytes(os.urandom(4096))
    _fresh(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(native, "INSTALLED", installed)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert native.native_kernel() is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(installed) in warnings[0], warnings
    assert "no C compiler" in warnings[0]


_LOAD_IN_TURN = """
import json, logging, shutil, sys
from pathlib import Path
import torch
from fairseq_pardec.native import library as native

good, installed_libraries = sys.argv[1], sys.argv[2:]
run = native._run
def copied(command, what):  # the run-time build: a copy of a good one, not compiled
    if "-shared" not in command:
        return run(command, what)
    shutil.copyfile(good, command[command.index("-o") + 1])
    return ""
native._run = copied
warnings = []
class Kept(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger().addHandler(Kept(logging.WARNING))
g = torch.Generator().manual_seed(0)
weight, x = torch.randn(70, 33, generator=g), torch.randn(5, 33, generator=g)
for installed in installed_libraries:  # each as a new process's first use would
    native._tried, native._kernel, native._reason = False, None, None
    native.INSTALLED = Path(installed)
    del warnings[:]
    kernel = native.native_kernel()
    agrees = kernel is not None and torch.allclose(kernel.linear(x, kernel.pack(weight), 70),
                                                   x @ weight.t(), atol=1e-5)
    print(json.dumps({"path": kernel and str(kernel.path), "agrees": agrees,
                      "installed": kernel and kernel.installed, "warnings": warnings,
                      "reason": native.native_unavailable_reason()}), flush=True)
"""


def _loaded_in_a_new_process(cache: Path, good: Path, installed_libraries) -> list:
    """native_kernel()'s first use with each of ``installed_libraries`` in turn, in a process
    of its own (a crash there fails the test, not pytest), the run-time build a copy of
    ``good``: what each use got."""
    env = dict(os.environ, FAIRSEQ_PARDEC_CACHE=str(cache), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    for name in (native.ARCH_VARIABLE, native.SWITCH_VARIABLE):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_TURN, str(good), *map(str, installed_libraries)],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "rc %d: %s" % (result.returncode, result.stderr[-2000:])
    return [json.loads(line) for line in result.stdout.splitlines()[-len(installed_libraries):]]


def test_a_library_cut_in_half_is_never_loaded(tmp_path, good_build):
    """The reported crash: a cached build cut in half (its checksum that of the whole one),
    then an installed library cut in half, loaded by a fresh process as a decode loads them:
    the process lives (rc 0), one warning names the file each time, the cached build is built
    again and computes right. The installed one's checksum is written for what is left of it,
    so that its ELF headers alone must catch it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = cache / good_build.name
    native_file.install(good_build, cached)
    _cut_in_half(cached)
    installed = tmp_path / "package" / native.INSTALLED.name
    installed.parent.mkdir()
    shutil.copyfile(native.INSTALLED if native.INSTALLED.exists() else good_build, installed)
    _cut_in_half(installed)
    native_file.install(installed, installed)
    first, second = _loaded_in_a_new_process(cache, good_build,
                                             [tmp_path / "no-such-library.so", installed])
    for got, damaged in ((first, cached), (second, installed)):
        assert got["path"] == str(cached) and not got["installed"], got
        assert got["agrees"] and len(got["warnings"]) == 1, got
        assert str(damaged) in got["warnings"][0] and "truncated" in got["warnings"][0], got
    assert native_file.problem(cached) is None


def test_a_crash_while_writing_never_leaves_a_library_that_passes(monkeypatch, tmp_path,
                                                                  good_build):
    """The library is renamed into place before its checksum: dying in between leaves it
    without a checksum, or with the previous library's, and it is refused either way."""
    path = tmp_path / "native-x.so"
    replace = os.replace

    def dies_before_the_checksum(source, destination):
        if str(destination).endswith(native_file.CHECKSUM_SUFFIX):
            raise KeyboardInterrupt  # the process killed there
        replace(source, destination)

    monkeypatch.setattr(native_file.os, "replace", dies_before_the_checksum)
    with pytest.raises(KeyboardInterrupt):
        native_file.install(good_build, path)
    assert "no checksum" in native_file.problem(path)

    monkeypatch.setattr(native_file.os, "replace", replace)
    native_file.install(good_build, path)
    other = tmp_path / "other.so"
    other.write_bytes(good_build.read_bytes() + b"\0")
    monkeypatch.setattr(native_file.os, "replace", dies_before_the_checksum)
    with pytest.raises(KeyboardInterrupt):
        native_file.install(other, path)
    assert "do not match its checksum" in native_file.problem(path)


def test_what_is_not_a_whole_shared_library_is_named(tmp_path, good_build):
    data = good_build.read_bytes()
    cases = {b"": "not an ELF file", b"MZ\x90\x00" + data[4:]: "not an ELF file",
             data[:40]: "truncated", data[:-1]: "truncated",
             data[:16] + b"\x02\x00" + data[18:]: "not a shared library"}  # ET_EXEC
    for index, (content, said) in enumerate(cases.items()):
        path = tmp_path / ("case-%d.so" % index)
        path.write_bytes(content)
        assert said in native_file.problem(path), (index, native_file.problem(path))
    assert "unreadable" in native_file.problem(tmp_path / "missing.so")


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("No", False),
                                       (" OFF ", False), ("1", True), ("TRUE", True),
                                       ("yes", True), ("On\n", True), ("", True)])
def test_yes_no_spellings(monkeypatch, value, on):
    monkeypatch.setenv("FAIRSEQ_PARDEC_TEST_FLAG", value)
    assert env_flags.flag("FAIRSEQ_PARDEC_TEST_FLAG", True) is on
    monkeypatch.delenv("FAIRSEQ_PARDEC_TEST_FLAG")
    assert env_flags.flag("FAIRSEQ_PARDEC_TEST_FLAG", False) is False


@pytest.mark.parametrize("value", ["false", "Off", " no "])
def test_switched_off_in_any_spelling(monkeypatch, tmp_path, value):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv(native.SWITCH_VARIABLE, value)
    monkeypatch.setattr(native, "_load", lambda notes: pytest.fail("switched off: not loaded"))
    assert native.native_kernel() is None
    assert native.native_unavailable_reason() == "FAIRSEQ_PARDEC_NATIVE=" + value.strip()


@pytest.mark.parametrize("value", ["2", "nope", "enabled", "0.0"])
def test_other_values_are_refused_in_one_line(monkeypatch, tmp_path, value):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv(native.SWITCH_VARIABLE, value)
    with pytest.raises(UsageError) as refused:
        native.native_kernel()
    line = one_line(refused.value)
    assert "\n" not in line and line.startswith("fairseq_pardec: error: ")
    assert "FAIRSEQ_PARDEC_NATIVE=%s" % value in line
    assert "0/1/false/true/no/yes/off/on" in line
    monkeypatch.setenv(native.SWITCH_VARIABLE, "on")  # once fixed, the kernel loads as ever
    monkeypatch.setattr(native, "_load", lambda notes: "loaded")
    assert native.native_kernel() == "loaded"
