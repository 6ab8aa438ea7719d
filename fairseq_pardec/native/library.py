"""The native kernels (native/linear.c, native/layers.c, native/scores.c): one shared library
loaded with ctypes.

The fast step multiplies one to a few rows per product at batch 1, where the weight's read is
the whole cost and the library kernels' own overhead per call is larger than the read (see
native/linear.c); the rest of a decoder layer there is dispatch, which native/layers.c runs
without (a whole call's layer stack in one native call); native/scores.c finds each position's
best two scores for the engine.

Where the library comes from, in this order:
- the package's own, built at install time by setup.py for every x86-64 level, the CPU's best
  bound at load time (native/dispatch.c), or capped by ``$FAIRSEQ_PARDEC_NATIVE_ARCH`` when
  that names a level (``x86-64-v3``: the suite's AVX2 pass);
- else (no compiler at install time, an in-place build older than its sources, or
  ``$FAIRSEQ_PARDEC_NATIVE_ARCH`` naming another target) a build at run time with the
  machine's C compiler (``$CC``, else ``cc`` or ``gcc``) for ``-march=native`` (or that
  target), cached (native/cache.py) under a name keyed by the sources, the compiler and what
  it targets here (its predefined macros: the instruction sets it may emit), so that a cache
  shared by machines of different CPUs never hands one a build for another's instructions.

The library links no OpenMP runtime: its loops run on the one torch has loaded, found in the
process's mappings and handed over by address (native/parallel.c); loading it is checked to
bring no second runtime into the process.

Either library is loaded only once its file checks out (native/file_check.py: ELF headers within
the file, the checksum written beside it at build time): dlopen of a file cut short kills the
process (SIGBUS), where Python could not catch it. An installed library that fails the check is
passed over for the run-time build; a cached build that fails it, or that dlopen refuses though
it checks out (a build for another architecture, which glibc reports as "No such file or
directory"), is removed and built again; one warning line names the file either way.

Where there is no library, no compiler, the build fails, or the library miscomputes a test
product, :func:`native_kernel` returns None and says why in :func:`native_unavailable_reason`;
the fast step then uses the library kernels (cpu/products.py), as it does with
``FAIRSEQ_PARDEC_NATIVE`` off (``0``, ``false``, ``no``, ``off``: env_flags.py). The first call
loads or builds under a lock: threads starting together all get the kernel.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec import env_flags
from fairseq_pardec.native import build as native_build
from fairseq_pardec.native import cache as native_cache
from fairseq_pardec.native import file_check as native_file

logger = logging.getLogger(__name__)

INSTALLED = Path(__file__).with_name(native_build.LIBRARY_NAME)
# -march of the run-time build: the machine's own instruction set unless this names another; an
# x86-64 level (x86-64, x86-64-v2, -v3, -v4) caps the installed library's variant instead
ARCH_VARIABLE = "FAIRSEQ_PARDEC_NATIVE_ARCH"
# off: the fast step runs on the library kernels
SWITCH_VARIABLE = "FAIRSEQ_PARDEC_NATIVE"
OPENMP_NAMES = ("libgomp", "libiomp", "libomp")

# the tables pardec_decoder_layers reads (native/layers.c): dims, per-layer weight pointers,
# per-layer cache pointers; and pardec_attention's dims; their sizes, as the library reports them
LAYER_DIMS, LAYER_WEIGHTS, LAYER_STATE, ATTENTION_DIMS = 16, 18, 4, 7
# pardec_attention's modes (native/layers.c)
DECODER_SELF, DECODER_CROSS, ENCODER_SELF = 0, 1, 2
LAYERS_ABI = ATTENTION_DIMS * 1000000 + LAYER_DIMS * 10000 + LAYER_WEIGHTS * 100 + LAYER_STATE
# pardec_decide_rows's argument table (native/decide.c's DECIDE_SLOTS, in its order), by the
# party that fills each part: per iteration the reading and the block, the symbol EOS, per batch
# the host's tables, per row count the outcome, and LONGEST. The library's own names are checked
# against these when it is loaded, so a slot moved on one side only is refused, not misread.
DECIDE_NAMES = (
    ("TOP", "BEST", "ROWS", "WIDTH", "POS", "BLOCK", "LENGTHS"),
    ("EOS",),
    ("PREV_SCORE", "N_OUT", "LAST", "TOKENS", "TOKENS_STRIDE", "SCORES", "SCORES_STRIDE"),
    ("GAINED", "ACCEPTED", "ENDED", "LAST_POS", "LEFT"),
    ("LONGEST",),
)


def _parts(groups):
    """Each group's slice (a single slot's index) in the table."""
    out, at = [], 0
    for group in groups:
        out.append(at if len(group) == 1 else slice(at, at + len(group)))
        at += len(group)
    return out


DECIDE_SLOTS = sum(len(group) for group in DECIDE_NAMES)
DECIDE_ITERATION, DECIDE_EOS, DECIDE_TABLES, DECIDE_OUTCOME, DECIDE_LONGEST = _parts(DECIDE_NAMES)

_kernel = None
_reason: Optional[str] = None
_tried = False
_first_use = threading.Lock()


class NativeKernel:
    """``linear`` over weights stored by ``pack`` (the panel layout of native/linear.c).

    ``path``: the library loaded; ``installed``: whether it is the one built at install time
    (else built at run time, in the cache); ``variant``: the instruction set bound
    (native/dispatch.c); ``openmp``: the OpenMP runtime its threads come from (None: one
    thread); ``build_id``: names its kernel choices in the cache (products.KernelChoice);
    ``region_microseconds``: the least time an empty parallel region of two threads took when
    the runtime was bound, and ``serial_loops``: whether the loops run on the calling thread
    because the runtime's threads sleep between regions (native/parallel.c)."""

    def __init__(self, library: ctypes.CDLL, path: Path, installed: bool, openmp: Optional[str],
                 build_id: str):
        self.path, self.installed, self.openmp, self.build_id = path, installed, openmp, build_id
        library.pardec_region_microseconds.restype = ctypes.c_double
        self.region_microseconds = library.pardec_region_microseconds()
        self.serial_loops = bool(library.pardec_serial_loops())
        library.pardec_variant.restype = ctypes.c_char_p
        self.variant = library.pardec_variant().decode()
        self._linear = library.pardec_linear
        self._linear.restype = None
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        library.pardec_panel_width.restype = ctypes.c_int
        self.panel = library.pardec_panel_width()
        self.decoder_layers = library.pardec_decoder_layers
        self.decoder_layers.restype = None
        self.decoder_layers.argtypes = [ctypes.c_void_p] * 10
        # one layer's attention alone (native/layers.c, cpu/fast.py)
        self.attention = library.pardec_attention
        self.attention.restype = None
        self.attention.argtypes = [ctypes.c_void_p] * 9
        self._best_two = library.pardec_best_two
        self._best_two.restype = None
        self._best_two.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_float, ctypes.c_int]
        self._buffers = threading.local()  # best_two's outputs, per thread
        # an iteration's decisions on the host (native/decide.c, draft_verify/decisions.py)
        self.decide_rows = library.pardec_decide_rows
        self.decide_rows.restype = ctypes.c_int64
        self.decide_rows.argtypes = [ctypes.c_void_p, ctypes.c_double]
        # the guard's certainty test as decide_rows applies it (margin_guard.lead_is_certain)
        self.lead_is_certain = library.pardec_lead_is_certain
        self.lead_is_certain.restype = ctypes.c_int
        self.lead_is_certain.argtypes = [ctypes.c_double] * 4
        library.pardec_decide_slot_names.restype = ctypes.c_char_p
        names = tuple(library.pardec_decide_slot_names().decode().split())
        if names != tuple(name for group in DECIDE_NAMES for name in group):
            raise RuntimeError("native/decide.c and native/library.py disagree on the argument table: "
                               "%s" % " ".join(names))
        self.embed_block = library.pardec_embed_block
        self.embed_block.restype = ctypes.c_int
        self.embed_block.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_void_p]
        library.pardec_layers_abi.restype = ctypes.c_int
        if library.pardec_layers_abi() != LAYERS_ABI:
            raise RuntimeError("native/layers.c and native/library.py disagree on the tables' layout")

    def pack(self, weight: Tensor) -> Tensor:
        """(N, K) weight -> (ceil(N / panel), K, panel) panels, columns past N zero."""
        rows, width = weight.shape
        count = -(-rows // self.panel)
        padded = weight.new_zeros(count * self.panel, width)
        padded[:rows] = weight
        return padded.view(count, self.panel, width).transpose(1, 2).contiguous()

    def linear(self, x: Tensor, panels: Tensor, out_features: int, bias: Optional[Tensor] = None,
               add: Optional[Tensor] = None, relu: bool = False) -> Tensor:
        """(M, K) float32 rows -> (M, out_features): ``x W^T + bias + add``, then ReLU.
        ``add`` (M, out_features) is read before the output is written; it may not be it."""
        x = x.contiguous()
        rows = x.size(0)
        out = torch.empty(rows, out_features, dtype=x.dtype)
        if add is not None:
            add = add.contiguous()
        self._linear(x.data_ptr(), rows, x.size(1), panels.data_ptr(),
                     None if bias is None else bias.data_ptr(),
                     None if add is None else add.data_ptr(),
                     out.data_ptr(), out_features, int(relu), torch.get_num_threads())
        return out


    def best_two(self, scores: Tensor, rules=None) -> Tuple[np.ndarray, np.ndarray, int, int]:
        """(N, V) contiguous float32, V >= 2 -> ``values`` (N, 2) float32, the two largest
        values of each row, ``best`` (N,) int64, the first column holding the largest, and the
        addresses of the two arrays (the engine decides from them on the host:
        native/decide.c). ``rules``: None, or fairseq's search rules
        (fairseq_rules.SearchRules), whose first edits (``token_rules``) are made in ``scores``
        first, in the same pass. The arrays are kept per row count and thread, and overwritten
        by the next call: at batch 1 the engine's Python around a step is as long as the step's
        arithmetic."""
        rows, width = scores.shape
        buffers = getattr(self._buffers, "best_two", None)
        if buffers is None:
            buffers = self._buffers.best_two = {}
        out = buffers.get(rows)
        if out is None:
            values = np.empty((rows, 2), dtype=np.float32)
            best = np.empty(rows, dtype=np.int64)
            out = buffers[rows] = (values, best, values.ctypes.data, best.ctypes.data)
        symbols, penalty = None, 0.0
        if rules is not None:
            symbols, penalty = self._rule_symbols(rules), rules.unk_penalty
        self._best_two(scores.data_ptr(), rows, width, out[2], out[3], symbols, penalty,
                       torch.get_num_threads())
        return out

    def _rule_symbols(self, rules) -> int:
        """The address of {pad, unk} for ``rules`` (an immutable SearchRules), kept while the
        same rules come."""
        kept = getattr(self._buffers, "rule_symbols", None)
        if kept is None or kept[0] is not rules:
            array = np.array((rules.pad, rules.unk), dtype=np.int64)
            kept = self._buffers.rule_symbols = (rules, array, array.ctypes.data)
        return kept[2]


def openmp_runtimes() -> List[str]:
    """The OpenMP runtimes mapped into this process (files named libgomp*, libiomp*, libomp*),
    from /proc/self/maps; empty where there is no such file."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "omp" not in line:  # most of a torch process's thousands of mappings
                    continue
                fields = line.split(None, 5)
                if len(fields) < 6:
                    continue
                path = fields[5].strip()
                name = os.path.basename(path)
                if name.startswith(OPENMP_NAMES) and ".so" in name and not path.endswith(
                        "(deleted)"):
                    found.add(path)
    except OSError:
        pass
    return sorted(found)


def _torch_openmp(runtimes: List[str]) -> Optional[str]:
    """The runtime torch uses: the one shipped inside torch's package (or its wheel's .libs
    folder), else the only one mapped; None where there is none or no way to tell."""
    package = os.path.dirname(os.path.realpath(torch.__file__))
    own = [path for path in runtimes
           if os.path.realpath(path).startswith((package + os.sep, package + ".libs" + os.sep))]
    if len(own) == 1:
        return own[0]
    return runtimes[0] if len(runtimes) == 1 else None


def _bind_openmp(library: ctypes.CDLL, runtime: Optional[str]) -> Optional[str]:
    """Hand ``runtime``'s GOMP_parallel, omp_get_thread_num and omp_get_num_threads to the
    library (opened with RTLD_NOLOAD: the copy already mapped, never a new one); the library's
    loops run on the calling thread where this fails. Returns the runtime bound, or None."""
    library.pardec_use_openmp.restype = ctypes.c_int
    library.pardec_use_openmp.argtypes = [ctypes.c_void_p] * 3
    if runtime is not None:
        try:
            openmp = ctypes.CDLL(runtime, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            entries = [ctypes.cast(getattr(openmp, name), ctypes.c_void_p).value
                       for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")]
            if library.pardec_use_openmp(*entries):
                return runtime
        except (OSError, AttributeError) as error:
            logger.info("the native kernels run on one thread: %s", error)
    library.pardec_use_openmp(None, None, None)
    return None


class _Stale(RuntimeError):
    """The installed library was compiled from other sources than the ones next to it."""


def _open(path: Path, installed: bool, build_id: str, cap: Optional[int] = None) -> NativeKernel:
    """Load a library, make sure it brought no OpenMP runtime and was built from these sources,
    bind its variant (at most ``cap``'s level) and torch's OpenMP runtime, and check it."""
    before = openmp_runtimes()
    library = ctypes.CDLL(str(path))
    brought = sorted(set(openmp_runtimes()) - set(before))
    if brought:
        raise RuntimeError("%s brought an OpenMP runtime of its own into the process (%s); "
                           "only torch's may run" % (path, ", ".join(brought)))
    library.pardec_source_digest.restype = ctypes.c_char_p
    if library.pardec_source_digest().decode() != native_build.source_digest():
        raise _Stale()
    if cap is not None and library.pardec_select(cap) < 0:
        raise RuntimeError("%s has no variant for this CPU at or below the level asked" % path)
    kernel = NativeKernel(library, path, installed, _bind_openmp(library, _torch_openmp(before)),
                          build_id)
    if kernel.serial_loops:
        logger.info("OpenMP's threads sleep between parallel regions here (OMP_WAIT_POLICY="
                    "PASSIVE or GOMP_SPINCOUNT=0?): waking them took %.0f us a region, so the "
                    "native kernels run their loops on one thread", kernel.region_microseconds)
    _check(kernel)
    return kernel


def _installed() -> Optional[NativeKernel]:
    """The library built at install time, or None where the package has none usable (the
    reason logged)."""
    arch = os.environ.get(ARCH_VARIABLE, "native")
    if not INSTALLED.exists():
        return None
    if arch != "native" and arch not in native_build.LEVELS:
        return None  # another target than the installed variants: built at run time
    problem = native_file.problem(INSTALLED)
    if problem:
        raise RuntimeError("%s: %s; reinstalling fairseq_pardec restores it" % (INSTALLED, problem))
    try:
        kernel = _open(INSTALLED, True, "installed", native_build.LEVELS.get(arch, 1 << 20))
    except _Stale:
        logger.info("%s was built from other sources than the ones next to it (an in-place "
                    "build left behind by an edit); building them for this machine", INSTALLED)
        return None
    # its kernel choices apart from those of another variant (the suite's AVX2 pass)
    kernel.build_id = "installed-%s-%s" % (native_build.source_digest(), kernel.variant)
    logger.debug("native kernels: %s (%s)", INSTALLED, kernel.variant)
    return kernel


def _compiler() -> str:
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)),
                    None)
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return compiler


def _run(command: List[str], what: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError("%s failed: %s" % (what, result.stderr.strip()[-500:]))
    return result.stdout


def _build_flags() -> List[str]:
    return native_build.OPTIMIZE + ["-march=" + os.environ.get(ARCH_VARIABLE, "native")]


def _target(compiler: str, flags: List[str]) -> str:
    """What ``compiler`` with ``flags`` targets here: its version and its predefined macros
    (__AVX512F__, __FMA__, __ARM_FEATURE_SVE, ...: the instructions it may emit), digested."""
    version = _run([compiler, "--version"], compiler + " --version")
    macros = _run([compiler, *flags, "-E", "-dM", "-x", "c", os.devnull],
                  "%s %s" % (compiler, " ".join(flags)))
    text = "\0".join([version, " ".join(flags), "\n".join(sorted(macros.splitlines()))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _built(notes: List[str]) -> Path:
    """The run-time build for this machine: from the cache, or compiled into it, under the
    cache's lock (a process that finds another compiling waits and loads its build). A cached
    build whose file does not check out is removed and compiled again (said in ``notes``):
    loading it could kill the process, and so would every later run."""
    compiler = _compiler()
    flags = _build_flags()
    source = native_build.source_digest()
    root = native_cache.cache_root()
    path = root / native_cache.build_name(source, _target(compiler, flags))
    with native_cache.locked(root):
        problem = native_file.problem(path) if path.exists() else None
        if problem:
            native_file.remove(path)
            notes.append("the cached native kernels %s were damaged (%s): removed and built "
                         "again" % (path, problem))
        if path.exists():
            os.utime(path)  # in use: not pruned
        else:
            here = native_build.HERE
            with tempfile.TemporaryDirectory(dir=root, prefix=".tmp-") as scratch:
                built = Path(scratch) / path.name
                _run([compiler, *flags, "-shared", "-fPIC", "-DPARDEC_ISA=native",
                      "-DPARDEC_VARIANTS=X(native)", '-DPARDEC_SOURCE_DIGEST="%s"' % source,
                      "-I", str(here),
                      *(str(here / name) for name in native_build.COMMON_SOURCES
                        + native_build.KERNEL_SOURCES),
                      "-lm", "-o", str(built)], compiler)
                native_file.install(built, path)
            logger.info("native kernels built for this machine: %s", path)
        native_cache.prune(root, source)
    return path


def _load(notes: List[str]) -> NativeKernel:
    """The installed library, else the run-time build; what went wrong on the way is added to
    ``notes`` (told in one warning line by native_kernel)."""
    kernel = None
    try:
        kernel = _installed()
    except (OSError, RuntimeError) as error:
        notes.append("the installed native kernels cannot run here (%s)" % error)
    if kernel is None:
        path = _built(notes)
        inode = path.stat().st_ino
        try:
            kernel = _open(path, False, path.stem)
        except OSError as error:
            # dlopen refused a cached build whose file checks out (a library for another
            # machine put under this one's name): it would fail in every later run, so it is
            # removed and built again, as a damaged one is
            _remove_unloadable(path, inode, error, notes)
            path = _built(notes)
            kernel = _open(path, False, path.stem)
    return kernel


def _elf_machine(path) -> Optional[int]:
    """The ELF header's machine (62: x86-64, 183: AArch64, ...), or None where it is not ELF."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:4] != native_file.ELF_MAGIC:
        return None
    return int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")


def _remove_unloadable(path: Path, inode: int, error: OSError, notes: List[str]):
    """Remove the cached build ``path`` that dlopen refused, unless another process has put a
    new build there meanwhile (another inode); say why in ``notes``."""
    ours, its = _elf_machine("/proc/self/exe"), _elf_machine(path)
    # glibc reports a library of another architecture as "No such file or directory"
    why = ("built for another architecture (ELF machine %d, this process's is %d)" % (its, ours)
           if its is not None and ours is not None and its != ours else str(error))
    with native_cache.locked(path.parent):
        try:
            same = path.stat().st_ino == inode
        except FileNotFoundError:
            same = False
        if same:
            native_file.remove(path)
    notes.append("the cached native kernels %s cannot be loaded (%s): removed and built again"
                 % (path, why))


def _check(kernel: NativeKernel):
    """A product with ragged panels, every row count the kernel unrolls, bias, residual and
    ReLU, and a top two, against torch's."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * kernel.panel + 5, 37, generator=g)
    bias = torch.randn(weight.size(0), generator=g)
    panels = kernel.pack(weight)
    for rows in (1, 2, 3, 7, 8, 19):
        x = torch.randn(rows, weight.size(1), generator=g)
        add = torch.randn(rows, weight.size(0), generator=g)
        got = kernel.linear(x, panels, weight.size(0), bias, add, relu=True)
        want = (x.double() @ weight.double().t() + bias.double() + add.double()).relu().float()
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-5):
            raise RuntimeError("the built kernel miscomputes a test product")
    want = torch.log_softmax(torch.randn(3, 1000, generator=g) * 10, dim=-1)
    values, best = kernel.best_two(want)[:2]
    top = want.topk(2, dim=-1)
    if not (values.tolist() == top.values.tolist()
            and best.tolist() == top.indices[:, 0].tolist()):
        raise RuntimeError("the built kernel miscomputes a test top two")


def native_kernel() -> Optional[NativeKernel]:
    """The kernel, loaded (or built) and checked on first call; None where it cannot run here
    or ``$FAIRSEQ_PARDEC_NATIVE`` is off (UsageError where it is neither on nor off). Threads
    calling it together wait for the first one's load and get its result."""
    global _kernel, _reason, _tried
    if _tried:
        return _kernel
    with _first_use:
        if not _tried:
            if not env_flags.flag(SWITCH_VARIABLE, True):
                _reason = "%s=%s" % (SWITCH_VARIABLE, os.environ[SWITCH_VARIABLE].strip())
            else:
                notes: List[str] = []
                try:
                    _kernel = _load(notes)
                    if notes:
                        logger.warning("%s; the native kernels now load from %s",
                                       "; ".join(notes), _kernel.path)
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    _reason = "; ".join(notes + [str(error)])
                    logger.warning("native product kernel unavailable (%s); the fast step uses "
                                   "the library kernels", _reason)
            _tried = True
    return _kernel


def native_unavailable_reason() -> Optional[str]:
    """Why :func:`native_kernel` is None (None while it is available or not yet tried)."""
    return _reason
