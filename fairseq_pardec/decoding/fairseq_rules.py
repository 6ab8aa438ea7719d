"""The verifier's token, chosen exactly as fairseq's beam-1 search chooses it.

fairseq's ``BeamSearch.step`` does not take ``argmax(log-prob)``: it takes the top candidates of
``cumulative score + log-probs`` (``torch.topk``, k = 2 at beam 1) and continues with the first.
Equal in exact arithmetic, not in floats: adding a cumulative score of about -30 rounds two
log-probs a few 1e-6 apart to the same value (then ``topk``'s tie order decides) or to the
other order. The cumulative score itself is a float32 sum rounded after every step, in order;
``torch.cumsum`` accumulates in double on the CPU and, on a GPU, in a parallel order along the
innermost dimension, so it is not the same number there; along an outer dimension CUDA adds in
order, which :func:`running_scores` uses (checked once per device). This module reproduces both,
for every position of a verified block, and the edits fairseq makes to every step's
log-probabilities first.
"""

import math
import threading
from typing import Dict

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
    if values.device.type == "cuda" and sequential_cumsum(values.device):
        return _cumsum_by_columns(values)
    return _add_in_order(values)


def _add_in_order(values: Tensor) -> Tensor:
    """``values.cumsum(1)`` one float32 addition per position, on any device (one kernel
    each): where no single kernel is known to add in order."""
    out = values.clone()
    for j in range(1, out.size(1)):
        torch.add(out[:, j - 1], values[:, j], out=out[:, j])
    return out


def _cumsum_by_columns(values: Tensor) -> Tensor:
    """``values.cumsum(1)`` as left-to-right float32 additions, on CUDA, in one kernel.

    torch's CUDA scan over a dimension that is not the innermost one, of a tensor with more
    than one column, runs one thread per column that adds the column's values in order into an
    accumulator of the tensor's dtype (``tensor_kernel_scan_outer_dim``, ATen's ScanUtils.cuh):
    fairseq's additions, in fairseq's order. The innermost dimension, or a single column, takes
    a parallel scan instead (other sums), hence the transpose, and a zero column beside a single
    row. Deterministic mode swaps the kernel for a masked sum, which :func:`sequential_cumsum`
    refuses; it also checks the kernel once per device.
    """
    rows = values.size(0)
    columns = values.t()
    if rows == 1:
        columns = torch.cat([columns, torch.zeros_like(columns)], dim=1)
    return columns.contiguous().cumsum(0)[:, :rows].t().contiguous()


_sequential_checked: Dict[tuple, bool] = {}
_check_lock = threading.Lock()


def sequential_cumsum(device: torch.device) -> bool:
    """Whether :func:`_cumsum_by_columns` adds left to right on ``device``: checked once per
    device on values where any other order (pairs first, a wider accumulator, a masked sum)
    gives other sums (one read of the device, the first time); never in deterministic mode."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    known = _sequential_checked.get(key)
    if known is None:
        with _check_lock:
            known = _sequential_checked.get(key)
            if known is None:
                probe = _order_probe()
                got = _cumsum_by_columns(probe.to(device)).cpu()
                known = _sequential_checked[key] = bool(torch.equal(
                    got, torch.from_numpy(np.add.accumulate(probe.numpy(), axis=1))))
    return known


def _order_probe() -> Tensor:
    """(rows, 64) float32 rows whose left-to-right sums differ from any other order's: 2**24
    followed by ones (each addition rounds back to 2**24, two ones added first do not), and
    random values of mixed magnitude; one row alone too (the single-column case)."""
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(1, 64)
    ones[0, 0] = 2.0 ** 24
    mixed = torch.randn(6, 64, generator=g) * 10.0 ** torch.randint(-6, 7, (6, 64), generator=g)
    return torch.cat([ones, mixed]).float()


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
    more). Each tied row must get what a (1, V) ``topk`` of it alone gives: the engine's choice
    depends on the row's scores only, never on how many rows tie in the same block, and it is
    fairseq's wherever fairseq's own choice does not depend on its batch size either. So the
    tied rows are redone in one ``topk`` where the kernel treats rows alone whatever their
    number, and in groups small enough to take the one-row path where it does not
    (:func:`tied_rows_per_topk`).
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
        group = tied_rows_per_topk(candidates.device, candidates.size(-1),
                                   rocm=torch.version.hip is not None)
        if group is None or candidates.size(0) <= group:
            tokens[tied] = candidates.topk(k, dim=-1).indices[:, 0]
        else:
            tokens[tied] = torch.cat([part.topk(k, dim=-1).indices[:, 0]
                                      for part in candidates.split(group)])
    return tokens, top.values


def tied_rows_per_topk(device: torch.device, vocab: int, rocm: bool = False):
    """How many rows one ``topk`` over (rows, ``vocab``) may hold for each row's result to be
    the one-row call's (None: any number). torch's CUDA ``topk`` sorts whole rows, instead of
    selecting per row, when there are at most 10 rows of at least 100k columns (a one-row call
    of that width sorts); ROCm sorts a single row of 10k columns or more. The CPU selects per
    row whatever the count."""
    if device.type != "cuda":
        return None
    if rocm:
        return 1 if vocab >= 10000 else None
    return 10 if vocab >= 100000 else None


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
