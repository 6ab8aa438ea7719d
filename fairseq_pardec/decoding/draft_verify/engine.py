"""The draft -> verify -> accept -> roll back engine shared by IAD, GAD and blockwise decoding.

Per active row the engine keeps the accepted tokens (after BOS), their cumulative scores and the
verifier's KV cache, which holds the keys/values of BOS and every accepted token but the last.
One iteration (iteration.py, read top to bottom):

1. *draft*: the drafter proposes up to ``max_len - n_out`` tokens per row (ragged);
2. *verify*: one decoder call over [last accepted token, draft] on top of the cache gives the
   next-token distribution after every block position;
3. *decide*, on the host: the longest acceptable draft prefix, then the verifier's own token
   at the first rejected position (each iteration gains >= 1 token), up to the first EOS;
4. *commit and roll back*: the cache keeps the kept block positions only; rows that emitted EOS
   leave the batch.

This module holds the generator: what it is built with, the decoder step and encoder it
chooses per batch, the margins in force, and its batches' start, joins and leaves.

The per-step edits are fairseq ``SequenceGenerator``'s (fairseq_rules.block_edits), and so is the
length limit (``--max-len-a/b`` and the padded source length of the batch).

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

A running batch (``open``, ``join``, ``iterate``, ``leave``: the server's) takes rows between
iterations: their encoder runs once, their drafter state starts, and each takes a cache slot of
its own (step.join_rows; the fast step's rows are slots, and a row that leaves frees one: no
other row's entries move; the lean step appends them, the entries before their first being
holes to them). Each
row's length limit is then its own (``--max-len-a`` x its source length + ``--max-len-b``), and
a close call replays its own sentence: its output is the one ``--batch-size 1`` gives it.

Every token is decided on the host (decisions.py; nearly every row by a plain C function,
native/decide.c), on every device, from one read of the device per iteration: per verified
position the best token after fairseq's edits, its log-probability and the runner-up's (with
speculative sampling, what it drew). A second read comes only in an iteration with a close call,
whose replay reads the device anyway, or with a tie that fairseq breaks by ``topk``'s order, or
where the drafter drafts on the device (its drafts are read). The accepted tokens and their
scores live on the host; the device gets the block and the kept counts as queued copies.
"""

from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.errors import UsageError

from fairseq_pardec.decoding.fairseq_rules import SearchRules
from fairseq_pardec.decoding.step import calibration
from fairseq_pardec.decoding.step.margins import (refuse_reduced_precision_matmuls,
                                                  warn_unguarded_precision)
from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler
from fairseq_pardec.decoding.draft_verify import iteration
from fairseq_pardec.decoding.options import (build_through_fairseq, refuse_unknown_arguments, sampling_of,
                                 set_output_symbols)
from fairseq_pardec.decoding.step_factory import StepChoice
from fairseq_pardec.decoding.step.interface import DecoderStep
from fairseq_pardec.decoding.decode_stats import DecodeStats, StatsGenerator
from fairseq_pardec.decoding.draft_verify.batch_state import Batch, BlockShapes
from fairseq_pardec.decoding.draft_verify.encoded_rows import EncodedRows, encodes_ahead


