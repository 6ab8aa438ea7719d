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
from ``--max-len-a/b`` and the padded source length of the batch).

The contract, with a lossless acceptance rule (:class:`ExactAcceptance` and its equivalents) and
no ``--sampling``, in float32, on the CPU or on CUDA:

* with ``--batch-size 1`` the output is ``fairseq-generate --beam 1``'s (fairseq's
  ``SequenceGenerator`` with beam 1), token for token;
* at larger batches it is identical wherever fairseq's own output is batch-invariant: fairseq's
  greedy search itself may choose otherwise at batch 32 than at batch 1 (its products run at
  other shapes), and the engine's rows finish at other iterations than fairseq's do, so such a
  near-tie can go either way in either program.

It holds by construction: the verifier chooses as fairseq's beam-1 search does (its top-2 and
tie rule on the float32 running score, decoding/fairseq_rules.py), and wherever the decoder step
may round otherwise than fairseq (its declared ``margin``, step/margins.py: a block of several
positions, another kernel, fused products) a choice whose lead is within the margin is a *close
call*, decided by replaying fairseq's own arithmetic for that sentence at batch 1 on the model's
device (draft_verify/margin_guard.py). float32 CUDA products set to TF32 are refused. In
float16/bfloat16 no bound is claimed and no guard runs: outputs are not guaranteed identical.

