"""How far a decoder step's log-probabilities may stray from fairseq's: the margin each step declares.

fairseq's greedy search computes one position per row and step, at the batch's shapes. A step
that computes the same function otherwise (a block of several positions per row, fused or
reordered products, another kernel for the vocabulary projection, keys and values cached from
such blocks) rounds otherwise, so near-ties can go the other way. Each step therefore declares
``margin``: a bound on |its log-probability - fairseq's| in float32, which the engine's margin
guard (draft_verify/margin_guard.py) turns into "certain" and "close" decisions; and
``one_position_exact``: whether a plain greedy step (one position per row, on a cache filled
only by such steps) runs fairseq's own operations on fairseq's shapes and so rounds exactly as
fairseq does.

The bounds, in float32 (unit roundoff u = 2**-24 = 6.0e-8):

* A dot product of n terms computed in any order differs from the exact one by at most
  gamma_n * sum|a_i b_i| with gamma_n ~ n u (worst case; ~sqrt(n) u for the random rounding seen
  in practice), so two orders differ by at most twice that. A log-probability is a logit minus
  log-sum-exp of all logits, which moves by at most the largest logit error: twice it at most
  in the difference.
* For the project's d256 models (vocabulary projection over d = 256, feed-forward 1024, output
  embedding entries ~ d**-0.5 against final layer-norm features ~ 1: sum|a_i b_i| ~ 12 for a
  logit), the last product alone is worst-case 2 * 256 u * 12 ~ 4e-4 per logit, ~ 2e-5 with
  sqrt(n) rounding; the layers below add their own, damped by the layer norms.
* Measured on the CPU (the fast step and encoder against fairseq's modules, d256 UA-GEC and
  ddtp-de-en models, 160 sentences each): at most 4.6e-5 (cpu/fast.py). The lean step differs
  far less (block products and oneDNN's vocabulary projection: ~1e-6).

:data:`CPU_FP32_MARGIN` is ten times the CPU measurement (the fast step's DEFAULT_MARGIN).
:data:`CUDA_FP32_MARGIN` is ten times the largest difference measured on a GPU: the static step
against fairseq's one-token steps on the GPU (examples/margin_spread.py --cuda), every position
of the first 60 test sentences' greedy outputs of three trained models (d128 and d256 UA-GEC,
d256 ddtp-de-en, transformer_wmt_en_de sizes), one position a call at batch 1 and 8 and whole
outputs as one block: at most 2.34e-5 (NVIDIA H200, torch 2.11, CUDA 13, commit `489c304`,
2026-11-28; docs/results.md). It was 1e-3 by the analysis above before that run.

These constants are floors, not the whole bound: the rounding grows with the model's width,
depth and the size of its activations, and two models are not every model. Before its first
batch on a model, every guarded generator measures its step (and the guard's teacher-forced
pass) against fairseq's arithmetic on that model's own input (step/calibration.py,
step/rounding_spread.py), and the margin in force is the larger of the floor and
:data:`MEASURED_HEADROOM` (20) times the measured spread (:func:`margins_in_force`).

The margin guard's first try at a close call (draft_verify/margin_guard.py) is one pass of the
lean step over the decided prefix as one block: fairseq's operations, each product over the
prefix's rows at once where fairseq's steps run one row at a time. Those products round
otherwise only in the order of their sums. Measured on the CPU against fairseq's one-token
steps (the one-row steps, bit for bit fairseq's) after up to 11 prefixes of each of the 300 test
sentences' greedy outputs (10 lengths drawn at random and the whole output: 2,512 and 2,670
prefixes), every log-probability of the vocabulary: at most 7.6e-6 on the ddtp-de-en model and
1.6e-5 on the demo's UA-GEC model (median 2.9e-6); with AVX2 kernels
(``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``)
7.6e-6 and 1.2e-5. :data:`CPU_FP32_TEACHER_FORCED_MARGIN` is ten times the largest
(tests/test_fast_step.py keeps the difference under a tenth of it); on CUDA none is claimed yet
and every close call is replayed step by step.

TF32: with ``torch.backends.cuda.matmul.fp32_precision = 'tf32'`` (set by ``allow_tf32 = True``
or ``torch.set_float32_matmul_precision('high' | 'medium')``) float32 products round their
inputs to 10 mantissa bits (u = 2**-11): the same analysis gives differences of ~1e-2 to 1e-1
per logit, so a guard wide enough would hand a large share of all positions to fairseq's replay
(one sequential decode each) and no bound has been measured. Lossless generators refuse that
setting instead (:func:`refuse_reduced_precision_matmuls`); fairseq-generate never turns it on.

float16 / bfloat16: differences of ~1e-3 to 1e-2 change choices on real data; no bound is
claimed and no guard runs (``margin`` None): outputs are not guaranteed identical to fairseq's
(docs/methods.md, "divergence audit").
"""

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_pardec.errors import UsageError

logger = logging.getLogger(__name__)
_unguarded_warned = set()

# |log-prob - fairseq's| bound for a float32 step on the CPU (the fast step's measurement x 10;
# tests/test_fast_step.py keeps the measured difference under a tenth of it)
CPU_FP32_MARGIN = 5e-4

# |log-prob - fairseq's| bound for a float32 step on CUDA: ten times the largest difference measured
# on three trained models on an H200 (module doc; tests/test_cuda_guard.py asserts the
# measured difference stays under a tenth of it)
CUDA_FP32_MARGIN = 2.5e-4

