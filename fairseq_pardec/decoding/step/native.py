"""The native kernels (native_linear.c, native_layers.c, native_scores.c): built on first use,
loaded with ctypes.

The fast step multiplies one to a few rows per product at batch 1, where the weight's read is
the whole cost and the library kernels' own overhead per call is larger than the read (see
native_linear.c); the rest of a decoder layer there is dispatch, which native_layers.c runs
without (a whole call's layer stack in one native call); native_scores.c finds each position's
best two scores for the engine. The kernels are small C files compiled here with the machine's
C compiler (``$CC``, else ``cc`` or ``gcc``) and ``-O3 -march=native -fopenmp``, once per source, compiler
and CPU: the library is cached under ``$FAIRSEQ_PARDEC_CACHE`` (default
``~/.cache/fairseq_pardec``), written under a temporary name and renamed, so that processes
decoding side by side never load a half-written file.

Where there is no compiler, the build fails, or the built kernel miscomputes a test product,
:func:`native_kernel` returns None and says why in :func:`native_unavailable_reason`; the fast
step then uses the library kernels (products.py), as it does with ``FAIRSEQ_PARDEC_NATIVE=0``.
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

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("native_linear.c", "native_layers.c", "native_scores.c")]
# -march: the machine's own instruction set unless FAIRSEQ_PARDEC_NATIVE_ARCH names another (the
# test suite's AVX2 pass builds for x86-64-v3, as it caps torch's kernels at AVX2)
ARCH_VARIABLE = "FAIRSEQ_PARDEC_NATIVE_ARCH"
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


def _flags():
    return ["-march=" + os.environ.get(ARCH_VARIABLE, "native")] + BASE_FLAGS

# the tables pardec_decoder_layers reads (native_layers.c): dims, per-layer weight pointers,
# per-layer cache pointers; their sizes, as the library reports them
LAYER_DIMS, LAYER_WEIGHTS, LAYER_STATE = 16, 18, 4
LAYERS_ABI = LAYER_DIMS * 10000 + LAYER_WEIGHTS * 100 + LAYER_STATE

_kernel = None
_reason: Optional[str] = None
_tried = False


class NativeKernel:
    """``linear`` over weights stored by ``pack`` (the panel layout of native_linear.c)."""

    def __init__(self, library: ctypes.CDLL):
        self._linear = library.pardec_linear
        self._linear.restype = None
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        library.pardec_panel_width.restype = ctypes.c_int
        self.panel = library.pardec_panel_width()
        self.decoder_layers = library.pardec_decoder_layers
        self.decoder_layers.restype = None
        self.decoder_layers.argtypes = [ctypes.c_void_p] * 8
        self._best_two = library.pardec_best_two
        self._best_two.restype = None
        self._best_two.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._buffers = threading.local()  # best_two's outputs, per thread
        self.embed_block = library.pardec_embed_block
        self.embed_block.restype = ctypes.c_int
        self.embed_block.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_void_p]
        library.pardec_layers_abi.restype = ctypes.c_int
        if library.pardec_layers_abi() != LAYERS_ABI:
            raise RuntimeError("native_layers.c and native.py disagree on the tables' layout")

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


    def best_two(self, scores: Tensor) -> Tuple[List[List[float]], List[int]]:
        """(N, V) contiguous float32, V >= 2 -> ([top, second] the two largest values of each
        row, the first column holding the largest), as lists (the engine reads them on the
        host). The output buffers are kept per row count and thread: at batch 1 the engine's
        Python around a step is as long as the step's arithmetic."""
        rows, width = scores.shape
        buffers = getattr(self._buffers, "best_two", None)
        if buffers is None:
            buffers = self._buffers.best_two = {}
        out = buffers.get(rows)
        if out is None:
            values = np.empty((rows, 2), dtype=np.float32)
            best = np.empty(rows, dtype=np.int64)
            out = buffers[rows] = (values, best, values.ctypes.data, best.ctypes.data)
        values, best, values_at, best_at = out
        self._best_two(scores.data_ptr(), rows, width, values_at, best_at,
                       torch.get_num_threads())
        return values.tolist(), best.tolist()


def _library_path(compiler: str) -> Path:
    """Where the build for this source, compiler and CPU lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = "".join(line for line in info if line.startswith(("flags", "model name")))
    except OSError:
        pass
    sources = [source.read_text() for source in SOURCES]
    digest = hashlib.sha256("\0".join(sources + [" ".join(_flags()), version, cpu])
                            .encode()).hexdigest()[:16]
    root = Path(os.environ.get("FAIRSEQ_PARDEC_CACHE",
                               Path.home() / ".cache" / "fairseq_pardec"))
    return root / ("native_linear-%s.so" % digest)


def _build() -> NativeKernel:
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)),
                    None)
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    path = _library_path(compiler)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            built = Path(scratch) / path.name
            result = subprocess.run([compiler, *_flags(), *map(str, SOURCES), "-lm", "-o", str(built)],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise RuntimeError("%s failed: %s" % (compiler, result.stderr.strip()[-500:]))
            os.replace(built, path)
    # torch is imported, so the OpenMP runtime the library needs is torch's, already loaded
    kernel = NativeKernel(ctypes.CDLL(str(path)))
    _check(kernel)
    return kernel


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
    values, best = kernel.best_two(want)
    top = want.topk(2, dim=-1)
    if not (values == top.values.tolist() and best == top.indices[:, 0].tolist()):
        raise RuntimeError("the built kernel miscomputes a test top two")


def native_kernel() -> Optional[NativeKernel]:
    """The kernel, built and checked on first call; None where it cannot run here."""
    global _kernel, _reason, _tried
    if not _tried:
        _tried = True
        if os.environ.get("FAIRSEQ_PARDEC_NATIVE", "1") == "0":
            _reason = "FAIRSEQ_PARDEC_NATIVE=0"
        else:
            try:
                _kernel = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _reason = str(error)
                logger.warning("native product kernel unavailable (%s); the fast step uses "
                               "the library kernels", _reason)
    return _kernel


def native_unavailable_reason() -> Optional[str]:
    """Why :func:`native_kernel` is None (None while it is available or not yet tried)."""
    return _reason