class DraftVerifyGenerator(StatsGenerator):
    """Batched, KV-cached draft-and-verify decoding with one verifier model.

    ``margin``: the margin guard's bound, by default the decoder step's own (its ``margin``);
    a given one applies to every iteration, plain steps included (tests give a wide one to hand
    every decision to fairseq, or 0 to see a step's own choices).

    The decoder step (step/interface.py) and the encoder are chosen per batch for the model's
    device and dtype as they are then (step_factory.py): ``lean`` and ``fast`` say which steps
    may be chosen. Assigning ``block_decoder`` or ``encode`` fixes that one for every batch.
    """

    def __init__(self, models, tgt_dict, drafter, acceptance, max_len_a: float = 0,
                 max_len_b: int = 200, max_len: int = 0, min_len: int = 1,
                 normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0, compact_holes: float = 0.5,
                 lean: bool = True, sampler: Optional[SpeculativeSampler] = None,
                 fast: bool = True, margin: Optional[float] = None, backoff: bool = True):
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
        # dtype, chosen per batch (step_factory.py): fairseq builds the --eval-bleu generator
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
        # device -> the block shapes' tensors the batches share (batch_state.BlockShapes)
        self._block_shapes = {}
        # the engine's reads (``read``): one per iteration, and the drafts of a drafter on the
        # device (a tie's redo, a close call's replay and a drafter's own reads go around it)
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
        self.rules = SearchRules(self.pad, self.unk, self.eos, unk_penalty, min_len)
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
                    "--blockwise-distance, --min-block-size)")
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
        (with the fast step, the fast encoder on the same kernels: cpu/fast_encoder.py;
        assigned: every batch runs that one)."""
        return self._step_and_encoder()[1]

    @encode.setter
    def encode(self, encode):
        self._given_encode = encode

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

    def block_shapes(self, device) -> BlockShapes:
        """The block shapes' tensors on ``device``, shared by this generator's batches."""
        shapes = self._block_shapes.get(device)
        if shapes is None:
            shapes = self._block_shapes[device] = BlockShapes(device)
        return shapes

    def read(self, t: Tensor) -> Tensor:
        """The engine's way to the host: a small tensor read from the device."""
        self.device_reads += 1
        return t.cpu()

    # ------------------------------------------------------------------ main loop
    def _generate(self, sample, prefix_tokens=None, bos_token=None, **unused):
        batch = self._start(sample, prefix_tokens, bos_token)
        while batch.rows_host:
            iteration.iterate(self, batch)
        return batch.finalized

    @torch.no_grad()
    def iterate(self, batch: Batch) -> List[int]:
        """One iteration of every active row (iteration.py): draft, verify, decide, commit;
        returns the ids of the rows that finished (their hypotheses are in
        ``batch.finalized``) and left."""
        return iteration.iterate(self, batch)

    # ------------------------------------------------------------------ a running batch
    def joins_rows(self) -> bool:
        """Whether rows may join a running batch of this generator's (``open`` and ``join``):
        its decoder step and its drafter keep their state per row."""
        return self.block_decoder.joins_rows and self.drafter.joins_rows

    @torch.no_grad()
    def open(self, sample, encoder_out=None) -> Batch:
        """A running batch of ``sample``'s rows, each with its own length limit (from its own
        source length, as ``--batch-size 1`` has it): rows may join it between iterations
        (``join``), and each row's output is the one it has decoded alone. Advance it with
        ``iterate``; its ids are the rows of ``sample`` and then those ``join`` returns.
        ``encoder_out``: the rows' encoder output, where it was computed ahead (``encode_rows``;
        the batch's first call projects their sources itself)."""
        if not self.joins_rows():
            raise UsageError("rows cannot join a running batch of --generator %s on the %s "
                             "decoder step" % (getattr(self, "name", type(self).__name__),
                                               type(self.block_decoder).__name__))
        return self._start(sample, None, None, per_row_limits=True, encoder_out=encoder_out)

    @torch.no_grad()
    def join(self, batch: Batch, sample, encoder_out=None, sources=None) -> List[int]:
        """``sample``'s rows join the running ``batch`` (``open``) before its next iteration:
        their encoder runs once (unless ``encoder_out`` gives its output, computed ahead:
        ``encode_rows``, with the step's ``sources`` projected ahead too) and their drafter
        state starts; returns their row ids."""
        joining = self._start(sample, None, batch.bos_token, per_row_limits=True,
                              step_and_encoder=(batch.step, self._step_and_encoder()[1]),
                              encoder_out=encoder_out, running=batch)
        return batch.absorb(joining, sources)

    @torch.no_grad()
    def encode_rows(self, sample) -> Optional[EncodedRows]:
        """``sample``'s rows encoded in one call, for ``open`` or ``join`` to take a few at a
        time (encoded_rows.py); None where the model's encoder output is not fairseq's
        Transformer dictionary, whose rows could not be taken."""
        if not encodes_ahead(self.model):
            return None
        step, encode = self._step_and_encoder()
        encoder_out = encode(sample["net_input"])
        return EncodedRows(sample, encoder_out, self.src_pad, step.project_sources(encoder_out))

    def _start(self, sample, prefix_tokens, bos_token, per_row_limits: bool = False,
               step_and_encoder=None, encoder_out=None, running: Optional[Batch] = None) -> Batch:
        """Encode the batch, start the drafter, and set up the state of every row."""
        self.model.decoder.set_beam_size(1)  # undo a beam generator built earlier on this model
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        device = src_tokens.device
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        row_max_len = None
        if per_row_limits:  # each row's from its own source length
            lengths = net_input["src_lengths"].view(-1).cpu().numpy().astype(np.float64)
            row_max_len = np.minimum((self.max_len_a * lengths + self.max_len_b).astype(np.int64),
                                     self.max_len - 1)
            if self.min_len > int(row_max_len.min()):
                max_len = int(row_max_len.min())  # refused below, as fairseq refuses it
            else:
                max_len = int(row_max_len.max())
        if self.min_len > max_len:
            raise UsageError("the length limit (--max-len-a %g x source length %d + --max-len-b %d, "
                             "at most the model's %d) is below --min-len %d; raise --max-len-b"
                             % (self.max_len_a, src_len, self.max_len_b, self.max_len - 1,
                                self.min_len))
        # chosen per batch: the model's device and dtype may have changed since the last one
        step, encode = step_and_encoder or self._step_and_encoder()
        guard = self._guard_margin(step)
        bos = self.eos if bos_token is None else bos_token
        margins = None
        if self.acceptance.lossless and self.sampler is None:
            # read at generate time: the setting may change after the generator was built
            weight = self.model.decoder.embed_tokens.weight
            refuse_reduced_precision_matmuls(weight.device, weight.dtype)
            if guard is None:
                warn_unguarded_precision(weight.dtype)
            elif running is not None and running.margins is not None and running.margins.final:
                # rows joining a running batch decode with its weights (its step's cache holds
                # their layouts), on which its margins were measured in full
                margins = running.margins
                guard = margins.step
            elif self.margin is None:  # the step's own margin: as measured on this model
                margins = calibration.margins_for(self.model, step, encode, net_input, bos,
                                                  self.eos, self.src_pad, self.pad, max_len)
                guard = margins.step
                self.stats.margins = margins.describe()
        batch = Batch(self, step, bsz, max_len, bos, prefix_tokens, device, guard, margins,
                      row_max_len=row_max_len, sources=src_tokens, bos_token=bos_token)
        if encoder_out is None:
            with batch.encoder_timer:
                encoder_out = encode(net_input)
        batch.set_encoder_out(encoder_out)
        with batch.drafter_timer:
            batch.drafts = self.drafter.start(sample, batch.encoder_out, bos, batch.schedule)
        return batch

    def leave(self, batch: Batch, ids: List[int]):
        """Rows ``ids`` leave the running ``batch`` unfinished (their requests were cancelled);
        their ids are free again."""
        gone = set(ids)
        alive = [r for r, row in enumerate(batch.rows_host) if row not in gone]
        leaving = [row for row in batch.rows_host if row in gone]  # (ids not running stay)
        if not leaving:
            return
        if alive:
            batch.keep(alive)
        else:
            batch.rows_host = []
        batch.release(leaving)


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
