"""The fast step's linear maps, and which CPU kernel multiplies how many rows.

Three kernels compute ``x W^T + b`` for the fast step: MKL's ``addmm`` on a transposed copy of
the weight, oneDNN's product with the weight packed once into its blocked layout, and the
project's native kernel (native/linear.c: the weight in panels, streamed once per call, with
no library around it). Which is fastest depends on the machine, the thread count and the
number of rows, and not by a little: on an AMD EPYC with two threads oneDNN ran a d256
decoder's chain of products 1.6x faster than ``addmm`` at one row and 2.9x faster at eight
(docs/results.md, "The fast step's products"; ``examples/decoder_products_cost.py``), and the
native kernel halved oneDNN's time inside a step at one row (docs/results.md, "A native
product kernel"), while for a hundred rows and more oneDNN is the fastest. So
:class:`KernelChoice` picks a kernel per row-count regime (one row, a few rows, a batch's step,
a batch's block) on the decoder's own weights: by rule where one kernel always wins, by
measurement elsewhere, and keeps the choice per machine in the kernels' cache.

All three round differently from fairseq's ``F.linear`` (about 1e-6 in float32); the margin
guard covers each (cpu/fast.py, DEFAULT_MARGIN; tests/test_fast_step.py runs every kernel).
"""

import functools
import hashlib
import json
import os
import platform
import statistics
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.errors import UsageError
from fairseq_pardec.native import build as native_build
from fairseq_pardec.native.library import native_kernel
from fairseq_pardec.native.cache import ChoiceCache
from fairseq_pardec.decoding.step import onednn

# rows 1 | 2..16 | 17..64 | more, and the row count measured for each: a batch-1 step, a
# batch-1 block, a batch's step, a batch's block (or an encoder)
_BUCKET_LIMITS = (1, 16, 64)
_PROBE_ROWS = (1, 8, 32, 256)

MKL, ONEDNN, NATIVE = "mkl", "onednn", "native"
KERNELS = (MKL, ONEDNN, NATIVE)

# below this share of real positions in a padded batch, the position-wise products run on the
# real positions alone (the encoder, the sources' keys and values): a queue's texts encoded
# together are far apart in length
PACK_BELOW = 0.85

# Per regime, the kernel kept unless another is measured faster by a clear margin, best first
# among those that run. At one row and a few rows a layer stack's kernel is not measured at all
# where the native kernel runs: there it also runs a decoder call's (or an encoder's) whole
# layer stack in one native call (cpu/fast.py, cpu/layer_stack.py), which timing the products alone
# does not see. Timed alone, the
# products of a batch-1 step came out close enough between the native kernel and MKL on an
# Intel Xeon that the choice fell on MKL in about half the runs, and those runs decoded at half
# the speed (12.9-14.4 against 22.3-24.5 sentences a second). For a batch's step the native
# kernel was the fastest where measured (AMD EPYC, up to 64 rows), for a batch's block a
# library kernel (docs/results.md, "A native product kernel").
_PREFERRED = ((NATIVE, ONEDNN, MKL), (NATIVE, ONEDNN, MKL), (NATIVE, ONEDNN, MKL),
              (ONEDNN, MKL, NATIVE))
_NATIVE_BY_RULE = (True, True, False, False)
# another kernel replaces the preferred one only when its median time is this much shorter, or
# more where the two kernels' own times spread more than that (a loaded machine)
_MARGIN = 0.15


def _bucket(rows: int) -> int:
    # asked twice per decoder call: comparisons, not a generator over _BUCKET_LIMITS
    one, few, batch = _BUCKET_LIMITS
    return 0 if rows <= one else 1 if rows <= few else 2 if rows <= batch else 3


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
        self.packed = onednn.pack(weight) if cpu32 and onednn.packs_on_onednn() else None
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
            out = onednn.linear(x, self.packed, self.bias, self.relu)
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


class _Chosen(NamedTuple):
    """One published choice; replaced whole, never changed in place (threads read it while
    another measures)."""
    threads: Optional[int]
    signature: Optional[str]
    kernels: Tuple[str, ...]
    pinned: bool


def _decide(times: Dict[str, List[float]], preferred: Sequence[str]) -> str:
    """The preferred kernel among those timed, unless another's median is shorter by more than
    _MARGIN and than both kernels' spread (their interquartile ranges relative to their
    medians): a difference within the noise keeps the choice where it was."""
    median = {k: statistics.median(t) for k, t in times.items()}

    def spread(kernel: str) -> float:
        ordered = sorted(times[kernel])
        if len(ordered) < 4 or median[kernel] <= 0:
            return 0.0
        q1, _, q3 = statistics.quantiles(ordered, n=4)
        return (q3 - q1) / median[kernel]

    keep = next(k for k in preferred if k in times)
    best = min(median, key=median.get)
    if best == keep:
        return keep
    margin = max(_MARGIN, spread(keep) + spread(best))
    return best if median[best] < median[keep] * (1 - margin) else keep


