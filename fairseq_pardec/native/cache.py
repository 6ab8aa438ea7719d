"""The cache directory of the native kernels' run-time builds and of the product kernel choice.

``$FAIRSEQ_PARDEC_CACHE``, else ``$XDG_CACHE_HOME/fairseq_pardec``, else
``~/.cache/fairseq_pardec``. What is written there is written under an exclusive file lock
(``.lock``, fcntl: processes decoding side by side build a library once, the others wait for
it) and renamed into place when complete; readers need no lock. Builds and choices nobody used
for a while are pruned whenever a build is made or a choice stored. A build's checksum
(``<build>.so.sha256``, native/file_check.py) goes with its build.
"""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

CACHE_VARIABLE = "FAIRSEQ_PARDEC_CACHE"

# a build of other sources (an earlier version of the package) is removed once unused this
# long; a build of these sources for another target (another CPU sharing the directory, the
# suite's AVX2 pass) and a stored choice after the longer time
OTHER_SOURCES_UNUSED_S = 24 * 3600
UNUSED_S = 30 * 24 * 3600
# a build's scratch directory left by a process that died while compiling
SCRATCH_UNUSED_S = 3600

BUILD_PREFIX, CHOICES_PREFIX = "native-", "choices-"


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    # the XDG spec: a relative path is invalid and ignored
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "fairseq_pardec"


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the cache's exclusive lock (across processes; threads of one process take the lock
    each on its own descriptor, which flock serializes as well)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_name(source_digest: str, target_digest: str) -> str:
    return "%s%s-%s.so" % (BUILD_PREFIX, source_digest, target_digest)


def write_atomically(path: Path, data: bytes):
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as out:
        out.write(data)
    os.replace(out.name, path)


def prune(root: Path, source_digest: str, now: Optional[float] = None):
    """Remove, under the lock: builds of the previous naming (``native_linear-*.so``), builds of
    other sources unused for a day, any build or choice unused for 30 days, the choices and
    checksum of a build that is gone, and scratch left by a build that died."""
    now = time.time() if now is None else now
    for entry in root.iterdir():
        name = entry.name
        try:
            age = now - entry.stat().st_mtime
            if name.startswith("native_linear-") and name.endswith(".so"):
                entry.unlink()
            elif name.startswith(BUILD_PREFIX) and name.endswith(".so"):
                other_sources = not name.startswith(BUILD_PREFIX + source_digest + "-")
                if age > (OTHER_SOURCES_UNUSED_S if other_sources else UNUSED_S):
                    entry.unlink()
                    _remove_companions(entry)
            elif name.startswith(BUILD_PREFIX) and ".so." in name:
                # a build's checksum: kept while its build is (its own time is not touched)
                if not (root / (name[:name.index(".so.") + len(".so")])).exists():
                    entry.unlink()
            elif name.startswith(CHOICES_PREFIX) and name.endswith(".json"):
                build = name[len(CHOICES_PREFIX):-len(".json")]
                gone = build.startswith(BUILD_PREFIX) and not (root / (build + ".so")).exists()
                if gone or age > UNUSED_S:
                    entry.unlink()
            elif name.startswith((".tmp-", "tmp")) and age > SCRATCH_UNUSED_S:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
        except FileNotFoundError:  # another process pruned it first
            pass


def _remove_companions(build: Path):
    """The files named after ``build`` (``<build>.sha256``), gone with it."""
    for companion in build.parent.glob(build.name + ".*"):
        try:
            companion.unlink()
        except FileNotFoundError:
            pass


class ChoiceCache:
    """The product kernel choices measured on this machine for one kernel build, in
    ``choices-<build>.json`` next to the build: {key: [kernel per row-count regime]}."""

    def __init__(self, build_id: str, root: Optional[Path] = None):
        self.root = cache_root() if root is None else root
        self.path = self.root / ("%s%s.json" % (CHOICES_PREFIX, build_id))

    def _read(self) -> Dict[str, list]:
        try:
            with open(self.path) as stored:
                table = json.load(stored)
            return table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            return {}

    def load(self, key: str) -> Optional[list]:
        found = self._read().get(key)
        if found is not None:
            with contextlib.suppress(OSError):
                os.utime(self.path)  # in use: not pruned
        return found

    def store(self, key: str, kernels: list, source_digest: str):
        """Add one choice (an unwritable cache only means measuring again next time)."""
        with contextlib.suppress(OSError), locked(self.root):
            table = self._read()
            table[key] = list(kernels)
            write_atomically(self.path, json.dumps(table, indent=1, sort_keys=True).encode())
            prune(self.root, source_digest)
