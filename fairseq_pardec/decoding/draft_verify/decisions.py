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

Rows whose every position is plain (no forced token, a lossless rule, no tie, a certain lead)
are walked by the native library (native/decide.c), the others by :func:`walk_row`; both
write the kept tokens and scores into the batch's host tables. With speculative sampling the
draws are made on the device (speculative.py: which draft tokens are accepted, the token drawn
after them); :func:`read_sampled` reads them in one transfer too, and :func:`walk_row` keeps
them as it keeps a relaxed rule's verdicts. Either way the engine gets an :class:`Outcome` of
arrays.
"""

from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.decoding.draft_verify.margin_guard import fairseq_decision, lead_is_certain
from fairseq_pardec.decoding.fairseq_rules import beam_one
from fairseq_pardec.native.library import DECIDE_ITERATION, DECIDE_LONGEST, DECIDE_OUTCOME

_f32 = np.float32


class Outcome:
    """What an iteration kept of each active row, as arrays the native decisions write:
    ``gained`` tokens, ``accepted`` draft tokens among them, ``ended`` (the last is EOS),
    ``last_pos`` the packed block position of the last; ``left`` marks the rows the native
    walk left to Python's; ``ended_rows`` counts the rows that ended. One per row count, kept
    by the batch (:meth:`Batch.outcome`)."""

    def __init__(self, rows: int):
        self.ended_rows = 0
        self.gained = np.zeros(rows, dtype=np.int64)
        self.accepted = np.zeros(rows, dtype=np.int64)
        self.ended = np.zeros(rows, dtype=np.uint8)
        self.last_pos = np.zeros(rows, dtype=np.int64)
        self.left = np.zeros(rows, dtype=np.uint8)
        # their addresses, in native/decide.c's slots GAINED .. LEFT
        self.addresses = tuple(a.ctypes.data for a in (self.gained, self.accepted, self.ended,
                                                       self.last_pos, self.left))


class Reading:
    """The host's copy of what the decisions read per packed position: ``top`` (N, 2) float32
    [best, second] log-probabilities, ``best`` (N,) int64 the first token holding the best, and
    where needed ``forced_lp`` (the forced prefix token's), ``draft_lp`` and ``verdict`` (the
    draft token judged there); ``addresses``: those of ``top`` and ``best``.

    With speculative sampling (:func:`read_sampled`) ``best`` is the token sampling put at
    each position (the draft token where it accepted it, the token it drew at a row's first
    other position), ``best_lp`` its log-probability, ``verdict`` 1.0 where the draft token was
    accepted, and ``top`` is None."""

    def __init__(self, top, best, addresses, forced_lp=None, draft_lp=None, verdict=None,
                 best_lp=None):
        self.top, self.best, self.addresses = top, best, addresses
        self.forced_lp, self.draft_lp, self.verdict = forced_lp, draft_lp, verdict
        self.best_lp = best_lp

    @property
    def sampled(self) -> bool:
        return self.best_lp is not None


def read_positions(generator, batch, block, lprobs: Tensor, forced: Optional[Tensor],
                   native=None) -> Reading:
    """The one read of an iteration: per packed position of ``lprobs`` (N, V) what
    :func:`decide` needs, in one transfer to the host. ``native``: on the CPU, the native
    kernel (its best two), which makes fairseq's token edits first (``block_edits`` left them
    to it); None: ``lprobs`` is edited, and read with ``topk``."""
    if native is not None:
        # no forced token, no relaxed rule: the best two are all (engine.py chose this)
        generator.device_reads += 1
        top, best, *addresses = native.best_two(lprobs, generator.rules)
        return Reading(top, best, addresses)
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
    k = min(2, lprobs.size(-1))
    values, indices = lprobs.topk(k, dim=-1)
    if k < 2:  # one word: nothing runs up
        values = torch.cat([values, torch.full_like(values, -float("inf"))], 1)
    columns = torch.cat([values, indices[:, :1].to(values.dtype)]
                        + [c.to(values.dtype).unsqueeze(1) for c in extra], 1)
    host = generator.read(columns).numpy()  # vocabulary ids are exact in float32
    top = np.ascontiguousarray(host[:, :2], dtype=np.float32)
    best = host[:, 2].astype(np.int64)
    columns = [host[:, c] for c in range(3, host.shape[1])]
    forced_lp = columns.pop(0) if forced is not None else None
    draft_lp, verdict = (columns[0], columns[1]) if relaxed else (None, None)
    return Reading(top, best, (top.ctypes.data, best.ctypes.data), forced_lp, draft_lp, verdict)


def read_sampled(generator, block, lprobs: Tensor, n_acc: Tensor, grid: Tensor) -> Reading:
    """The one read of an iteration with speculative sampling (speculative.py decided on the
    device: ``n_acc`` (B,) draft tokens accepted per row, ``grid`` (B, L) holding the token
    drawn at each row's position ``n_acc``): per packed position the token sampling put there,
    its log-probability and whether it is an accepted draft token, in one transfer."""
    layout = block.layout
    accepted = block.cols < n_acc.unsqueeze(1)  # (B, L)
    tokens = layout.pack(grid)
    columns = [tokens.to(torch.float64), lprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).double(),
               layout.pack(accepted).double()]
    host = generator.read(torch.stack(columns, 1)).numpy()
    best = host[:, 0].astype(np.int64)
    return Reading(None, best, None, draft_lp=host[:, 1], verdict=host[:, 2], best_lp=host[:, 1])


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


def decide(generator, batch, block, reading: Reading, lprobs: Tensor,
           bos_token) -> Outcome:
    """Step 3 of an iteration (engine.py) for every active row, on the host: each row's new
    tokens and scores written into the batch's tables, and what it kept, returned.

    The native walk (native/decide.c) decides every row whose positions are plain; Python's
    (:func:`walk_row`) the others: a forced prefix, a relaxed acceptance rule, a tie that
    fairseq's ``topk`` order breaks, a close call, or no native library."""
    outcome = batch.outcome()
    kernel = batch.decider
    if kernel is not None and reading.forced_lp is None and reading.verdict is None:
        args = batch.decide_args
        args[DECIDE_ITERATION] = (*reading.addresses, block.rows, block.width, *block.addresses)
        args[DECIDE_OUTCOME] = outcome.addresses
        args[DECIDE_LONGEST] = batch.longest
        margin = batch.margin
        decided = kernel.decide_rows(batch.decide_args_at, -1.0 if margin is None else margin)
        batch.longest = int(args[DECIDE_LONGEST])
        # the rows left to Python's walk, and 2**32 times the rows that ended
        outcome.ended_rows = decided >> 32
        if not decided & 0xFFFFFFFF:
            return outcome
        rows = np.flatnonzero(outcome.left).tolist()
    else:
        rows = range(block.rows)
        outcome.ended_rows = 0
    top = None if reading.top is None else reading.top.tolist()
    for r in rows:
        keep_row(batch, outcome, r, *walk_row(generator, batch, block, reading, top, lprobs,
                                               bos_token, r))
    return outcome


def keep_row(batch, outcome: Outcome, r: int, tokens: List[int], scores: List[float],
             accepted: int, last_pos: int, final: np.float32):
    """Write what row ``r`` keeps into the batch's tables and ``outcome`` (and the batch's
    longest row), as the native walk writes the rows it decides."""
    start, count = int(batch.n_out_np[r]), len(tokens)
    batch.tokens_np[r, start + 1: start + 1 + count] = tokens
    batch.scores_np[r, start: start + count] = scores
    batch.prev_score[r], batch.last[r] = final, tokens[-1]
    batch.n_out_np[r] = start + count
    batch.longest = max(batch.longest, start + count)
    outcome.gained[r], outcome.accepted[r] = count, accepted
    ended = tokens[-1] == batch.generator.eos
    outcome.ended[r], outcome.last_pos[r] = ended, last_pos
    outcome.ended_rows += ended


def walk_row(generator, batch, block, reading: Reading, top: List[List[float]], lprobs: Tensor,
             bos_token, r: int):
    """Python's walk along row ``r``'s block (``top``: ``reading.top`` as lists): its new
    tokens, their running scores, the draft tokens accepted, the packed position of the last
    kept token and the last score as a float32."""
    best, margin = reading.best, batch.margin
    rule, eos = generator.acceptance, generator.eos
    draft, length, row_pos = block.drafts[r], int(block.lengths[r]), block.pos[r].tolist()
    n_out = int(batch.n_out_np[r])
    forced = _forced_tokens(batch, r, n_out, length) if reading.forced_lp is not None else None
    least = 0 if reading.sampled else rule.least_accepted(length)
    score = batch.prev_score[r]
    tokens, scores = [], []
    accepted = 0
    run = True  # whether the rule accepted every draft token so far (--min-block-size)
    for j in range(length + 1):
        at = row_pos[j]
        close = False
        if reading.sampled:  # the token speculative sampling put here
            token, lp = int(best[at]), reading.best_lp[at]
        elif forced is not None and forced[j] is not None:
            token, lp = forced[j], reading.forced_lp[at]
        else:
            first, second = top[at]
            token, lp = beam_one(lprobs, at, int(best[at]), first, second, score)
            # fairseq's score of the decided tokens differs from the step's by at most a
            # margin a token
            bound = None if margin is None else abs(float(score)) + (n_out + j + 1) * margin
            close = margin is not None and not lead_is_certain(first, second, bound, margin)
            if close:
                # fairseq's own arithmetic decides; the row's acceptance ends here
                before = torch.cat([batch.tokens[r, 1: n_out + 1],
                                    torch.tensor(draft[:j], dtype=torch.long)])
                with batch.guard_timer:
                    token = fairseq_decision(
                        generator, batch.source(r),
                        before, bos_token, score_bound=bound, resume=batch.row_replay(r),
                        margins=batch.margins)
                lp = float(lprobs[at, token])
                generator.stats.close_calls += 1
        kept = False
        if j < length and not close:
            # the rule's run of accepted tokens from the left, and at least ``least`` tokens
            # whatever it says (MinimumBlock: the longer of the two)
            if reading.sampled:  # its draws accepted this draft token, or did not
                run = run and reading.verdict[at] > 0.5
            else:
                run = run and (draft[j] == token or rule.host_ok(
                    draft[j], token, reading.verdict[at] if reading.verdict is not None else 0.0))
            kept = run or j < least
            if kept and draft[j] != token:
                token, lp = draft[j], reading.draft_lp[at]
        score = score + _f32(lp)  # float32 + float32: rounded to float32
        tokens.append(token)
        scores.append(float(score))
        accepted += kept
        if token == eos or not kept:
            break
    return tokens, scores, accepted, at, score
