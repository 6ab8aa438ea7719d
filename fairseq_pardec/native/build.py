"""What the native library is compiled from, and how: shared by setup.py (the library built
at install time, for every x86-64 level) and native/library.py (the build at run time, for the machine
that runs it, where the package came without a library). Standard library only: setup.py
loads this file by path, before anything is installed.
"""

import hashlib
import platform
from pathlib import Path
from typing import List, Sequence, Tuple

HERE = Path(__file__).resolve().parent

# compiled once for the whole library
COMMON_SOURCES = ("parallel.c", "dispatch.c", "decide.c")
# compiled once per variant (instruction set), their names suffixed with it (native/kernels.h)
KERNEL_SOURCES = ("linear.c", "layers.c", "scores.c")
HEADERS = ("kernels.h",)

# the installed library's file, next to this one
LIBRARY_NAME = "libpardec_native.so"

# -O3 for the loops, OpenMP's simd pragmas without its runtime (threads: native/parallel.c)
OPTIMIZE = ["-O3", "-fopenmp-simd"]

# the installed library's variants on x86-64, best first: AVX-512, AVX2 with FMA, SSE2
X86_VARIANTS: Tuple[Tuple[str, str], ...] = (
    ("x86_64_v4", "x86-64-v4"),
    ("x86_64_v3", "x86-64-v3"),
    ("x86_64", "x86-64"),
)
# what a level named in $FAIRSEQ_PARDEC_NATIVE_ARCH caps the installed library's choice at
LEVELS = {"x86-64": 1, "x86-64-v2": 1, "x86-64-v3": 3, "x86-64-v4": 4}


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def variants() -> Tuple[Tuple[str, List[str]], ...]:
    """(name, compiler flags) per variant of the installed library, best first: the x86-64
    levels, or elsewhere one build for the architecture's baseline (plain C: the compiler
    vectorizes it for whatever the baseline has, NEON on aarch64)."""
    if is_x86_64():
        return tuple((name, OPTIMIZE + ["-march=" + arch]) for name, arch in X86_VARIANTS)
    return (("generic", list(OPTIMIZE)),)


def variants_macro(names: Sequence[str]) -> str:
    """PARDEC_VARIANTS for native/dispatch.c: the variants compiled in, best first."""
    return "".join("X(%s)" % name for name in names)


def source_digest() -> str:
    """A digest of every source and header, which the library carries (pardec_source_digest):
    a library built in place by an editable install and left behind by an edit of a source is
    not loaded."""
    digest = hashlib.sha256()
    for name in COMMON_SOURCES + KERNEL_SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]
