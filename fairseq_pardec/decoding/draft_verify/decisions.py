"""Every token the engine keeps is decided here, on the host, from one read of the device.

Per verified position a decision needs a handful of numbers: the best token after fairseq's
edits of the log-probabilities, its log-probability and the runner-up's; where a prefix is
forced, the forced token's; where a relaxed rule judges the drafts, each draft token's and the
rule's verdict. :func:`read_positions` brings them to the host in one transfer (on the CPU, a
native pass over the log-probabilities, or a ``topk``, read where they lie). :func:`decide`
then walks each row's block once, for every generator and device:

* fairseq's beam-1 choice (fairseq_rules.beam_one): the best token, unless adding the
  hypothesis score ties the best two, where the row's own ``topk`` is redone as fairseq does;
* the cumulative scores, rounded to float32 after every addition, in order, as fairseq's are;
* the margin guard (margin_guard.py), wherever the step may round otherwise than fairseq: where
  its choice is not certain, fairseq's own decision, and the row's acceptance ends there;
* acceptance: a draft token equal to the verifier's is kept; a relaxed rule may keep another
  (acceptance.py); then the verifier's token, up to the first EOS.

Speculative sampling decides on the device (speculative.py); :func:`sampled` reads what it
decided, in one transfer too. Either way the result is a :class:`Decided` per row, which the
engine commits.
"""

from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.decoding.draft_verify.margin_guard import fairseq_decision, lead_is_certain
from fairseq_pardec.decoding.fairseq_rules import beam_one

_f32 = np.float32


class Decided:
    """What an iteration keeps of one row: its new tokens and their cumulative scores, how many
    draft tokens it accepted, whether it ended (EOS), and the block position of its last kept
    token."""

    __slots__ = ("tokens", "scores", "accepted", "ended", "last_pos", "final")

    def __init__(self, tokens: List[int], scores: List[float], accepted: int, ended: bool,
                 last_pos: int, final: np.float32):
        self.tokens, self.scores, self.accepted = tokens, scores, accepted
        self.ended, self.last_pos = ended, last_pos
        self.final = final  # the last score as the float32 the next additions start from


class Reading:
    """The host's copy of what the decisions read per packed position: ``top`` [best, second]
    log-probabilities, ``best`` the first token holding the best, and where needed ``forced_lp``
    (the forced prefix token's), ``draft_lp`` and ``verdict`` (the draft token judged there)."""

    def __init__(self, top, best, forced_lp=None, draft_lp=None, verdict=None):
        self.top, self.best = top, best
        self.forced_lp, self.draft_lp, self.verdict = forced_lp, draft_lp, verdict


def read_positions(generator, batch, block, lprobs: Tensor, forced: Optional[Tensor]) -> Reading:
    """The one read of an iteration: per packed position of ``lprobs`` (N, V) what
    :func:`decide` needs, in one transfer to the host."""
    extra = []
    if forced is not None:
        extra.append(lprobs.gather(1, forced.clamp(min=0).unsqueeze(1)).squeeze(1))
    rule = generator.acceptance
    relaxed = not rule.lossless and block.width > 0
    if relaxed:
        draft_lp = lprobs[block.draft_pos, block.draft]
        verdicts = rule.device_verdicts(block.draft, lprobs, block.draft_pos)
        if verdicts is None:
            verdicts = torch.zeros_like(draft_lp)
        # per packed position, the draft token verified there (none at a row's last position)
        grid = torch.stack([draft_lp, verdicts.to(draft_lp.dtype)], -1)
        grid = torch.cat([grid, grid.new_zeros(block.rows, 1, 2)], 1)
        extra.extend(block.layout.pack(grid).unbind(1))
    native = batch.step.scores_kernel()
    if (native is not None and not extra and lprobs.dtype == torch.float32
            and lprobs.is_contiguous()):
        # on the CPU: the native kernel reads the log-probabilities where they lie
        generator.device_reads += 1
        return Reading(*native.best_two(lprobs))
    k = min(2, lprobs.size(-1))
    values, indices = lprobs.topk(k, dim=-1)
    if k < 2:  # one word: nothing runs up
        values = torch.cat([values, torch.full_like(values, -float("inf"))], 1)
    columns = torch.cat([values, indices[:, :1].to(values.dtype)]
                        + [c.to(values.dtype).unsqueeze(1) for c in extra], 1)
    host = generator.read(columns).tolist()  # vocabulary ids are exact in float32
    top = [row[:2] for row in host]
    best = [int(row[2]) for row in host]
    columns = list(zip(*host))[3:] if host else []
    forced_lp = columns.pop(0) if forced is not None else None
    draft_lp, verdict = (columns[0], columns[1]) if relaxed else (None, None)
    return Reading(top, best, forced_lp, draft_lp, verdict)


