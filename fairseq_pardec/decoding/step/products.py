"""The fast step's linear maps, and which CPU kernel multiplies how many rows.

Three kernels compute ``x W^T + b`` for the fast step: MKL's ``addmm`` on a transposed copy of
the weight, oneDNN's product with the weight packed once into its blocked layout, and the
project's native kernel (native_linear.c: the weight in panels, streamed once per call, with
no library around it). Which is fastest depends on the machine, the thread count and the
number of rows, and not by a little: on an AMD EPYC with two threads oneDNN ran a d256
decoder's chain of products 1.6x faster than ``addmm`` at one row and 2.9x faster at eight
(docs/results.md, "The fast step's products"; ``examples/decoder_products_cost.py``), and the
native kernel halved oneDNN's time inside a step at one row (docs/results.md, "A native
product kernel"), while for a hundred rows and more oneDNN is the fastest. So
:class:`KernelChoice` measures each kernel on the decoder's own weights, once per thread count,
for one row, a few rows, a batch's step and a batch's block, and each call takes the kernel
measured fastest for its row count.

All three round differently from fairseq's ``F.linear`` (about 1e-6 in float32); the margin
guard covers each (fast.py, DEFAULT_MARGIN; tests/test_fast_step.py runs every kernel).
"""

import os
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.step.native import native_kernel
from fairseq_pardec.decoding.step.output_projection import packs_on_onednn

# rows 1 | 2..16 | 17..64 | more, and the row count measured for each: a batch-1 step, a
# batch-1 block, a batch's step, a batch's block (or an encoder)
_BUCKET_LIMITS = (1, 16, 64)
_PROBE_ROWS = (1, 8, 32, 256)

MKL, ONEDNN, NATIVE = "mkl", "onednn", "native"
KERNELS = (MKL, ONEDNN, NATIVE)


def _bucket(rows: int) -> int:
    return sum(rows > limit for limit in _BUCKET_LIMITS)


