"""The fast step's linear maps, and which CPU kernel multiplies how many rows.

Two kernels compute ``x W^T + b`` for the fast step: MKL's ``addmm`` on a transposed copy of the
weight, and oneDNN's product with the weight packed once into its blocked layout. Which is faster
depends on the machine, the thread count and the number of rows, and not by a little: on an AMD
EPYC with two threads oneDNN ran a d256 decoder's chain of products 1.6x faster at one row and
2.9x faster at eight, while with one thread ``addmm`` was 1.3x faster at one row
(docs/results.md, "The fast step's products"; ``examples/decoder_products_cost.py``). So
:class:`KernelChoice` measures both on the decoder's own weights, once per thread count, for
one row, a few rows and many (the three regimes of decoding: batch-1 steps, batch-1 blocks,
batches), and each call takes the kernel measured faster for its row count.

Both kernels round differently from fairseq's ``F.linear`` (about 1e-6 in float32); the margin
guard covers either (fast.py, DEFAULT_MARGIN; tests/test_fast_step.py runs both).
"""

import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.decoding.step.output_projection import packs_on_onednn

# rows 1 | 2..16 | more, and the row count measured for each
_BUCKET_LIMITS = (1, 16)
_PROBE_ROWS = (1, 8, 64)


def _bucket(rows: int) -> int:
    return sum(rows > limit for limit in _BUCKET_LIMITS)


class Linear:
    """``x -> x W^T + b`` on 2-D rows, optionally followed by a ReLU (fused into oneDNN's
    product), with the weight kept in both kernels' layouts."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], relu: bool = False):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.relu = relu
        self.transposed = weight.t().contiguous()
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
                       if packs_on_onednn() and weight.device.type == "cpu"
                       and weight.dtype == torch.float32 else None)

    @property
    def in_features(self) -> int:
        return self.transposed.size(0)

    def __call__(self, x: Tensor, onednn: bool) -> Tensor:
        if onednn and self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "relu" if self.relu else "none", [], "")
        if self.bias is not None:
            out = torch.addmm(self.bias, x, self.transposed)
        else:
            out = x @ self.transposed
        return out.relu_() if self.relu else out


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

    def __call__(self, x: Tensor, onednn: bool) -> Tensor:
        residual = x
        if self.pre_norm:
            x = self.norm(x)
        hidden = self.fc1(x, onednn)
        if self.activation is not None:
            hidden = self.activation(hidden)
        x = self.fc2(hidden, onednn).add_(residual)
        return x if self.pre_norm else self.norm(x)


class KernelChoice:
    """Per row-count regime, whether oneDNN's packed product is the faster kernel for a chain
    of :class:`Linear` maps on this machine; measured when first asked and again when the thread
    count changes."""

    def __init__(self):
        self._threads: Optional[int] = None
        self._onednn: Sequence[bool] = (False,) * len(_PROBE_ROWS)
        self._pinned = False

    def pin(self, onednn: bool):
        """Use one kernel for every row count from now on, measuring nothing (tests, and
        anyone comparing the kernels)."""
        self._onednn = (onednn,) * len(_PROBE_ROWS)
        self._pinned = True

    def measure(self, chain: List[List[Linear]], between: Optional[Callable[[Tensor], object]] = None,
                rounds: int = 3, calls: int = 3):
        """Time ``chain`` (per layer, its maps in the order a step calls them) with each kernel,
        alternating, for each probe row count. ``between``: what a step runs after the chain
        (the output projection), so that the weights leave the caches as they do in decoding."""
        if self._pinned:
            return
        self._threads = torch.get_num_threads()
        if not chain or not any(lin.packed is not None for layer in chain for lin in layer):
            self._onednn = (False,) * len(_PROBE_ROWS)
            return
        width = chain[0][0].in_features
        # a generator of its own: measuring must not move the global random state (--sampling)
        noise = torch.Generator().manual_seed(0)
        choice = []
        with torch.no_grad():
            for rows in _PROBE_ROWS:
                inputs = {lin.in_features: torch.randn(rows, lin.in_features, generator=noise)
                          for layer in chain for lin in layer}

                def run(onednn: bool):
                    for layer in chain:
                        for lin in layer:
                            lin(inputs[lin.in_features], onednn)
                    if between is not None:
                        between(inputs[width])

                times = {False: [], True: []}
                for onednn in (False, True):
                    run(onednn)  # warm-up
                for _ in range(rounds):
                    for onednn in (False, True):
                        for _ in range(calls):
                            start = time.perf_counter()
                            run(onednn)
                            times[onednn].append(time.perf_counter() - start)
                choice.append(statistics.median(times[True]) < statistics.median(times[False]))
        self._onednn = tuple(choice)

    def stale(self) -> bool:
        """True when the choice must be measured (first use, or another thread count)."""
        return not self._pinned and self._threads != torch.get_num_threads()

    def onednn_for(self, rows: int) -> bool:
        return self._onednn[_bucket(rows)]