def _forced_tokens(batch, r: int, n_out: int, length: int):
    """The row's forced prefix tokens at its block positions (None where nothing is forced)."""
    prefix = batch.prefix_host
    if prefix is None or n_out >= prefix.size(1):
        return None
    pad, max_len = batch.generator.pad, batch.max_len
    forced = []
    for j in range(length + 1):
        step = n_out + j
        token = int(prefix[r, step]) if step < prefix.size(1) else pad
        forced.append(token if token != pad and step < max_len else None)
    return forced


def decide(generator, batch, block, reading: Reading, lprobs: Tensor, sample,
           bos_token) -> List[Decided]:
    """Steps 3 of an iteration (engine.py) for every active row, on the host."""
    top, best = reading.top, reading.best
    drafts, lengths, pos = block.drafts, block.lengths, block.pos
    n_out = batch.n_out_host.tolist()
    margin = batch.margin
    rule, eos = generator.acceptance, generator.eos
    decided = []
    for r in range(block.rows):
        draft, length, row_pos = drafts[r], lengths[r], pos[r]
        forced = _forced_tokens(batch, r, n_out[r], length) if reading.forced_lp else None
        least = rule.least_accepted(length)
        score = batch.prev_score[r]
        tokens, scores = [], []
        accepted = 0
        run = True  # whether the rule accepted every draft token so far (--min-block-size)
        for j in range(length + 1):
            at = row_pos[j]
            close = False
            if forced is not None and forced[j] is not None:
                token, lp = forced[j], reading.forced_lp[at]
            else:
                first, second = top[at]
                token, lp = beam_one(lprobs, at, best[at], first, second, score)
                close = margin is not None and not lead_is_certain(first, second, score, margin)
                if close:
                    # fairseq's own arithmetic decides; the row's acceptance ends here. Its score
                    # of the decided tokens differs from the step's by at most a margin a token
                    before = torch.cat([batch.tokens[r, 1: n_out[r] + 1],
                                        torch.tensor(draft[:j], dtype=torch.long)])
                    bound = abs(float(score)) + (n_out[r] + j + 1) * margin
                    token = fairseq_decision(
                        generator, sample["net_input"]["src_tokens"][batch.rows_host[r]],
                        before, bos_token, score_bound=bound)
                    lp = float(lprobs[at, token])
                    generator.stats.close_calls += 1
            kept = False
            if j < length and not close:
                # the rule's run of accepted tokens from the left, and at least ``least`` tokens
                # whatever it says (MinimumBlock: the longer of the two)
                run = run and (draft[j] == token or rule.host_ok(
                    draft[j], token, reading.verdict[at] if reading.verdict else 0.0))
                kept = run or j < least
                if kept and draft[j] != token:
                    token, lp = draft[j], reading.draft_lp[at]
            score = score + _f32(lp)  # float32 + float32: rounded to float32
            tokens.append(token)
            scores.append(float(score))
            accepted += kept
            if token == eos or not kept:
                break
        decided.append(Decided(tokens, scores, accepted, token == eos, at, score))
    return decided


def sampled(generator, batch, block, lprobs: Tensor, n_acc: Tensor, grid: Tensor) -> List[Decided]:
    """What speculative sampling decided on the device (``n_acc`` accepted draft tokens per row,
    ``grid`` holding the drawn token at each row's position ``n_acc``), read in one transfer,
    as :func:`decide`'s rows."""
    ar, layout = block.ar, block.layout
    own = grid[ar, n_acc]
    own_lp = lprobs[layout.at(ar, n_acc), own]
    parts = [n_acc.to(lprobs.dtype).unsqueeze(1), own.to(lprobs.dtype).unsqueeze(1),
             own_lp.unsqueeze(1)]
    if block.width > 0:
        parts.append(lprobs[block.draft_pos, block.draft])
    host = generator.read(torch.cat(parts, 1).double()).tolist()
    eos, decided = generator.eos, []
    for r, row in enumerate(host):
        accepted, token, lp = int(row[0]), int(row[1]), row[2]
        draft = block.drafts[r][:accepted]
        tokens, lps = draft + [token], row[3: 3 + accepted] + [lp]
        if eos in draft:  # a drawn draft ends at its EOS
            end = draft.index(eos) + 1
            tokens, lps, accepted = tokens[:end], lps[:end], end
        score, scores = batch.prev_score[r], []
        for lp in lps:
            score = score + _f32(lp)  # float32 + float32: rounded to float32
            scores.append(float(score))
        decided.append(Decided(tokens, scores, min(accepted, int(row[0])),
                               tokens[-1] == eos, block.pos[r][len(tokens) - 1], score))
    return decided
