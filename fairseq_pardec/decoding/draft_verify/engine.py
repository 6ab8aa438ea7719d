"""The draft -> verify -> accept -> roll back engine shared by IAD, GAD and blockwise decoding.

Per active row the engine keeps the accepted tokens (after BOS), their cumulative scores and the
verifier's KV cache, which holds the keys/values of BOS and every accepted token but the last.
One iteration:

1. *draft*: the drafter proposes up to ``max_len - n_out`` tokens per row (ragged);
2. *verify*: one decoder call over [last accepted token, draft] on top of the cache gives the
   next-token distribution after every block position;
3. *accept*: the acceptance rule keeps the longest acceptable draft prefix, then the verifier's
   own token at the first rejected position is appended (so each iteration gains >= 1 token);
4. *roll back*: the cache keeps the entries of the kept block positions only; rows that emitted
   EOS leave the batch.

The per-step adjustments are fairseq ``SequenceGenerator``'s (pad never chosen, ``--unkpen``,
EOS forced at ``max_len``, EOS barred before ``--min-len``, ``--prefix-size`` forcing, max length
from ``--max-len-a/b`` and the padded source length of the batch), so with
:class:`ExactAcceptance` the output equals fairseq's beam-1 search token for token.
"""

import logging
import math
import time
from typing import Optional

import torch
from torch import Tensor

from fairseq_pardec.errors import UsageError

from fairseq_pardec.decoding.fairseq_rules import (beam_one_choice, running_scores,
                                                             token_rules)
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.draft_verify.margin_guard import close_calls, fairseq_decision
from fairseq_pardec.decoding.draft_verify.backoff import DraftBackoff
from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler
from fairseq_pardec.decoding.draft_verify.drafters import pad_drafts
from fairseq_pardec.decoding.options import (build_through_fairseq, refuse_unknown_arguments, sampling_of,
                                 set_output_symbols)
from fairseq_pardec.decoding.step.lean import block_decoder_for
from fairseq_pardec.decoding.decode_stats import DecodeStats, StatsGenerator

logger = logging.getLogger(__name__)


