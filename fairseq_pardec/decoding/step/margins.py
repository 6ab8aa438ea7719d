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
  ddtp-de-en models, 160 sentences each): at most 4.6e-5 (step/fast.py). The lean step differs
  far less (block products and oneDNN's vocabulary projection: ~1e-6).

:data:`CPU_FP32_MARGIN` is ten times the CPU measurement (the fast step's DEFAULT_MARGIN).
:data:`CUDA_FP32_MARGIN` is set by the analysis above, not yet by a measurement: cuBLAS picks
its tiling and split-K per shape, which reorders the same sums the CPU kernels reorder; the bound
is above the worst-case rounding of the last product at d = 256 and twenty times the CPU
measurement on the same models. tests/test_cuda_guard.py measures the CUDA step against
fairseq's modules on a GPU and asserts the difference stays under a tenth of it; a model much
wider than d = 1024 should be measured the same way before its outputs are called identical.

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

from typing import Optional

import torch

from fairseq_pardec.errors import UsageError

# |log-prob - fairseq's| bound for a float32 step on the CPU (the fast step's measurement x 10;
# tests/test_fast_step.py keeps the measured difference under a tenth of it)
CPU_FP32_MARGIN = 5e-4

# |log-prob - fairseq's| bound for a float32 step on CUDA, from the rounding analysis above; to be
# measured on a GPU (tests/test_cuda_guard.py asserts the measured difference stays under a
# tenth of it)
CUDA_FP32_MARGIN = 1e-3


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
