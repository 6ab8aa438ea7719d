"""The verifier's token, chosen exactly as fairseq's beam-1 search chooses it.

fairseq's ``BeamSearch.step`` does not take ``argmax(log-prob)``: it takes the top candidates of
``cumulative score + log-probs`` (``torch.topk``, k = 2 at beam 1) and continues with the first.
Equal in exact arithmetic, not in floats: adding a cumulative score of about -30 rounds two
log-probs a few 1e-6 apart to the same value (then ``topk``'s tie order decides) or to the
other order. The cumulative score itself is a float32 sum rounded after every step, in order;
``torch.cumsum`` accumulates in double on the CPU and in a parallel order on a GPU, so it is
not the same number. This module reproduces both, for every position of a verified block, and
the edits fairseq makes to every step's log-probabilities first.
"""

import math

import numpy as np
import torch
from torch import Tensor


def running_scores(start: Tensor, step_scores: Tensor) -> Tensor:
    """Cumulative scores rounded after every addition, as fairseq's step-by-step search has them.

    Args:
        start: (B,) score before the first step (0 at the beginning of a sentence).
        step_scores: (B, L) the log-probability of each step's token.
    Returns:
        (B, L + 1) float32: ``start``, ``start + s0``, ``(start + s0) + s1``, ...
    """
    values = torch.cat([start.float().unsqueeze(1), step_scores.float()], dim=1)
    if values.device.type == "cpu":
        # numpy's accumulate is a plain left-to-right loop in the array's dtype: one call
        return torch.from_numpy(np.add.accumulate(values.numpy(), axis=1))
    out = values.clone()
    for j in range(1, out.size(1)):
        out[:, j] = out[:, j - 1] + values[:, j]
    return out


def beam_one_tokens(lprobs: Tensor, scores_before: Tensor) -> Tensor:
    """fairseq's beam-1 choice at every block position (see :func:`beam_one_choice`)."""
    return beam_one_choice(lprobs, scores_before)[0]


def beam_one_choice(lprobs: Tensor, scores_before: Tensor):
    """fairseq's beam-1 choice at every block position, and the two best log-probs there.

    Args:
        lprobs: (B, L, V) adjusted log-probabilities (pad, unk penalty, min/max length applied).
        scores_before: (B, L) cumulative score of the hypothesis before each position.
    Returns:
        (B, L) the first of ``topk(lprobs + score, 2)`` per position, the token that
        ``SequenceGenerator`` continues with (or finishes with, when it is EOS), and the
        (B, L, 2) best two log-probs (the margin guard reads them; (B, L, 1) for one word).

    Adding the score is monotone, so where the best log-prob stays strictly ahead of the second
    after the addition it is fairseq's choice, whatever ``topk``'s order among equal values; only
    positions where the addition ties them (or they were equal) redo fairseq's exact operation.
    That spares a (B, L, V) addition per iteration.

    Among exactly equal maxima fairseq continues with whichever ``topk`` lists first, and that
    order is the kernel's: on the CPU a loop per row (heap or selection by V and k, the row's
    values alone decide); on CUDA a radix select that gathers equal values in index order, then
    a sorting network over the k results, per row too, except where torch sorts whole rows
    instead (ROCm, and CUDA builds that sort when there are at most 10 rows of 100k columns or
    more). So each tied row is redone alone, as a (1, V) ``topk``: the engine's choice depends on
    the row's scores only, never on how many rows tie in the same block, and it is fairseq's
    wherever fairseq's own choice does not depend on its batch size either.
    """
    k = min(2, lprobs.size(-1) - 1)
    top = lprobs.topk(k, dim=-1)
    tokens = top.indices[..., 0]
    if k < 2:
        return tokens, top.values
    ahead = (top.values[..., 0] + scores_before) > (top.values[..., 1] + scores_before)
    if not bool(ahead.all()):
        tied = (~ahead).nonzero(as_tuple=True)
        candidates = lprobs[tied] + scores_before[tied].unsqueeze(-1)
        tokens[tied] = torch.cat([candidates[i: i + 1].topk(k, dim=-1).indices[:, 0]
                                  for i in range(candidates.size(0))])
    return tokens, top.values


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
