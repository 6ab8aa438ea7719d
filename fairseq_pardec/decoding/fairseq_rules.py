"""The verifier's token, chosen exactly as fairseq's beam-1 search chooses it.

fairseq's ``BeamSearch.step`` does not take ``argmax(log-prob)``: it takes the top candidates of
``cumulative score + log-probs`` (``torch.topk``, k = 2 at beam 1) and continues with the first.
Equal in exact arithmetic, not in floats: adding a cumulative score of about -30 rounds two
log-probs a few 1e-6 apart to the same value (then ``topk``'s tie order decides) or to the
other order. The cumulative score itself is a float32 sum rounded after every step, in order:
the engine's decisions keep it as a numpy float32 on the host (draft_verify/decisions.py). This
module holds the choice (:func:`beam_one`) and the edits fairseq makes to every step's
log-probabilities first (:func:`token_rules`, :func:`block_edits`).
"""
import math
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor


def beam_one(lprobs: Tensor, at: int, best: int, first: float, second: float,
             score: np.float32) -> Tuple[int, float]:
    """fairseq's beam-1 choice at row ``at`` of the (N, V) adjusted log-probabilities after a
    hypothesis of float32 score ``score``, and the chosen token's log-probability, from what
    the host read of the row: its first best token ``best`` and its two best values.

    Adding the score is monotone, so where the best log-prob stays strictly ahead of the second
    after the addition it is fairseq's choice, whatever ``topk``'s order among equal values.
    Where the addition ties them (or they were equal), fairseq continues with whichever
    ``topk(score + lprobs, 2)`` lists first, and that order is the kernel's: on the CPU a loop
    per row (the row's values alone decide); on CUDA a radix select per row, except where
    torch sorts whole rows instead (ROCm, and CUDA with at most 10 rows of 100k columns or
    more). fairseq-generate --batch-size 1 runs a (1, V) ``topk``: so does the redo here, on
    the row alone, on the model's device (a read of the device, in the rare tied row).
    """
    if np.float32(first) + score > np.float32(second) + score:
        return best, first
    token = int((lprobs[at: at + 1] + float(score)).topk(2, dim=-1).indices[0, 0])
    return token, float(lprobs[at, token])


def token_rules(lprobs: Tensor, pad: int, unk: int, unk_penalty: float) -> Tensor:
    """fairseq's first edits of a step's log-probabilities (``SequenceGenerator._generate``): NaN
    becomes -inf, padding is never chosen, the unknown word pays ``--unkpen``. In place on
    (..., V); returns ``lprobs``."""
    torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    # select + fill: the same edits as fairseq's indexed ones, without parsing an index
    lprobs.select(-1, pad).fill_(-math.inf)
    if unk_penalty:
        lprobs.select(-1, unk).sub_(unk_penalty)
    return lprobs


class SearchRules(NamedTuple):
    """The symbols and options fairseq's per-step edits read."""

    pad: int
    unk: int
    eos: int
    unk_penalty: float
    min_len: int


def block_edits(lprobs: Tensor, steps: Callable[[], Tensor], layout, rules: SearchRules,
                max_len: int, prefix: Optional[Tensor], bar_eos_possible: bool,
                at_max_possible: bool = True, token_edits: bool = True) -> Optional[Tensor]:
    """fairseq SequenceGenerator's per-step edits of log-probabilities, for a verified block.

    Args:
        lprobs: (N, V) at the block's real positions (packed by ``layout``), modified in place.
        steps: () -> (B, L) decoder step of each block position (called only where an edit
            needs it: most iterations need none).
        prefix: (B, P) forced prefix tokens (pad = not forced) or None.
        bar_eos_possible: False when every row is past --min-len (skips that edit).
        at_max_possible: False when no block position reaches ``max_len`` (known on the host:
            skips that edit).
        token_edits: False where the caller makes :func:`token_rules`' edits itself, later
            (the native read of the best two makes them in its pass over the rows: they
            commute with the edits here).
    Returns the (N,) forced tokens (-1 where nothing is forced), or None if none are.
    """
    pad, eos = rules.pad, rules.eos
    if token_edits:
        token_rules(lprobs, pad, rules.unk, rules.unk_penalty)
    if not (at_max_possible or bar_eos_possible or (prefix is not None and prefix.size(1))):
        return None
    steps = steps()
    at_max_grid = steps >= max_len
    # the edits run where the host cannot rule them out, without reading the device (on rows
    # they do not concern they change nothing)
    if at_max_possible:
        at_max = layout.pack(at_max_grid)
        eos_lp = lprobs[:, eos].clone()
        lprobs.masked_fill_(at_max.unsqueeze(-1), -math.inf)
        lprobs[:, eos] = torch.where(at_max, eos_lp, lprobs[:, eos])
    forced = None
    prefix_step = None
    if prefix is not None and prefix.size(1) > 0:
        # fairseq treats a step below the prefix width as a prefix step for every row, a row
        # whose shorter prefix is padding there included (nothing forced, no EOS bar)
        prefix_step = (steps < prefix.size(1)) & ~at_max_grid
        prefix_tok = prefix.gather(1, steps.clamp(max=prefix.size(1) - 1))
        in_prefix = prefix_step & prefix_tok.ne(pad)
        forced = layout.pack(torch.where(in_prefix, prefix_tok, torch.full_like(steps, -1)))
    if bar_eos_possible:
        bar_eos = steps < rules.min_len
        if prefix_step is not None:
            bar_eos &= ~prefix_step
        lprobs[:, eos] = lprobs[:, eos].masked_fill(layout.pack(bar_eos), -math.inf)
    return forced
