"""Accept and commit one iteration on the host: exact verification on the CPU.

The engine's tensor path (engine.py, ``_accept`` and ``_commit``) decides every row of the batch
at once, in about 140 small tensor operations per iteration. On the CPU each of them costs a few
microseconds whatever its size, while what they decide rests on a handful of numbers per verified
position: the best token and the two best log-probabilities. This module reads those numbers once
per iteration (one ``topk``, a few ``tolist``), walks each row's block in Python, and writes the
accepted tokens and their scores back in one indexed write each. It decides what the tensor path
decides, number for number:

* fairseq's beam-1 choice (fairseq_rules.beam_one_choice): the best token, unless adding the
  hypothesis score ties the best two, where the row's own ``topk`` is redone as fairseq does it;
* the cumulative scores, rounded to float32 after every addition (fairseq_rules.running_scores);
* the margin guard (margin_guard.close_calls), with the step's declared margin wherever it may
  round otherwise than fairseq: where its choice is not certain, fairseq's own decision, and
  the row's acceptance ends there;
* exact acceptance: the longest draft prefix equal to the verifier's tokens, then the verifier's
  token, up to the first EOS.

It serves lossless acceptance without a forced prefix or sampling, on the CPU; everything else
takes the tensor path.
"""

from typing import List, Tuple

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.decoding.draft_verify.drafters.base import Drafter
from fairseq_pardec.decoding.draft_verify.margin_guard import _ADD_ROUNDING, fairseq_decision
from fairseq_pardec.decoding.step.interface import DecoderStep

_f32 = np.float32


def decides_on_host(generator, src_tokens: Tensor, prefix_tokens) -> bool:
    """Whether this batch's iterations may be decided here (else the tensor path runs)."""
    acceptance = generator.acceptance
    return (generator.host_decisions and src_tokens.device.type == "cpu"
            and generator.sampler is None
            and acceptance.lossless and not acceptance.reads_log_probs
            and (prefix_tokens is None or prefix_tokens.size(1) == 0)
            and generator.vocab_size > 2)


def _best_two(step: DecoderStep, lprobs: Tensor) -> Tuple[List[List[float]], List[int]]:
    """Per packed position the two best log-probabilities and the first token holding the best:
    one pass of the native kernel where the step has it (native_scores.c), else ``topk``. Only
    a strict lead is read from the token (equal values are redone as fairseq does, below)."""
    native = step.scores_kernel()
    if native is not None and lprobs.dtype == torch.float32 and lprobs.is_contiguous():
        return native.best_two(lprobs)
    top = lprobs.topk(2, dim=-1)
    return top.values.tolist(), top.indices[:, 0].tolist()


def _beam_one(lprobs: Tensor, at: int, best: int, first: float, second: float, score):
    """fairseq's choice at packed position ``at`` after a hypothesis of score ``score`` (float32),
    and its log-probability: the best token unless the addition ties the best two."""
    if _f32(first) + score > _f32(second) + score:
        return best, first
    # the row alone, as beam_one_choice redoes a tied row
    token = int((lprobs[at: at + 1] + float(score)).topk(2, dim=-1).indices[0, 0])
    return token, float(lprobs[at, token])


def accept_and_commit(generator, batch, block, features: Tensor, lprobs: Tensor, sample,
                      bos_token) -> List[bool]:
    """Steps 3 and 4 of an iteration (engine.py) for every active row. Returns, per active row,
    whether it emitted EOS."""
    values, best = _best_two(batch.step, lprobs)
    if block.host_lists is not None:
        drafts, lengths, pos = block.host_lists
    else:
        drafts, lengths = block.draft.tolist(), block.draft_len.tolist()
        pos = block.layout.pos.tolist()
    n_out = batch.n_out_host.tolist()
    margin = generator._iteration_margin(batch)
    guarded = margin is not None
    twice_margin = 2 * margin if guarded else 0.0
    eos = generator.eos
    rows, cols, tokens, scores = [], [], [], []
    n_acc, gained, done, last_pos, last_token = [], [], [], [], []
    for r in range(block.rows):
        draft, length, row_pos = drafts[r], lengths[r], pos[r]
        score = _f32(batch.prev_score[r])
        accepted = 0
        for j in range(length + 1):
            at = row_pos[j]
            first, second = values[at]
            token, lp = _beam_one(lprobs, at, best[at], first, second, score)
            close = guarded and not (first - second > twice_margin
                                     + _ADD_ROUNDING * (abs(float(score)) + abs(first)))
            if close:
                # fairseq's own arithmetic decides; the row's acceptance ends here
                decided = torch.cat([batch.tokens[r, 1: n_out[r] + 1],
                                     block.draft[r, :j]])
                # fairseq's score of the decided tokens differs from the fast step's by at
                # most a margin per token
                bound = abs(float(score)) + (n_out[r] + j + 1) * margin
                token = fairseq_decision(generator, sample["net_input"]["src_tokens"][
                    batch.rows_host[r]], decided, bos_token, score_bound=bound)
                lp = float(lprobs[at, token])
                generator.stats.close_calls += 1
            score = _f32(score + _f32(lp))
            rows.append(r)
            cols.append(n_out[r] + j)
            tokens.append(token)
            scores.append(float(score))
            ended = token == eos
            # a draft token is kept where the decision equals it (a close call ends the row's
            # acceptance there, as on the tensor path)
            kept = not close and j < length and draft[j] == token
            accepted += kept
            if ended or not kept:
                break
        n_acc.append(accepted)
        gained.append(j + 1)
        done.append(ended)
        last_pos.append(at)
        last_token.append(token)
        batch.prev_score[r] = float(score)

    device = batch.tokens.device
    # the batch's tensors are on the CPU here: written through numpy views of their memory, an
    # element at a time (a few per row: cheaper than an indexed write's index arrays, and a
    # torch index_put_ with its index tensors cost five times as much)
    token_view, score_view = batch.tokens.numpy(), batch.cum_scores.numpy()
    for r, c, token, score in zip(rows, cols, tokens, scores):
        token_view[r, c + 1] = token
        score_view[r, c] = score
    n_out_host = batch.n_out_host.numpy()
    n_out_host += gained
    batch.n_out = batch.n_out_host.clone()  # never the same tensor
    most, fewest = max(gained), min(gained)
    batch.longest = max(n + g for n, g in zip(n_out, gained))
    if batch.backoff is not None and block.width > 0:
        batch.backoff.update(lengths, n_acc, batch.iteration - 1)
    gained_t = None
    drafter = generator.drafter
    if block.proposed and type(drafter).observe is not Drafter.observe:
        gained_t = torch.tensor(gained, dtype=torch.long)
        last_features = last_tokens = None
        if drafter.observes_features:
            last_features = features.index_select(0, torch.tensor(last_pos, device=device))
            last_tokens = torch.tensor(last_token, device=device)
        with batch.drafter_timer:
            drafter.observe(batch.rows, last_features, gained_t - 1, last_tokens)
    if fewest == most:  # every row keeps as many entries: one tensor per count, kept
        gained_t = batch.uniform_gains(most)
    elif gained_t is None:
        gained_t = torch.tensor(gained, dtype=torch.long)
    batch.step.rollback(batch.cache, block.width + 1, gained_t, keep_range=(fewest, most))
    return done
