"""The margins in force on a model: its step's rounding measured on its own first batch.

The declared margins (step/margins.py) are floors measured on a few models. A wider or deeper
model, or one with larger activations, rounds further from fairseq, and a margin too small for it
would let a token differ without a word. So before a guarded generator decodes its first batch on
a model, it measures how far its step, and the margin guard's teacher-forced pass, stray from
fairseq's own arithmetic along fairseq's greedy paths of the batch's first rows
(step/rounding_spread.py), and decides with the larger of each floor and twenty times the
measurement (:func:`margins.margins_in_force`).

The measurement is kept on the model, per step kind, device and dtype, while the weights stay
(step/weights_key.py): a process measures a model once, whatever generators it builds on it
(the benchmark builds several). A batch of fewer rows than :data:`ROWS` is measured whole,
and the next batches add theirs until :data:`ROWS` rows are measured; the margins in force can
only grow meanwhile, and every one of them is at least its floor. It costs a few of fairseq's greedy steps per row:
:data:`ROWS` rows of up to :data:`TOKENS` tokens, less than loading the checkpoint. It is not
kept on disk: a file would have to be keyed by the weights' bytes, whose hash costs about as
much as the measurement, and by the CPU's kernels, which round differently per machine.
"""

import dataclasses
import logging
import threading
from typing import Optional

from fairseq_pardec.decoding.step import rounding_spread
from fairseq_pardec.decoding.step.lean import lean_supported
from fairseq_pardec.decoding.step.margins import (WIDE_MARGIN_WARNING, MarginsInForce,
                                                  margins_in_force, teacher_forced_margin)
from fairseq_pardec.decoding.step.weights_key import WeightsKey

logger = logging.getLogger(__name__)

# rows of the first batch measured, and tokens of fairseq's greedy path per row
ROWS = 8
TOKENS = 32

_lock = threading.Lock()


def _key(model, step) -> tuple:
    weight = model.decoder.embed_tokens.weight
    return type(step).__name__, weight.device, weight.dtype


class _Measured:
    """What has been measured on one model, step kind, device and dtype, at one state of its
    weights: the rows so far, the largest spreads and the margins they put in force."""

    def __init__(self, weights: tuple):
        self.weights = weights
        self.rows = 0
        self.positions = 0
        self.step_spread = 0.0
        self.pass_spread: Optional[float] = None
        self.in_force: Optional[MarginsInForce] = None


def margins_for(model, step, encode, net_input, bos: int, eos: int, src_pad: int, pad: int,
                max_len: int = TOKENS) -> MarginsInForce:
    """The margins in force for ``step`` on ``model`` (its declared ``margin`` must not be
    None). Until :data:`ROWS` rows have been measured on these weights, the first rows of this
    batch (``net_input``) are measured too, and the margins take the largest spread seen: at
    batch 1 the first batches measure a row each (``src_pad``, ``pad``: the source's and the
    target's padding; ``max_len``: the batch's length limit, beyond which nothing is
    decoded)."""
    kept = model.__dict__.setdefault("_pardec_margins", {})
    key = _key(model, step)
    # built once a model: building walks the module tree, a look at it reads each parameter
    watcher = model.__dict__.get("_pardec_weights_key")
    if watcher is None:
        watcher = model.__dict__["_pardec_weights_key"] = WeightsKey(model)
    weights = watcher.key()
    with _lock:
        measured = kept.get(key)
        if measured is None or measured.weights != weights:
            measured = kept[key] = _Measured(weights)
        if measured.rows >= ROWS:
            return measured.in_force
        before = measured.in_force
        _measure_more(measured, model, step, encode, net_input, bos, eos, src_pad, pad,
                      max(1, min(TOKENS, max_len)))
        in_force = measured.in_force
    if before is None or (in_force.step, in_force.teacher_forced) != (before.step,
                                                                     before.teacher_forced):
        logger.info("%s on %s %s: %s (%d rows measured)", type(step).__name__, key[1],
                    str(key[2]).split(".")[-1], in_force.describe(), measured.rows)
    if in_force.step > WIDE_MARGIN_WARNING * step.margin and (
            before is None or before.step <= WIDE_MARGIN_WARNING * step.margin):
        logger.warning(
            "this model's decoder step strays %.1e from fairseq's arithmetic (the margin in force "
            "is %.1e, %.0f times the usual): the margin guard will hand many choices to fairseq's "
            "slower arithmetic; outputs stay identical to greedy",
            in_force.step_spread, in_force.step, in_force.step / step.margin)
    return in_force


def _measure_more(measured: _Measured, model, step, encode, net_input, bos, eos, src_pad, pad,
                  tokens):
    weight = model.decoder.embed_tokens.weight
    pass_floor = teacher_forced_margin(weight.device, weight.dtype)
    if not lean_supported(model.decoder):  # the guard runs no pass on such a decoder
        pass_floor = None
    ways = ("step", "block") + (("pass",) if pass_floor is not None else ())
    sources = rounding_spread.single_rows(net_input, src_pad, ROWS - measured.rows)
    was_training = model.training
    model.eval()
    try:
        spreads = rounding_spread.measure(model, step, encode, sources, bos, eos, pad, tokens,
                                          ways=ways, src_pad=src_pad)
    finally:
        model.train(was_training)
    measured.rows += len(sources)
    measured.positions += sum(s.positions for s in spreads.values())
    measured.step_spread = max(measured.step_spread, spreads["step"].largest,
                               spreads["block"].largest)
    if "pass" in spreads:
        measured.pass_spread = max(measured.pass_spread or 0.0, spreads["pass"].largest)
    measured.in_force = dataclasses.replace(
        margins_in_force(step.margin, pass_floor, measured.step_spread, measured.pass_spread,
                         measured.positions),
        final=measured.rows >= ROWS)