class DraftVerifyGenerator(StatsGenerator):
    """Batched, KV-cached draft-and-verify decoding with one verifier model."""

    def __init__(
        self,
        models,
        tgt_dict,
        drafter,
        acceptance,
        max_len_a: float = 0,
        max_len_b: int = 200,
        max_len: int = 0,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        compact_holes: float = 0.5,
        lean: bool = True,
        sampler: Optional[SpeculativeSampler] = None,
        fast: bool = True,
        margin: Optional[float] = None,
        backoff: bool = True,
    ):
        if len(models) != 1:
            raise UsageError(
                "draft-and-verify generators verify with one model; got an ensemble of %d "
                "(give one checkpoint to --path)" % len(models)
            )
        if temperature <= 0:
            raise UsageError("--temperature must be greater than 0")
        self.model = models[0]
        self.block_decoder = block_decoder_for(self.model.decoder, lean, fast)
        # The fast step rounds differently from fairseq: with exact acceptance, close calls
        # are decided with fairseq's arithmetic (draft_verify/margin_guard.py)
        from fairseq_pardec.decoding.step.fast import DEFAULT_MARGIN

        self.margin = DEFAULT_MARGIN if margin is None else margin
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.drafter = drafter
        self.acceptance = acceptance
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.max_len = max_len or self.model.max_decoder_positions()
        self.min_len = min_len
        self.normalize_scores = normalize_scores
        self.len_penalty = len_penalty
        self.unk_penalty = unk_penalty
        self.temperature = temperature
        self.compact_holes = compact_holes
        self.stats = DecodeStats()
        self.symbols_to_strip_from_output = {self.eos}
        self.src_pad = self.pad
        # rows whose drafts keep being rejected stop drafting for a while (draft_verify/backoff.py)
        self.backoff = backoff
        # --sampling: speculative sampling replaces the acceptance rule (speculative.py)
        self.sampler = sampler
        if sampler is not None:
            if not acceptance.lossless:
                raise UsageError(
                    "--sampling accepts drafts by speculative sampling, which is exact; drop the "
                    "relaxed acceptance options (--gad-beta/--gad-tau, --blockwise-topk, "
                    "--blockwise-distance, --min-block-size)"
                )
            drafter.set_sampler(sampler, temperature)

    # ------------------------------------------------------------------ per-step adjustments
    def _adjust(self, lprobs: Tensor, steps: Tensor, layout: BlockLayout, max_len: int,
                prefix: Optional[Tensor], bar_eos_possible: bool):
        """fairseq SequenceGenerator's per-step edits of log-probabilities, for a block.

        Args:
            lprobs: (N, V) at the block's real positions (packed by ``layout``), modified in place.
            steps: (B, L) decoder step of each block position.
            prefix: (B, P) forced prefix tokens (pad = not forced) or None.
            bar_eos_possible: False when every row is past --min-len (skips that edit).
        Returns the (N,) forced tokens (-1 where nothing is forced), or None if none are.
        """
        token_rules(lprobs, self.pad, self.unk, self.unk_penalty)
        at_max_grid = steps >= max_len
        at_max = None
        if bool(at_max_grid.any()):
            at_max = layout.pack(at_max_grid)
            eos_lp = lprobs[:, self.eos].clone()
            lprobs.masked_fill_(at_max.unsqueeze(-1), -math.inf)
            lprobs[:, self.eos] = torch.where(at_max, eos_lp, lprobs[:, self.eos])
        forced = None
        prefix_step = None
        if prefix is not None and prefix.size(1) > 0:
            # fairseq treats a step below the prefix width as a prefix step for every row, a
            # row whose shorter prefix is padding there included (nothing forced, no EOS bar)
            prefix_step = (steps < prefix.size(1)) & ~at_max_grid
            prefix_tok = prefix.gather(1, steps.clamp(max=prefix.size(1) - 1))
            in_prefix = prefix_step & prefix_tok.ne(self.pad)
            forced = layout.pack(torch.where(in_prefix, prefix_tok, torch.full_like(steps, -1)))
        if bar_eos_possible:
            bar_eos = steps < self.min_len
            if prefix_step is not None:
                bar_eos &= ~prefix_step
            if bool(bar_eos.any()):
                lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(layout.pack(bar_eos), -math.inf)
        return forced

    # ------------------------------------------------------------------ main loop
    def _generate(self, sample, prefix_tokens=None, bos_token=None, **unused):
        model, blocks = self.model, self.block_decoder
        model.decoder.set_beam_size(1)  # undo a beam generator built earlier on this model
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        device = src_tokens.device
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        if self.min_len > max_len:
            raise UsageError("the length limit (--max-len-a %g x source length %d + --max-len-b %d, "
                             "at most the model's %d) is below --min-len %d; raise --max-len-b"
                             % (self.max_len_a, src_len, self.max_len_b, self.max_len - 1,
                                self.min_len))

        encoder_out = model.encoder.forward_torchscript(net_input)
        bos = self.eos if bos_token is None else bos_token
        # the drafter's share of the time (benchmark): CPU only, where timing needs no sync
        clock = time.perf_counter if device.type == "cpu" else None
        t0 = clock() if clock else 0.0
        self.drafter.start(sample, encoder_out, bos)
        if clock:
            self.stats.drafter_time += clock() - t0
        relaxed = self.acceptance.reads_log_probs

        tokens = torch.full((bsz, max_len + 2), self.pad, dtype=torch.long, device=device)
        tokens[:, 0] = bos
        cum_scores = torch.zeros(bsz, max_len + 1, device=device)
        n_out = torch.zeros(bsz, dtype=torch.long, device=device)
        rows = torch.arange(bsz, device=device)  # active row -> row of the batch
        prefix = prefix_tokens
        finalized = [[] for _ in range(bsz)]
        state = blocks.new_state()
        backoff = DraftBackoff(bsz, device) if self.backoff else None
        iteration = 0  # every active row has gained >= 1 token per iteration: n_out >= iteration

        while rows.numel() > 0:
            b = rows.numel()
            ar = torch.arange(b, device=device)
            # 1. draft (never past the step where EOS is forced)
            room = max_len - n_out
            t0 = clock() if clock else 0.0
            draft_room = room if backoff is None else backoff.room(room)
            draft, draft_len = self.drafter.propose(rows, tokens, n_out, draft_room)
            drafted = draft_len
            if clock:
                self.stats.drafter_time += clock() - t0
            q = self.drafter.draft_probs if self.sampler is not None else None
            draft, draft_len, q = self._force_prefix_draft(draft, draft_len, n_out, prefix, room, q)
            k = draft.size(1)
            block = torch.cat([tokens[ar, n_out].unsqueeze(1), draft], dim=1)
            cols = torch.arange(k + 1, device=device)
            block_pad = cols.unsqueeze(0) > draft_len.unsqueeze(1)
            layout = BlockLayout(block_pad)
            draft_valid = ~block_pad[:, 1:]

            # 2. verify: the position-wise work runs on the block's real positions only
            t0 = clock() if clock else 0.0
            features = blocks.forward_packed(block, n_out, layout, encoder_out, state)
            lprobs = blocks.log_probs(features, self.temperature)  # (N, V)
            if clock:
                self.stats.verifier_time += clock() - t0
            self.stats.decoder_calls += 1
            self.stats.row_iterations += b
            self.stats.positions_verified += lprobs.size(0)
            steps = n_out.unsqueeze(1) + cols
            forced = self._adjust(lprobs, steps, layout, max_len, prefix,
                                  bar_eos_possible=iteration < self.min_len)
            iteration += 1
            # cumulative score before each block position, were the draft accepted up to it
            prev = torch.where(
                n_out > 0, cum_scores[ar, (n_out - 1).clamp(min=0)], cum_scores.new_zeros(b)
            )
            draft_pos = layout.pos[:, :k].clamp(min=0)
            draft_lp = lprobs[draft_pos, draft].masked_fill(~draft_valid, 0.0)
            before = running_scores(prev, draft_lp).to(device)
            padded_draft = torch.cat([draft, draft.new_full((b, 1), self.pad)], dim=1)
            if self.sampler is None:
                packed_before = layout.pack(before)
                verifier, top = beam_one_choice(lprobs, packed_before)
                close = None
                if self._guarded():
                    close = close_calls(top, packed_before, self.margin)
                if forced is not None:
                    verifier = torch.where(forced >= 0, forced, verifier)
                    if close is not None:
                        close &= forced < 0
                verifier = verifier[layout.pos.clamp(min=0)]  # (B, L); garbage at padding
                # 3. accept
                n_acc = self.acceptance.accept(
                    draft, draft_valid, lprobs if relaxed else None, verifier[:, :k],
                    positions=draft_pos,
                )
                if close is not None and bool(close.any()):
                    self._decide_close_calls(close[layout.pos.clamp(min=0)] & ~block_pad, n_acc,
                                             verifier, padded_draft, tokens, n_out, rows, sample,
                                             bos_token)
            else:
                n_acc, verifier = self._speculate(
                    lprobs, forced, layout, draft, draft_len, draft_valid, draft_pos, padded_draft, q
                )
            if backoff is not None:
                backoff.update(drafted, n_acc)
            take_draft = cols.unsqueeze(0) < n_acc.unsqueeze(1)
            new_tokens = torch.where(take_draft, padded_draft, verifier)
            gained = n_acc + 1
            is_eos = new_tokens.eq(self.eos) & (cols.unsqueeze(0) < gained.unsqueeze(1))
            first_eos = torch.where(is_eos, cols.unsqueeze(0), k + 1).min(dim=1).values
            gained = torch.minimum(gained, first_eos + 1)
            keep = cols.unsqueeze(0) < gained.unsqueeze(1)

            # after the accepted draft tokens, the verifier's own token at position n_acc
            cum = torch.cat([before[:, 1:], before.new_zeros(b, 1)], dim=1)
            own = new_tokens[ar, n_acc]
            own_lp = lprobs[layout.at(ar, n_acc), own]
            cum[ar, n_acc] = before[ar, n_acc] + own_lp
            r_idx = ar.unsqueeze(1).expand(b, k + 1)[keep]
            c_idx = (n_out.unsqueeze(1) + cols)[keep]
            tokens[r_idx, c_idx + 1] = new_tokens[keep]
            cum_scores[r_idx, c_idx] = cum[keep]
            n_out = n_out + gained

            # the drafter may read the verifier's state after the last kept position
            # (blockwise decoding's proposal heads: merged invocation)
            t0 = clock() if clock else 0.0
            self.drafter.observe(rows, features[layout.at(ar, gained - 1)], gained - 1,
                                 new_tokens[ar, gained - 1])
            if clock:
                self.stats.drafter_time += clock() - t0

            # 4. roll back the cache to the kept block positions, retire finished rows
            blocks.rollback(state, k + 1, gained)
            done = first_eos < k + 1
            if bool(done.any()):
                for r in done.nonzero().view(-1).tolist():
                    finalized[rows[r]] = [self._hypothesis(tokens[r], cum_scores[r], int(n_out[r]))]
                alive = (~done).nonzero().view(-1)
                rows, tokens, cum_scores, n_out = rows[alive], tokens[alive], cum_scores[alive], n_out[alive]
                if prefix is not None:
                    prefix = prefix[alive]
                if backoff is not None:
                    backoff.keep(alive)
                if alive.numel() > 0:
                    blocks.reorder(state, alive)
                    encoder_out = model.encoder.reorder_encoder_out(encoder_out, alive)
            blocks.compact(state, self.compact_holes)
        return finalized

    def _guarded(self) -> bool:
        """Whether this generator's choices must equal fairseq's, from a step that rounds
        differently (the fast step, with exact acceptance)."""
        return getattr(self.block_decoder, "fast", False) and self.acceptance.lossless

    def _decide_close_calls(self, close, n_acc, verifier, padded_draft, tokens, n_out, rows,
                            sample, bos_token):
        """Rows whose decisions up to their first close call are kept: that position's token is
        fairseq's own decision, and the row's acceptance ends there (in place: n_acc, verifier).

        close: (B, L) True at block positions whose choice the fast step cannot certify.
        """
        b, width = close.shape
        cols = torch.arange(width, device=close.device)
        # the positions whose decisions this iteration uses: accepted drafts and the next token,
        # up to the first EOS among them
        grid = torch.where(cols.unsqueeze(0) < n_acc.unsqueeze(1), padded_draft, verifier)
        is_eos = grid.eq(self.eos)
        first_eos = torch.where(is_eos, cols.unsqueeze(0), width).min(dim=1).values
        used = cols.unsqueeze(0) <= torch.minimum(n_acc, first_eos).unsqueeze(1)
        close = close & used
        src_tokens = sample["net_input"]["src_tokens"]
        for r in close.any(dim=1).nonzero().view(-1).tolist():
            at = int(close[r].nonzero()[0])
            decided = torch.cat([tokens[r, 1: int(n_out[r]) + 1], padded_draft[r, :at]])
            verifier[r, at] = fairseq_decision(self, src_tokens[rows[r]], decided, bos_token)
            n_acc[r] = at
            self.stats.close_calls += 1

    def _speculate(self, lprobs, forced, layout, draft, draft_len, draft_valid, draft_pos,
                   padded_draft, q):
        """Speculative sampling's accept / residual / bonus for every row of the block.

        Returns the accepted draft lengths (B,) and a (B, L) token grid holding, at each row's
        first non-accepted position, the token drawn there (the rest is never read).
        """
        probs = self.sampler.filter.probs(lprobs)  # (N, V): fairseq's sampling distribution
        if forced is not None:  # --prefix-size: the forced token has probability 1
            at = (forced >= 0).nonzero().view(-1)
            if at.numel():
                probs[at] = 0.0
                probs[at, forced[at]] = 1.0
        b = draft.size(0)
        ar = torch.arange(b, device=draft.device)
        n_acc = self.sampler.accept(draft, draft_valid, probs[draft_pos, draft], q)
        rejected = n_acc < draft_len
        q_next = None
        if q is not None and q.size(1) > 0:
            q_next = q[ar, n_acc.clamp(max=q.size(1) - 1)]
        own = self.sampler.next_tokens(
            probs[layout.at(ar, n_acc)], rejected, padded_draft[ar, n_acc], q_next
        )
        grid = padded_draft.clone()
        grid[ar, n_acc] = own
        return n_acc, grid

    def _force_prefix_draft(self, draft, draft_len, n_out, prefix, room, q=None):
        """Rows still inside their --prefix-size prefix draft the prefix itself (a
        deterministic draft: with --sampling their q becomes one-hot)."""
        if prefix is None or prefix.size(1) == 0:
            return draft, draft_len, q
        remaining = (prefix.size(1) - n_out).clamp(min=0)
        if not bool((remaining > 0).any()):
            return draft, draft_len, q
        rows_in = (remaining > 0).nonzero().view(-1).tolist()
        drafts = []
        for r in range(draft.size(0)):
            if r in rows_in:
                start = int(n_out[r])
                forced = [t for t in prefix[r, start:].tolist() if t != self.pad]
                drafts.append(forced[: int(room[r])])
            else:
                drafts.append(draft[r, : int(draft_len[r])].tolist())
        new_draft, new_len = pad_drafts(drafts, self.pad, draft.device)
        if q is not None:
            width = new_draft.size(1)
            one_hot = torch.zeros(new_draft.size(0), width, q.size(-1), device=q.device, dtype=q.dtype)
            one_hot.scatter_(2, new_draft.unsqueeze(-1), 1.0)
            keep = min(width, q.size(1))
            for r in range(new_draft.size(0)):
                if r not in rows_in:
                    one_hot[r, :keep] = q[r, :keep]
            q = one_hot
        return new_draft, new_len, q

    def _hypothesis(self, tokens: Tensor, cum_scores: Tensor, length: int):
        """fairseq's finalized hypothesis dict (scores as SequenceGenerator computes them)."""
        cum = cum_scores[:length].clone()
        positional = cum.clone()
        positional[1:] = cum[1:] - cum[:-1]
        score = cum[-1].clone()
        if self.normalize_scores:
            score /= length ** self.len_penalty
        return {
            "tokens": tokens[1 : length + 1].clone(),
            "score": score,
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": positional,
        }


