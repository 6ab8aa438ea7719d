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
(the benchmark builds several). It costs a few of fairseq's greedy steps per row:
:data:`ROWS` rows of up to :data:`TOKENS` tokens, less than loading the checkpoint. It is not
kept on disk: a file would have to be keyed by the weights' bytes, whose hash costs about as
much as the measurement, and by the CPU's kernels, which round differently per machine.
"""

import logging
import threading
from typing import Optional

from fairseq_pardec.decoding.step import rounding_spread
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


def margins_for(model, step, encode, net_input, bos: int, eos: int, src_pad: int, pad: int,
                max_len: int = TOKENS) -> MarginsInForce:
    """The margins in force for ``step`` on ``model`` (its declared ``margin`` must not be
    None), measured on ``net_input``'s first rows unless already measured on these weights
    (``src_pad``, ``pad``: the source's and the target's padding; ``max_len``: the batch's
    length limit, beyond which nothing is decoded)."""
    kept = model.__dict__.setdefault("_pardec_margins", {})
    key = _key(model, step)
    weights = WeightsKey(model)
    with _lock:
        entry = kept.get(key)
        if entry is not None and entry[0] == weights.key():
            return entry[1]
        in_force = _measured(model, step, encode, net_input, bos, eos, src_pad, pad,
                             max(1, min(TOKENS, max_len)))
        kept[key] = (weights.key(), in_force)
    logger.info("%s on %s %s: %s", type(step).__name__, key[1], str(key[2]).split(".")[-1],
                in_force.describe())
    if in_force.step > WIDE_MARGIN_WARNING * step.margin:
        logger.warning(
            "this model's decoder step strays %.1e from fairseq's arithmetic (the margin in force "
            "is %.1e, %.0f times the usual): the margin guard will hand many choices to fairseq's "
            "slower arithmetic; outputs stay identical to greedy",
            in_force.step_spread, in_force.step, in_force.step / step.margin)
    return in_force


def _measured(model, step, encode, net_input, bos, eos, src_pad, pad, tokens) -> MarginsInForce:
    weight = model.decoder.embed_tokens.weight
    pass_floor = teacher_forced_margin(weight.device, weight.dtype)
    ways = ("step", "block") + (("pass",) if pass_floor is not None else ())
    sources = rounding_spread.single_rows(net_input, src_pad, ROWS)
    was_training = model.training
    model.eval()
    try:
        spreads = rounding_spread.measure(model, step, encode, sources, bos, eos, pad, tokens,
                                          ways=ways, src_pad=src_pad)
    finally:
        model.train(was_training)
    step_spread = max(spreads["step"].largest, spreads["block"].largest)
    pass_spread: Optional[float] = spreads["pass"].largest if "pass" in spreads else None
    positions = sum(s.positions for s in spreads.values())
    return margins_in_force(step.margin, pass_floor, step_spread, pass_spread, positions)