@functools.lru_cache(maxsize=None)
def _machine() -> str:
    """What tells apart the stored choices of machines sharing a cache."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = "".join(sorted({line for line in info
                                  if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return "%s %s" % (platform.node(), hashlib.sha256(
        (platform.machine() + "\0" + cpu).encode()).hexdigest()[:16])


class KernelChoice:
    """Per row-count regime, which kernel runs a chain of :class:`Linear` maps on this machine:
    chosen when first asked and again when the thread count changes, unless
    ``$FAIRSEQ_PARDEC_KERNEL`` names one kernel for everything.

    A choice is made once per machine, kernel build, thread count and chain of shapes, and
    stored in the kernels' cache (native_cache.ChoiceCache): later processes read it, so that
    two runs of the same command run the same kernels. Safe to share between threads: a choice
    is published whole, and threads that find it stale together choose once."""

    def __init__(self):
        self._chosen = _Chosen(None, None, (MKL,) * len(_PROBE_ROWS), False)
        self._choosing = threading.Lock()
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
        with self._choosing:  # after a measurement in flight, not overwritten by it
            self._chosen = _Chosen(None, None, (kernel,) * len(_PROBE_ROWS), True)

    def measure(self, chain: List[List[Linear]], between: Optional[Callable[[int], object]] = None,
                rounds: int = 5, calls: int = 3, warmup: int = 2):
        """Choose the kernels for ``chain`` (per layer, its maps in the order a step calls
        them): the choice stored for this machine, else by rule for few rows (where the native
        kernel runs) and by timing each kernel for the other regimes, after ``warmup`` runs,
        ``rounds`` times ``calls`` runs alternating between kernels. ``between(rows)``: what a
        step runs besides the chain (the output projection), so that the weights leave the
        caches as they do in decoding."""
        if self._chosen.pinned:
            return
        threads = torch.get_num_threads()
        maps = [lin for layer in chain for lin in layer]
        kernels = tuple(k for k in KERNELS if maps and all(k in lin.kernels() for lin in maps))
        signature = json.dumps([[[lin.out_features, lin.in_features, lin.relu] for lin in layer]
                                for layer in chain] + [list(kernels), between is not None])
        with self._choosing:
            chosen = self._chosen
            if chosen.pinned or (chosen.threads, chosen.signature) == (threads, signature):
                return  # pinned, or chosen by another thread meanwhile
            choice = self._stored_or_chosen(chain, kernels, between, threads, signature,
                                            rounds, calls, warmup)
            self._chosen = _Chosen(threads, signature, choice, False)

    def _stored_or_chosen(self, chain: List[List[Linear]], kernels: Tuple[str, ...], between,
                          threads: int, signature: str, rounds: int, calls: int,
                          warmup: int) -> Tuple[str, ...]:
        maps = [lin for layer in chain for lin in layer]
        if len(kernels) < 2:
            return (kernels[0] if kernels else MKL,) * len(_PROBE_ROWS)
        native = native_kernel()
        cache = ChoiceCache(native.build_id if native is not None else "library-kernels")
        key = json.dumps([_machine(), threads, torch.__version__, signature])
        stored = cache.load(key)
        if (isinstance(stored, list) and len(stored) == len(_PROBE_ROWS)
                and all(k in kernels for k in stored)):
            return tuple(stored)
        # a chain of layers of several products each: a layer stack (an output projection
        # alone is timed in every regime)
        stack = any(len(layer) > 1 for layer in chain)
        choice = []
        for regime, rows in enumerate(_PROBE_ROWS):
            if NATIVE in kernels and stack and _NATIVE_BY_RULE[regime]:
                choice.append(NATIVE)
            else:
                times = _timed(maps, kernels, between, rows, rounds, calls, warmup)
                choice.append(_decide(times, _PREFERRED[regime]))
        cache.store(key, choice, native_build.source_digest())
        return tuple(choice)

    def pinned_to_library(self) -> bool:
        """True when pinned to a library kernel (MKL or oneDNN): nothing native runs then."""
        chosen = self._chosen
        return chosen.pinned and chosen.kernels[0] != NATIVE

    def stale(self) -> bool:
        """True when the choice must be made (first use, or another thread count)."""
        chosen = self._chosen
        return not chosen.pinned and chosen.threads != torch.get_num_threads()

    def kernel_for(self, rows: int) -> str:
        return self._chosen.kernels[_bucket(rows)]

    def chosen(self) -> Tuple[str, ...]:
        """The kernel per regime: one row, 2-16 rows, 17-64 rows, more."""
        return tuple(self._chosen.kernels)


def _timed(maps: List[Linear], kernels: Sequence[str], between, rows: int, rounds: int,
           calls: int, warmup: int) -> Dict[str, List[float]]:
    """Each kernel's time per run of the chain on ``rows`` rows, the runs alternating between
    kernels (a machine that slows down for a while slows each of them)."""
    # a generator of its own: measuring must not move the global random state (--sampling)
    noise = torch.Generator().manual_seed(0)
    times: Dict[str, List[float]] = {kernel: [] for kernel in kernels}
    with torch.no_grad():
        inputs = {lin.in_features: torch.randn(rows, lin.in_features, generator=noise)
                  for lin in maps}

        def run(kernel: str):
            for lin in maps:
                lin(inputs[lin.in_features], kernel)
            if between is not None:
                between(rows)

        for _ in range(warmup):
            for kernel in kernels:
                run(kernel)
        for _ in range(rounds):
            for kernel in kernels:
                for _ in range(calls):
                    start = time.perf_counter()
                    run(kernel)
                    times[kernel].append(time.perf_counter() - start)
    return times