# the margin in force is at least this many times the spread measured on the model itself: ten,
# the rule every margin here follows, times two for what a measurement of a few hundred positions
# misses (the largest difference grew 1.2-1.75 times from about 100 to 1,500 positions on a
# transformer_wmt_en_de UA-GEC model and at transformer_vaswani_wmt_en_de_big width:
# tests/test_margins_in_force.py, docs/results.md)
MEASURED_HEADROOM = 20

# a margin in force this many times its floor hands so many choices to fairseq's slower
# arithmetic that the user is told (calibration.py)
WIDE_MARGIN_WARNING = 10


# |log-prob - fairseq's| bound for the lean step's teacher-forced pass over a prefix on the CPU, in
# float32 (the margin guard's first try at a close call: margin_guard._teacher_forced_choice):
# ten times the measured difference (module doc)
CPU_FP32_TEACHER_FORCED_MARGIN = 1.6e-4


def teacher_forced_margin(device, dtype) -> Optional[float]:
    """The margin of the lean step's teacher-forced pass over a whole prefix against fairseq's
    one-token steps; None where none is claimed (CUDA and half precision: the close call is then
    replayed step by step)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.float64):
        return None
    return CPU_FP32_TEACHER_FORCED_MARGIN


def rounding_margin(device, dtype) -> Optional[float]:
    """The margin of a step computing fairseq's function in another order on ``device`` in
    ``dtype``: the float32 bound (float64 rounds far less: the bound holds a fortiori), or None
    where no bound is claimed (half precision)."""
    if dtype not in (torch.float32, torch.float64):
        return None
    if torch.device(device).type == "cuda":
        return CUDA_FP32_MARGIN
    return CPU_FP32_MARGIN


def warn_unguarded_precision(dtype):
    """Say once per dtype that a lossless generator decoding in half precision gives no
    guarantee: no margin is claimed there, so no guard runs (module doc)."""
    if dtype in (torch.float32, torch.float64) or dtype in _unguarded_warned:
        return
    _unguarded_warned.add(dtype)
    logger.warning(
        "decoding in %s: outputs are not guaranteed identical to float32 greedy (a verified "
        "block rounds otherwise than a one-token step, by about 1e-3 to 1e-2 in half precision, "
        "and no margin guard runs there); decode in float32 for identical outputs",
        str(dtype).split(".")[-1])


def reduced_precision_matmuls() -> Optional[str]:
    """The setting that lets CUDA float32 matrix products round below float32 (TF32 or bfloat16),
    named as the user would have written it; None where they run in float32."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # torch >= 2.9; "none": inherited
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    if precision in ("ieee", "none"):
        return None
    try:  # the legacy reading (it fails where both APIs were used)
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        return "torch.backends.cuda.matmul.fp32_precision = %r" % precision
    if legacy == "high":  # what allow_tf32 = True sets too
        return ("torch.backends.cuda.matmul.allow_tf32 = True "
                "(or torch.set_float32_matmul_precision('high'))")
    if legacy != "highest":
        return "torch.set_float32_matmul_precision(%r)" % legacy
    if precision is not None:
        return "torch.backends.cuda.matmul.fp32_precision = %r" % precision
    return None


def refuse_reduced_precision_matmuls(device, dtype):
    """Raise :class:`UsageError` where a lossless generator would decode float32 on CUDA with
    TF32 (or bfloat16) matrix products: its margin would not bound the rounding (module doc)."""
    if torch.device(device).type != "cuda" or dtype != torch.float32:
        return
    setting = reduced_precision_matmuls()
    if setting is not None:
        raise UsageError(
            "%s makes CUDA round float32 matrix products to TF32 (or bfloat16), and lossless generators then "
            "cannot guarantee fairseq's output; set torch.set_float32_matmul_precision('highest') "
            "(or decode with --fp16, not guaranteed identical either)" % setting)


@dataclass(frozen=True)
class MarginsInForce:
    """The margins a guarded generator decides with on one model, step, device and dtype.

    ``step``: the guard's bound on the step's log-probabilities; ``teacher_forced``: the
    teacher-forced pass's, None where every close call is replayed step by step;
    ``step_spread`` / ``pass_spread``: what was measured on the model (None: not measured),
    over ``positions`` positions; ``final``: every row the measurement takes was measured, so
    these margins hold for as long as the weights do."""

    step: float
    teacher_forced: Optional[float]
    step_spread: Optional[float] = None
    pass_spread: Optional[float] = None
    positions: int = 0
    final: bool = False

    def describe(self) -> str:
        """``margin 5.0e-04 (measured 2.1e-05), pass 2.3e-04 (measured 2.3e-05)``"""
        def part(value, measured):
            text = "%.1e" % value
            return text + (" (measured %.1e)" % measured if measured is not None else "")

        return "margin %s, pass %s" % (
            part(self.step, self.step_spread),
            "replay" if self.teacher_forced is None
            else part(self.teacher_forced, self.pass_spread))


def margins_in_force(step_floor: float, pass_floor: Optional[float], step_spread: float,
                     pass_spread: Optional[float], positions: int) -> MarginsInForce:
    """The margins for a model whose step strays ``step_spread`` and whose teacher-forced pass
    strays ``pass_spread`` from fairseq's (measured): each the larger of its floor and
    :data:`MEASURED_HEADROOM` times the measurement. No pass where none is claimed on this
    device and dtype (``pass_floor`` None), or where its margin would not be below the step's:
    it could then certify nothing the step's margin leaves open."""
    step = max(step_floor, MEASURED_HEADROOM * step_spread)
    teacher_forced = None
    if pass_floor is not None and pass_spread is not None:
        teacher_forced = max(pass_floor, MEASURED_HEADROOM * pass_spread)
        if teacher_forced >= step:
            teacher_forced = None
    return MarginsInForce(step, teacher_forced, step_spread, pass_spread, positions)