class Linear:
    """``x -> x W^T + b`` on 2-D rows, optionally followed by a ReLU (fused into oneDNN's and
    the native product), with the weight kept in each available kernel's layout."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], relu: bool = False):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.relu = relu
        self.out_features = weight.size(0)
        self.transposed = weight.t().contiguous()
        cpu32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
                       if cpu32 and packs_on_onednn() else None)
        self.native = native_kernel() if cpu32 else None
        self.panels = None if self.native is None else self.native.pack(weight)

    @property
    def in_features(self) -> int:
        return self.transposed.size(0)

    def kernels(self) -> Tuple[str, ...]:
        """The kernels that can run this map here."""
        return tuple(k for k, ok in ((MKL, True), (ONEDNN, self.packed is not None),
                                     (NATIVE, self.panels is not None)) if ok)

    def __call__(self, x: Tensor, kernel: str, add: Optional[Tensor] = None) -> Tensor:
        """The product on ``kernel`` (MKL where that one cannot run), plus ``add`` (a residual,
        added after the bias; only for maps without ReLU)."""
        if self.relu and add is not None:
            raise ValueError("a residual is added after a product, not after its ReLU")
        if kernel == NATIVE and self.panels is not None:
            return self.native.linear(x, self.panels, self.out_features, self.bias, add, self.relu)
        if kernel == ONEDNN and self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "relu" if self.relu else "none", [], "")
        else:
            out = x @ self.transposed if self.bias is None else torch.addmm(
                self.bias, x, self.transposed)
            if self.relu:
                out.relu_()
        return out if add is None else out.add_(add)


def query_key_value(attn) -> Linear:
    """One product for a self-attention's queries, keys and values (fairseq's
    ``MultiheadAttention``), with the query scaling folded into the query rows."""
    scale = attn.scaling
    return Linear(torch.cat([attn.q_proj.weight * scale, attn.k_proj.weight, attn.v_proj.weight]),
                  torch.cat([attn.q_proj.bias * scale, attn.k_proj.bias, attn.v_proj.bias]))


class FeedForward:
    """A Transformer layer's feed-forward block on :class:`Linear` maps, as fairseq's encoder
    and decoder layers compute it: the final layer norm before or after, two products with the
    activation between (ReLU fused into the first product), the residual added."""

    def __init__(self, layer):
        relu = layer.activation_fn is F.relu
        self.fc1 = Linear(layer.fc1.weight, layer.fc1.bias, relu=relu)
        self.activation = None if relu else layer.activation_fn
        self.fc2 = Linear(layer.fc2.weight, layer.fc2.bias)
        self.norm = layer.final_layer_norm
        self.pre_norm = layer.normalize_before

    def __call__(self, x: Tensor, kernel: str) -> Tensor:
        residual = x
        if self.pre_norm:
            x = self.norm(x)
        hidden = self.fc1(x, kernel)
        if self.activation is not None:
            hidden = self.activation(hidden)
        x = self.fc2(hidden, kernel, add=residual)
        return x if self.pre_norm else self.norm(x)


# Names one kernel for every product of every fast step in the process, measuring nothing. The
# measured choice can differ between two runs on a noisy machine, and the kernels (with the
# native layer stack) round differently, so the scores a run prints can differ from another's in
# the 7th digit (never the tokens: the margin guard); a pinned kernel makes them repeat.
KERNEL_VARIABLE = "FAIRSEQ_PARDEC_KERNEL"


class KernelChoice:
    """Per row-count regime, which kernel runs a chain of :class:`Linear` maps fastest on this
    machine; measured when first asked and again when the thread count changes, unless
    ``$FAIRSEQ_PARDEC_KERNEL`` names one kernel for everything."""

    def __init__(self):
        self._threads: Optional[int] = None
        self._kernels: Sequence[str] = (MKL,) * len(_PROBE_ROWS)
        self._pinned = False
        pinned = os.environ.get(KERNEL_VARIABLE)
        if pinned:
            if pinned not in KERNELS:
                raise UsageError("%s=%s is not a product kernel; set it to one of %s, or unset it "
                                 "to let the fast step measure" % (KERNEL_VARIABLE, pinned,
                                                                   ", ".join(KERNELS)))
            self.pin(pinned)

    def pin(self, kernel: str):
        """Use one kernel for every row count from now on, measuring nothing (tests, and
        anyone comparing the kernels)."""
        if kernel not in KERNELS:
            raise ValueError("unknown product kernel %r (one of %s)" % (kernel, ", ".join(KERNELS)))
        self._kernels = (kernel,) * len(_PROBE_ROWS)
        self._pinned = True

    def measure(self, chain: List[List[Linear]], between: Optional[Callable[[int], object]] = None,
                rounds: int = 3, calls: int = 3):
        """Time ``chain`` (per layer, its maps in the order a step calls them) with each kernel,
        alternating, for each probe row count. ``between(rows)``: what a step runs besides the
        chain (the output projection), so that the weights leave the caches as they do in
        decoding."""
        if self._pinned:
            return
        self._threads = torch.get_num_threads()
        maps = [lin for layer in chain for lin in layer]
        kernels = [k for k in KERNELS if maps and all(k in lin.kernels() for lin in maps)]
        if len(kernels) < 2:
            self._kernels = (kernels[0] if kernels else MKL,) * len(_PROBE_ROWS)
            return
        # a generator of its own: measuring must not move the global random state (--sampling)
        noise = torch.Generator().manual_seed(0)
        choice = []
        with torch.no_grad():
            for rows in _PROBE_ROWS:
                inputs = {lin.in_features: torch.randn(rows, lin.in_features, generator=noise)
                          for lin in maps}

                def run(kernel: str):
                    for lin in maps:
                        lin(inputs[lin.in_features], kernel)
                    if between is not None:
                        between(rows)

                times = {kernel: [] for kernel in kernels}
                for kernel in kernels:
                    run(kernel)  # warm-up
                for _ in range(rounds):
                    for kernel in kernels:
                        for _ in range(calls):
                            start = time.perf_counter()
                            run(kernel)
                            times[kernel].append(time.perf_counter() - start)
                choice.append(min(kernels, key=lambda k: statistics.median(times[k])))
        self._kernels = tuple(choice)

    def pinned_to_library(self) -> bool:
        """True when pinned to a library kernel (MKL or oneDNN): nothing native runs then."""
        return self._pinned and self._kernels[0] != NATIVE

    def stale(self) -> bool:
        """True when the choice must be measured (first use, or another thread count)."""
        return not self._pinned and self._threads != torch.get_num_threads()

    def kernel_for(self, rows: int) -> str:
        return self._kernels[_bucket(rows)]

    def chosen(self) -> Tuple[str, ...]:
        """The kernel per regime: one row, 2-16 rows, 17-64 rows, more."""
        return tuple(self._kernels)
