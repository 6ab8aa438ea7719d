"""Target orderings for step-wise multi-word generation (pure tensor code, no fairseq).

IBDecoder (Zhang, Titov, Sennrich 2020) and the double-token method generate z = h * c words per
decoding step: h *directions* (h = 1: left-to-right; h = 2: left-to-right and right-to-left,
meeting in the middle; even h > 2: h/2 segments, each generated from both ends = IMDecoder),
c consecutive words per direction per step (c > 1: semi-autoregressive, "+SA").

Layout of a sequence of n content words (the target without EOS):

* words are assigned to directions: split into h/2 segments (sizes as equal as possible, the
  earlier ones larger); the left part of a segment (ceil half) is read left to right, the right
  part (floor half) right to left. h = 1: one direction, the whole sequence left to right.
  Direction lengths then differ by at most one.
* step s (0-based) holds, for each direction d in order, its words s*c .. s*c+c-1;
* slots past a direction's end hold EOS (the double-token paper's EOD padding). The number of
  steps is ``min_d len_d // c + 1``: every step before the last is full, the last has at least
  one EOS, so "a hypothesis ends at the first step with an EOS" (IBDecoder § 4.2) is exact.

Flat index t (0-based) -> step t // z, direction (t % z) // c, offset (t // z) * c + t % c.
For h = 2, c = 1 this is Eq. 6 of the paper: y1 yn y2 yn-1 ...
"""

import math
from functools import lru_cache
from typing import List, Sequence, Tuple

import numpy as np
import torch
from fairseq_pardec.errors import UsageError

__all__ = [
    "check_directions",
    "direction_lengths",
    "num_steps",
    "interleave_indices",
    "interleave",
    "deinterleave",
    "deinterleave_batch",
    "slot_direction",
    "slot_offset",
    "signed_positions",
    "step_positions",
    "relaxed_causal_mask",
]


def check_directions(h: int, c: int):
    if c < 1:
        raise UsageError("--ib-words-per-direction must be >= 1 (got %d)" % c)
    if h < 1 or (h > 1 and h % 2):
        raise UsageError(
            "--ib-directions must be 1 or an even number (IMDecoder pairs directions per "
            "segment; got %d)" % h
        )


def _segments(n: int, n_segments: int) -> List[Tuple[int, int]]:
    """(start, length) of n_segments near-equal segments of n words (earlier ones larger)."""
    lengths = [len(part) for part in np.array_split(np.arange(n), n_segments)]
    starts = np.cumsum([0] + lengths[:-1])
    return [(int(start), length) for start, length in zip(starts, lengths)]