def build_draft_verify(task, models, args, drafter, acceptance, name, seed=None,
                       extra_gen_cls_kwargs=None):
    """Build through fairseq's own mapping of the generation config (options.py).

    The task has refused what this generator cannot honour. With ``--sampling`` the random
    draws are seeded from ``seed``, by default torch's initial seed, which ``fairseq-generate``
    sets from ``--seed``.
    """
    generator = build_through_fairseq(task, models, args, _from_fairseq, extra_gen_cls_kwargs,
                                      drafter=drafter, acceptance=acceptance, seed=seed)
    generator.name = name  # refusals at generate time name the generator
    return generator


def _from_fairseq(models, tgt_dict, *, search_strategy, drafter, acceptance, seed=None,
                  beam_size=1, match_source_len=False, no_repeat_ngram_size=0, eos=None,
                  symbols_to_strip_from_output=None, tokens_to_suppress=(), **mapped):
    """fairseq's generator arguments -> DraftVerifyGenerator (beam 1; the rest was refused)."""
    refuse_unknown_arguments(DraftVerifyGenerator, mapped, tokens_to_suppress)
    sampler = None
    sampling = sampling_of(search_strategy)
    if sampling is not None:
        sampler = SpeculativeSampler(SamplingFilter(*sampling),
                                     seed if seed is not None else torch.initial_seed())
    return set_output_symbols(
        DraftVerifyGenerator(models, tgt_dict, drafter, acceptance, sampler=sampler, **mapped),
        eos, symbols_to_strip_from_output)