Each iteration reads the device once: per row what it gained, whether it ended, what it drafted
and kept, and where its first close call lies (``_read``; a second read only in the rare
iteration with a close call, whose replay reads the device anyway). Acceptance, commit, rollback
and the retired rows' hypotheses are device operations. On the CPU, where reads cost nothing and
each small tensor operation costs microseconds, exact decisions are made in Python instead
(host_decisions.py), number for number the same.
"""

import logging
import math
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_pardec.errors import UsageError

from fairseq_pardec.decoding.fairseq_rules import (beam_one_choice, running_scores,
                                                             token_rules)
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.margins import refuse_reduced_precision_matmuls
from fairseq_pardec.decoding.draft_verify.margin_guard import close_calls, fairseq_decision
from fairseq_pardec.decoding.draft_verify.host_decisions import accept_and_commit, decides_on_host
from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler
from fairseq_pardec.decoding.draft_verify.drafters import pad_drafts
from fairseq_pardec.decoding.options import (build_through_fairseq, refuse_unknown_arguments, sampling_of,
                                 set_output_symbols)
from fairseq_pardec.decoding.step.factory import StepChoice
from fairseq_pardec.decoding.step.interface import DecoderStep
from fairseq_pardec.decoding.decode_stats import DecodeStats, StatsGenerator
from fairseq_pardec.decoding.draft_verify.batch_state import Batch, Block, Outcome

logger = logging.getLogger(__name__)


class DraftVerifyGenerator(StatsGenerator):
    """Batched, KV-cached draft-and-verify decoding with one verifier model.

    ``margin``: the margin guard's bound, by default the decoder step's own (its ``margin``);
    a given one applies to every iteration, plain steps included (tests give a wide one to hand
    every decision to fairseq, or 0 to see a step's own choices).

    The decoder step (step/interface.py) and the encoder are chosen per batch for the model's
    device and dtype as they are then (step/factory.py): ``lean`` and ``fast`` say which steps
    may be chosen. Assigning ``block_decoder`` or ``encode`` fixes that one for every batch.
    """

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
        # as fairseq's SequenceGenerator: the model decodes in eval mode (no dropout)
        self.model.eval()
        # the decoder step (and the encoder that goes with it) for the model's device and
        # dtype, chosen per batch (step/factory.py): fairseq builds the --eval-bleu generator
        # before it moves the model to the GPU, and a user may call .cuda() or .half() later
        self._steps = StepChoice(self.model, lean, fast)
        # a step or an encoder assigned to the generator, used for every batch instead (tests
        # run the engine on a given step)
        self._given_step: Optional[DecoderStep] = None
        self._given_encode = None
        # The margin guard's bound: the step's own (its ``margin``, step/margins.py) unless
        # given here; a given margin applies to every iteration, plain steps included (tests
        # hand every decision to fairseq with a wide one)
        self.margin = margin
        # reads of the device by the tensor path (``_read``): one per iteration, two where a
        # close call was replayed
        self.device_reads = 0
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
        self.backoff = backoff and not drafter.drafts_nothing
        # exact decisions on the CPU are made in Python (host_decisions.py); False forces the
        # tensor path (tests compare the two)
        self.host_decisions = True
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

    # ------------------------------------------------------------------ the step
    def _step_and_encoder(self):
        """The decoder step and the encoder of a batch starting now: those assigned to the
        generator, else those chosen for the model's device and dtype as they are now."""
        step, encode = self._given_step, self._given_encode
        if step is None or encode is None:
            chosen = self._steps.current()
            step = chosen.step if step is None else step
            encode = chosen.encode if encode is None else encode
        return step, encode

    @property
    def block_decoder(self) -> DecoderStep:
        """The decoder step the next batch runs (assigned: every batch runs that one)."""
        return self._step_and_encoder()[0]

    @block_decoder.setter
    def block_decoder(self, step: DecoderStep):
        self._given_step = step

    @property
    def encode(self):
        """The encoder the next batch runs, ``encode(net_input)`` -> fairseq's encoder output
        (with the fast step, the fast encoder on the same kernels: step/fast_encoder.py;
        assigned: every batch runs that one)."""
        return self._step_and_encoder()[1]

    @encode.setter
    def encode(self, encode):
        self._given_encode = encode

    # ------------------------------------------------------------------ per-step adjustments
    def _adjust(self, lprobs: Tensor, steps: Tensor, layout: BlockLayout, max_len: int,
                prefix: Optional[Tensor], bar_eos_possible: bool, at_max_possible: bool = True):
        """fairseq SequenceGenerator's per-step edits of log-probabilities, for a block.

        Args:
            lprobs: (N, V) at the block's real positions (packed by ``layout``), modified in place.
            steps: () -> (B, L) decoder step of each block position (called only where an
                edit needs it: most iterations need none).
            prefix: (B, P) forced prefix tokens (pad = not forced) or None.
            bar_eos_possible: False when every row is past --min-len (skips that edit).
            at_max_possible: False when no block position reaches ``max_len`` (known on the
                host: skips that edit and its read of the device).
        Returns the (N,) forced tokens (-1 where nothing is forced), or None if none are.
        """
        token_rules(lprobs, self.pad, self.unk, self.unk_penalty)
        if not (at_max_possible or bar_eos_possible or (prefix is not None and prefix.size(1))):
            return None
        steps = steps()
        at_max_grid = steps >= max_len
        # on the CPU a read costs nothing and spares the edits where they change nothing; on
        # a device the edits run unconditionally (they are no-ops there), without a read
        on_host = lprobs.device.type == "cpu"
        at_max = None
        if at_max_possible and (not on_host or bool(at_max_grid.any())):
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
            if not on_host or bool(bar_eos.any()):
                lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(layout.pack(bar_eos), -math.inf)
        return forced

    # ------------------------------------------------------------------ the margin guard
    def _guard_margin(self, step: DecoderStep) -> Optional[float]:
        """The margin of this generator's guard on ``step``; None where no guard runs: relaxed
        acceptance or sampling (nothing to keep identical), or a step that claims no bound
        (half precision: not guaranteed)."""
        if not self.acceptance.lossless or self.sampler is not None:
            return None
        return self.margin if self.margin is not None else step.margin

    def _guarded(self) -> bool:
        """Whether this generator's choices pass the margin guard (the benchmark reports its
        close calls)."""
        return self._guard_margin(self.block_decoder) is not None

    @staticmethod
    def _iteration_margin(batch: Batch) -> Optional[float]:
        """The margin the guard applies in the current iteration (None: none applies)."""
        return None if batch.exact_so_far else batch.guard

    def _read(self, t: Tensor) -> Tensor:
        """The tensor path's one way to the host: a small tensor read from the device."""
        self.device_reads += 1
        return t.cpu()

    # ------------------------------------------------------------------ main loop
    def _generate(self, sample, prefix_tokens=None, bos_token=None, **unused):
        batch = self._start(sample, prefix_tokens, bos_token)
        # on the CPU an iteration's decisions cost less in Python than in small tensor operations
        on_host = decides_on_host(self, sample["net_input"]["src_tokens"], prefix_tokens)
        batch.on_host = on_host
        while batch.rows.numel() > 0:
            block = self._draft(batch)
            features, lprobs, forced = self._verify(batch, block)
            if on_host:
                done = accept_and_commit(self, batch, block, features, lprobs, sample, bos_token)
            else:
                n_acc, verifier, before, outcome = self._accept(batch, block, lprobs, forced,
                                                                sample, bos_token)
                done = self._commit(batch, block, features, lprobs, n_acc, verifier, before,
                                    outcome)
            self._retire(batch, done)
        return batch.finalized

    def _start(self, sample, prefix_tokens, bos_token) -> Batch:
        """Encode the batch, start the drafter, and set up the state of every row."""
        self.model.decoder.set_beam_size(1)  # undo a beam generator built earlier on this model
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
        # chosen per batch: the model's device and dtype may have changed since the last one
        step, encode = self._step_and_encoder()
        guard = self._guard_margin(step)
        if self.acceptance.lossless and self.sampler is None:
            # read at generate time: the setting may change after the generator was built
            weight = self.model.decoder.embed_tokens.weight
            refuse_reduced_precision_matmuls(weight.device, weight.dtype)
        encoder_out = encode(net_input)
        bos = self.eos if bos_token is None else bos_token
        batch = Batch(self, step, bsz, max_len, bos, encoder_out, prefix_tokens, device, guard)
        with batch.drafter_timer:
            self.drafter.start(sample, encoder_out, bos)
        return batch

    def _draft(self, batch: Batch) -> Block:
        """1. Up to the room left before EOS is forced, the drafter's tokens for every row
        (a row inside its --prefix-size prefix drafts the prefix)."""
        drafter = self.drafter
        if batch.prefix is None or batch.prefix.size(1) == 0:
            # a drafter that knows it drafts nothing now is not asked (drafts_now); nor is one
            # whose every row waits in the back-off
            if drafter.drafts_nothing or not drafter.drafts_now(len(batch.rows_host)):
                return Block.last_tokens(batch, self.pad, proposed=False)
            if (drafter.quiet_spells and batch.backoff is not None
                    and batch.backoff.waiting(batch.iteration)):
                # a drafter with quiet spells counts such iterations itself; one without
                # (heads, gad) is asked and shown each iteration as before
                drafter.skip(len(batch.rows_host))
                return Block.last_tokens(batch, self.pad, proposed=False)
        room = batch.max_len - batch.n_out
        draft_room = room
        if batch.backoff is not None:  # the back-off lives on the host (backoff.py)
            draft_room = batch.backoff.room(batch.max_len - batch.n_out_host, batch.iteration)
            # queued like a kernel: a blocking copy from the host would wait for the device
            draft_room = draft_room.to(room.device, non_blocking=True)
        with batch.drafter_timer:
            draft, drafted = self.drafter.propose(batch.rows, batch.tokens, batch.n_out, draft_room)
        q = self.drafter.draft_probs if self.sampler is not None else None
        # the drafts as the drafter's lists, where it keeps them (host decisions read them)
        lists = drafter.host_drafts
        if lists is not None:
            drafter.host_drafts = None
        draft, draft_len, q = self._force_prefix_draft(draft, drafted, batch, q)
        if draft.size(1) == 0 and q is None:  # no row drafted: a plain step
            return Block.last_tokens(batch, self.pad)
        if batch.on_host and lists is not None:
            return Block.from_lists(batch, lists, draft, drafted, self.pad)
        return Block(batch, draft, draft_len, drafted, q, self.pad)

    def _verify(self, batch: Batch, block: Block):
        """2. One decoder call over every row's [last accepted token, draft]; the position-wise
        work runs on the block's real positions only. Returns the features, the (N, V) packed
        log-probabilities after fairseq's per-step edits, and the forced tokens (or None)."""
        with batch.verifier_timer:
            step = batch.step
            encoder_out = batch.encoder_out if step.reads_encoder_out(batch.cache) else None
            features = step.forward_packed(block.tokens, batch.n_out, block.layout, encoder_out,
                                           batch.cache)
            lprobs = step.log_probs(features, self.temperature)
        if block.width > 0:
            # cache entries computed at a block's shapes: later plain steps no longer round as
            # fairseq's own steps do (step/margins.py)
            batch.exact_so_far = False
        self.stats.decoder_calls += 1
        self.stats.row_iterations += block.rows
        self.stats.positions_verified += lprobs.size(0)
        # the longest row's last block position is the furthest step: no read of the device
        furthest = batch.longest + block.width
        forced = self._adjust(lprobs, lambda: batch.n_out.unsqueeze(1) + block.cols,
                              block.layout, batch.max_len, batch.forcing_prefix(),
                              bar_eos_possible=batch.iteration < self.min_len,
                              at_max_possible=furthest >= batch.max_len)
        batch.iteration += 1
        return features, lprobs, forced

    def _accept(self, batch: Batch, block: Block, lprobs, forced, sample, bos_token):
        """3. How many draft tokens each row keeps, and the token after them.

        Returns the accepted draft lengths (B,), a (B, L) grid whose position ``n_acc`` holds the
        row's next token (the verifier's own, or speculative sampling's draw), the cumulative
        score before each block position were the draft accepted up to it (B, L), and the
        iteration's :class:`Outcome` (the one read of the device).
        """
        b, k, ar = block.rows, block.width, block.ar
        n_out, cum_scores, layout = batch.n_out, batch.cum_scores, block.layout
        prev = torch.where(
            n_out > 0, cum_scores[ar, (n_out - 1).clamp(min=0)], cum_scores.new_zeros(b)
        )
        draft_lp = lprobs[block.draft_pos, block.draft].masked_fill(~block.draft_valid, 0.0)
        before = running_scores(prev, draft_lp).to(n_out.device)
        close = None
        if self.sampler is not None:
            n_acc, verifier = self._speculate(lprobs, forced, block)
        else:
            packed_before = layout.pack(before)
            verifier, top = beam_one_choice(lprobs, packed_before)
            margin = self._iteration_margin(batch)
            if margin is not None:
                close = close_calls(top, packed_before, margin)
            if forced is not None:
                verifier = torch.where(forced >= 0, forced, verifier)
                if close is not None:
                    close &= forced < 0
            verifier = verifier[layout.pos.clamp(min=0)]  # (B, L); garbage at padding
            if close is not None:
                close = close[layout.pos.clamp(min=0)] & ~block.pad
            n_acc = self.acceptance.accept(
                block.draft, block.draft_valid,
                lprobs if self.acceptance.reads_log_probs else None, verifier[:, :k],
                positions=block.draft_pos,
            )
        outcome = self._outcome(block, n_acc, verifier, close)
        if outcome.first_close is not None and min(outcome.first_close) <= k:
            self._decide_close_calls(outcome, n_acc, verifier, block.padded_draft, batch, sample,
                                     bos_token)
            outcome = self._outcome(block, n_acc, verifier, None)
        return n_acc, verifier, before, outcome

    def _outcome(self, block: Block, n_acc: Tensor, verifier: Tensor,
                 close: Optional[Tensor]) -> Outcome:
        """What the iteration keeps of each row, computed on the device and read in one
        transfer (:meth:`_read`): the tokens it gains (the accepted drafts and the next token,
        up to the first EOS), whether it ended, and where its first close call among them is."""
        k, cols = block.width, block.cols
        new_tokens = torch.where(cols.unsqueeze(0) < n_acc.unsqueeze(1), block.padded_draft,
                                 verifier)
        gained = n_acc + 1
        is_eos = new_tokens.eq(self.eos) & (cols.unsqueeze(0) < gained.unsqueeze(1))
        first_eos = torch.where(is_eos, cols.unsqueeze(0), k + 1).min(dim=1).values
        gained = torch.minimum(gained, first_eos + 1)
        parts = [gained, (first_eos < k + 1).long(), block.drafted, n_acc]
        if close is not None:
            # a close call matters where the iteration uses the decision: the positions kept
            used = close & (cols.unsqueeze(0) < gained.unsqueeze(1))
            parts.append(torch.where(used, cols.unsqueeze(0), k + 1).min(dim=1).values)
        host = self._read(torch.stack(parts)).tolist()
        return Outcome(new_tokens, gained, first_eos, *host)

    def _commit(self, batch: Batch, block: Block, features, lprobs, n_acc, verifier,
                before, outcome: Outcome) -> List[bool]:
        """4. Append the accepted tokens and the next one (up to the first EOS) with their
        scores, show them to the drafter, and roll the cache back to the kept positions.
        Returns, per active row, whether it emitted EOS."""
        b, k, ar = block.rows, block.width, block.ar
        new_tokens, gained = outcome.new_tokens, outcome.gained
        gained_host = outcome.gained_host

        # after the accepted draft tokens, the verifier's own token at position n_acc
        cum = torch.cat([before[:, 1:], before.new_zeros(b, 1)], dim=1)
        own = new_tokens[ar, n_acc]
        cum[ar, n_acc] = before[ar, n_acc] + lprobs[block.layout.at(ar, n_acc), own]
        # Written without a boolean mask, whose nonzero would wait for the device: over the
        # output steps some row reaches (known on the host), each row's own steps
        # [n_out, n_out + gained) take the block's values, the others keep theirs
        n_out_host = batch.n_out_host.numpy()
        first, end = int(n_out_host.min()), int((n_out_host + gained_host).max())
        at = (torch.arange(first, end, device=ar.device).unsqueeze(0)
              - batch.n_out.unsqueeze(1))  # (B, steps): the block position written there
        written = (at >= 0) & (at < gained.unsqueeze(1))
        at = at.clamp(0, k)
        tokens = batch.tokens.narrow(1, first + 1, end - first)
        torch.where(written, new_tokens.gather(1, at), tokens, out=tokens)
        scores = batch.cum_scores.narrow(1, first, end - first)
        torch.where(written, cum.gather(1, at), scores, out=scores)
        batch.n_out = batch.n_out + gained

        # the drafter may read the verifier's state after the last kept position
        # (blockwise decoding's proposal heads: merged invocation)
        if block.proposed:
            with batch.drafter_timer:
                self.drafter.observe(batch.rows, features[block.layout.at(ar, gained - 1)],
                                     gained - 1, new_tokens[ar, gained - 1])
        # the host's side, from the iteration's read
        if batch.backoff is not None and k > 0:
            batch.backoff.update(outcome.drafted_host, outcome.accepted_host,
                                 batch.iteration - 1)
        n_out_host += gained_host
        batch.longest = end
        batch.step.rollback(batch.cache, k + 1, gained,
                            keep_range=(min(gained_host), max(gained_host)))
        return [bool(ended) for ended in outcome.done_host]

    def _retire(self, batch: Batch, done: List[bool]):
        """5. Finalize the rows that emitted EOS (``done``, per active row) and drop them."""
        if any(done):
            alive = []
            for r, ended in enumerate(done):
                if not ended:
                    alive.append(r)
                    continue
                batch.finalized[batch.rows_host[r]] = [self._hypothesis(
                    batch.tokens[r], batch.cum_scores[r], int(batch.n_out_host[r]))]
            batch.keep(torch.tensor(alive, dtype=torch.long))
        batch.step.compact(batch.cache, self.compact_holes)

    def _decide_close_calls(self, outcome: Outcome, n_acc, verifier, padded_draft, batch,
                            sample, bos_token):
        """Rows whose decisions up to their first close call are kept: that position's token is
        fairseq's own decision, and the row's acceptance ends there (in place on the device:
        ``n_acc``, ``verifier``). ``outcome.first_close``: per row, the first block position
        whose choice the step cannot certify among those the iteration keeps (beyond the block:
        none)."""
        src_tokens = sample["net_input"]["src_tokens"]
        width = verifier.size(1)
        for r, at in enumerate(outcome.first_close):
            if at >= width:
                continue
            n_out = int(batch.n_out_host[r])
            decided = torch.cat([batch.tokens[r, 1: n_out + 1], padded_draft[r, :at]])
            verifier[r, at] = fairseq_decision(self, src_tokens[batch.rows_host[r]], decided,
                                               bos_token)
            n_acc[r] = at
            self.stats.close_calls += 1

    def _speculate(self, lprobs, forced, block: Block):
        """Speculative sampling's accept / residual / bonus for every row of the block.

        Returns the accepted draft lengths (B,) and a (B, L) token grid holding, at each row's
        first non-accepted position, the token drawn there (the rest is never read).
        """
        probs = self.sampler.filter.probs(lprobs)  # (N, V): fairseq's sampling distribution
        if forced is not None:  # --prefix-size: the forced token has probability 1
            is_forced = forced >= 0
            one_hot = torch.zeros_like(probs).scatter_(1, forced.clamp(min=0).unsqueeze(1), 1.0)
            probs = torch.where(is_forced.unsqueeze(1), one_hot, probs)
        ar, layout, q, padded_draft = block.ar, block.layout, block.q, block.padded_draft
        n_acc = self.sampler.accept(block.draft, block.draft_valid,
                                    probs[block.draft_pos, block.draft], q)
        rejected = n_acc < block.draft_len
        q_next = None
        if q is not None and q.size(1) > 0:
            q_next = q[ar, n_acc.clamp(max=q.size(1) - 1)]
        own = self.sampler.next_tokens(
            probs[layout.at(ar, n_acc)], rejected, padded_draft[ar, n_acc], q_next
        )
        grid = padded_draft.clone()
        grid[ar, n_acc] = own
        return n_acc, grid

    def _force_prefix_draft(self, draft, draft_len, batch: Batch, q=None):
        """Rows still inside their --prefix-size prefix draft the prefix itself (a
        deterministic draft: with --sampling their q becomes one-hot). Which rows are inside is
        known on the host; only an iteration with such a row reads the drafts."""
        prefix = batch.prefix_host
        if prefix is None or prefix.size(1) == 0:
            return draft, draft_len, q
        n_out = batch.n_out_host
        remaining = (prefix.size(1) - n_out).clamp(min=0)
        if not bool((remaining > 0).any()):
            return draft, draft_len, q
        rows_in = (remaining > 0).nonzero().view(-1).tolist()
        room = (batch.max_len - n_out).tolist()
        drafts = []
        for r in range(draft.size(0)):
            if r in rows_in:
                start = int(n_out[r])
                forced = [t for t in prefix[r, start:].tolist() if t != self.pad]
                drafts.append(forced[: room[r]])
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