@lru_cache(maxsize=None)
def direction_words(n: int, h: int) -> Tuple[Tuple[int, ...], ...]:
    """Original indices of each direction's words, in generation order."""
    if h == 1:
        return (tuple(range(n)),)
    directions = []
    for start, length in _segments(n, h // 2):
        left = math.ceil(length / 2)
        directions.append(tuple(range(start, start + left)))
        directions.append(tuple(range(start + length - 1, start + left - 1, -1)))
    return tuple(directions)


def direction_lengths(n: int, h: int) -> List[int]:
    return [len(d) for d in direction_words(n, h)]


def num_steps(n: int, h: int, c: int) -> int:
    return min(direction_lengths(n, h)) // c + 1


@lru_cache(maxsize=None)
def interleave_indices(n: int, h: int, c: int) -> Tuple[int, ...]:
    """Flat layout of n words: original index per slot, -1 for EOS slots."""
    check_directions(h, c)
    words = direction_words(n, h)
    out = []
    for step in range(num_steps(n, h, c)):
        for d in range(h):
            for j in range(step * c, step * c + c):
                out.append(words[d][j] if j < len(words[d]) else -1)
    return tuple(out)


@lru_cache(maxsize=256)
def _index_table(max_n: int, h: int, c: int) -> torch.Tensor:
    """(max_n + 1, W) slot -> word index for every length up to max_n; -2 past a row's end.

    The interleaved length grows with n, so row max_n is the widest. Cached on the host (a
    cache of device tensors would hold device memory for good); a training step copies the
    small table to its device and gathers with one lookup there: no per-row host work.
    """
    tables = [interleave_indices(n, h, c) for n in range(max_n + 1)]
    index = torch.full((max_n + 1, len(tables[-1])), -2, dtype=torch.long)
    for n, table in enumerate(tables):
        index[n, : len(table)] = torch.tensor(table, dtype=torch.long)
    return index


def interleave(tokens: torch.Tensor, lengths: torch.Tensor, h: int, c: int, eos: int, pad: int):
    """Reorder a batch of right-padded targets (content only, no EOS) for h directions, c words.

    Returns (B, W) flat targets: content, EOS fill of the last step, then ``pad``.
    One gather over a per-length index table: no per-token or per-row Python work.
    """
    max_n = int(lengths.max()) if lengths.numel() else 0
    table = _index_table(max_n, h, c).to(tokens.device)
    index = table[lengths.to(table.device, torch.long)]
    gathered = tokens.gather(1, index.clamp(min=0)) if tokens.size(1) else index.clamp(min=0)
    out = torch.where(index >= 0, gathered, torch.full_like(gathered, eos))
    return out.masked_fill(index == -2, pad)


def deinterleave(flat: Sequence[int], h: int, c: int, eos: int) -> List[int]:
    """Words of a decoded flat sequence, back in reading order.

    Each direction's words are read up to its first EOS; the sequence may stop anywhere in its
    last step (the search ends at the first step holding an EOS).
    """
    z = h * c
    per_direction = [[] for _ in range(h)]
    done = [False] * h
    for t, token in enumerate(flat):
        d = (t % z) // c
        if done[d]:
            continue
        if token == eos:
            done[d] = True
        else:
            per_direction[d].append(token)
    if h == 1:
        return per_direction[0]
    out = []
    for seg in range(h // 2):
        out.extend(per_direction[2 * seg])
        out.extend(reversed(per_direction[2 * seg + 1]))
    return out


def deinterleave_batch(flat: torch.Tensor, h: int, c: int, eos: int, pad: int) -> List[List[int]]:
    return [deinterleave([t for t in row if t != pad], h, c, eos) for row in flat.tolist()]


def slot_direction(t: torch.Tensor, h: int, c: int) -> torch.Tensor:
    """Direction index of flat slots (Eq. 10's second component)."""
    return (t % (h * c)) // c


def slot_offset(t: torch.Tensor, h: int, c: int) -> torch.Tensor:
    """0-based index of a slot's word within its direction."""
    z = h * c
    return (t // z) * c + t % c


def signed_positions(t: torch.Tensor, h: int, c: int) -> torch.Tensor:
    """Eq. 7 generalised: +k for the k-th word of a left-to-right direction, -k for the k-th of
    a right-to-left one (1-based k); h = 1 gives 1, 2, 3, ..."""
    k = slot_offset(t, h, c) + 1
    if h == 1:
        return k
    right_to_left = slot_direction(t, h, c) % 2 == 1
    return torch.where(right_to_left, -k, k)


def step_positions(t: torch.Tensor, h: int, c: int) -> torch.Tensor:
    """Eq. 10's first component: the decoding step of a slot, 1-based."""
    return t // (h * c) + 1


def relaxed_causal_mask(length: int, h: int, c: int, device=None, dtype=torch.float) -> torch.Tensor:
    """M(h, c) of Eq. 4 as an additive float mask: slot i sees slot j iff step(j) <= step(i)."""
    steps = torch.arange(length, device=device) // (h * c)
    visible = steps.unsqueeze(0) <= steps.unsqueeze(1)
    mask = torch.zeros(length, length, device=device, dtype=dtype)
    return mask.masked_fill(~visible, float("-inf"))
