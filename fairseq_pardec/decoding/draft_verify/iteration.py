"""One iteration of the draft-and-verify engine, top to bottom (engine.py holds the generator,
its batches' start, joins and leaves):

1. ``draft``: the drafter's tokens for every row, up to the room before EOS is forced;
2. ``verify``: one decoder call over every row's [last accepted token, draft];
3. ``decide_rows``: what each row keeps, decided on the host from one read of the device
   (decisions.py);
4. ``commit``: the lengths to the device, the outcome to the drafter, the cache rolled back;
5. ``retire``: the rows that emitted EOS are finalized and leave.
"""

from typing import List

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.decoding.fairseq_rules import block_edits
from fairseq_pardec.decoding.draft_verify.batch_state import Batch, Block, to_device
from fairseq_pardec.decoding.draft_verify.decisions import decide, read_positions, read_sampled
from fairseq_pardec.decoding.draft_verify.drafters.base import DraftOutcome, Drafter, DraftView


def iterate(generator, batch: Batch) -> List[int]:
    """One iteration of every active row of ``batch``; returns the ids of the rows that
    finished (their hypotheses are in ``batch.finalized``) and left."""
    block = draft(generator, batch)
    features, lprobs, forced, native = verify(generator, batch, block)
    outcome = decide_rows(generator, batch, block, lprobs, forced, native)
    commit(generator, batch, block, features, outcome)
    return retire(generator, batch, outcome)


def draft(generator, batch: Batch) -> Block:
    """1. Up to the room left before EOS is forced, the drafter's tokens for every row
    (a row inside its --prefix-size prefix drafts the prefix)."""
    state, schedule = batch.drafts, batch.schedule
    if batch.prefix is None or batch.prefix.size(1) == 0:
        # a drafter is not asked where its schedule knows that no row drafts now (one that
        # never drafts, a quiet spell, every row waiting in the back-off)
        if not schedule.drafts_now(len(batch.rows_host), batch.iteration):
            return Block.last_tokens(batch, generator.pad, proposed=False)
    # the room before EOS is forced, less what the back-off withholds
    room = schedule.room(batch.room(), batch.iteration)
    with batch.drafter_timer:
        drafts = propose(generator, batch, room)
    q = state.draft_probs if generator.sampler is not None else None
    drafts, q = batch.prefix_drafts(drafts, q)
    if not any(drafts) and q is None:  # no row drafted: a plain step
        return Block.last_tokens(batch, generator.pad)
    return Block.from_lists(batch, drafts, generator.pad, q)


def propose(generator, batch: Batch, room: List[int]) -> List[List[int]]:
    """The drafter's drafts as lists, from the host's tables and lists; a drafter model
    gets the engine's device copies of what it asks for, and its drafts are read by the
    engine's read."""
    device = batch.device
    view = DraftView(batch.rows_host, batch.n_out_np.tolist(), room, batch.tokens, device,
                     batch.longest, copy=lambda host: to_device(host, device),
                     read=generator.read, rows_on_device=batch.rows,
                     n_out_on_device=batch.n_out)
    return generator.drafter.propose(batch.drafts, view)


def verify(generator, batch: Batch, block: Block):
    """2. One decoder call over every row's [last accepted token, draft]; the position-wise
    work runs on the block's real positions only. Returns the features, the (N, V) packed
    log-probabilities after fairseq's per-step edits, the forced tokens (or None), and the
    native kernel whose read makes the token edits (or None: they are made)."""
    with batch.verifier_timer:
        step = batch.step
        encoder_out = batch.encoder_out if step.reads_encoder_out(batch.cache) else None
        features = step.forward_packed(block.tokens, batch.n_out, block.layout, encoder_out,
                                       batch.cache)
        lprobs = step.log_probs(features, generator.temperature, batch.cache)
    if block.width > 0:
        # cache entries computed at a block's shapes: later plain steps no longer round as
        # fairseq's own steps do (step/margins.py)
        batch.exact_so_far = False
    generator.stats.decoder_calls += 1
    generator.stats.row_iterations += block.rows
    generator.stats.positions_verified += lprobs.size(0)
    prefix = batch.forcing_prefix()
    # on the CPU the native read of the best two makes fairseq's token edits in its pass
    # (decisions.read_positions), where nothing else reads the log-probabilities first
    native = None
    if (generator.sampler is None and prefix is None and lprobs.dtype == torch.float32
            and lprobs.is_contiguous()
            and (generator.acceptance.lossless or block.width == 0)):
        native = step.scores_kernel(batch.cache)
    bar_eos_possible = batch.iteration < batch.bar_eos_until
    # known on the host, with no read of the device
    at_max_possible = batch.reaches_limit(block.width)
    forced = None
    if native is None or bar_eos_possible or at_max_possible:  # else nothing to edit here
        forced = block_edits(lprobs, lambda: batch.n_out.unsqueeze(1) + block.cols,
                             block.layout, generator.rules, batch.row_limits(), prefix,
                             bar_eos_possible=bar_eos_possible,
                             at_max_possible=at_max_possible, token_edits=native is None)
    batch.iteration += 1
    return features, lprobs, forced, native


def decide_rows(generator, batch: Batch, block: Block, lprobs: Tensor, forced, native):
    """3. What each row keeps: decided on the host from one read of the device (with
    ``--sampling``, by speculative sampling)."""
    if generator.sampler is not None:
        n_acc, grid = generator.sampler.decide(lprobs, forced, block)
        reading = read_sampled(generator, block, lprobs, n_acc, grid)
    else:
        reading = read_positions(generator, batch, block, lprobs, forced, native)
    return decide(generator, batch, block, reading, lprobs, batch.bos_token)


def commit(generator, batch: Batch, block: Block, features: Tensor, outcome):
    """4. With each row's new tokens, scores and length in the host's tables (the decisions
    wrote them), queue the lengths for the device, show the drafter the outcome, and roll
    the cache back to the kept positions."""
    batch.lengths_to_device()
    if block.width == 0:  # a plain step: every row keeps its one position
        fewest = most = 1
    else:
        gained = outcome.gained.tolist()  # a few rows: lists reduce faster than numpy
        fewest, most = min(gained), max(gained)
        batch.schedule.backed_off(block.lengths, outcome.accepted, batch.iteration - 1)
    if block.proposed and type(generator.drafter).observe is not Drafter.observe:
        observe(generator, batch, features, outcome)
    if fewest == most:  # every row keeps as many entries: one tensor per count, kept
        kept = batch.uniform_gains(most)
    else:
        kept = to_device(torch.from_numpy(outcome.gained), batch.device)
    batch.step.rollback(batch.cache, block.width + 1, kept, keep_range=(fewest, most))


def observe(generator, batch: Batch, features: Tensor, outcome):
    """Show the drafter what each row kept of its draft (the accepted draft tokens, not
    the gained ones less the verifier's own: a draft accepted up to its EOS gains no token
    of the verifier's); where it asks, the verifier's features after each row's last kept
    token and that token (blockwise decoding's proposal heads: merged invocation)."""
    device = batch.device
    last_pos, last = outcome.last_pos, batch.last

    def features_at_last() -> Tensor:
        return features.index_select(0, to_device(torch.from_numpy(last_pos), device))

    def newest() -> Tensor:
        return to_device(torch.from_numpy(last), device)

    seen = DraftOutcome(batch.rows_host, outcome.accepted.tolist(), device,
                        features=features_at_last, newest=newest,
                        copy=lambda host: to_device(host, device), rows_on_device=batch.rows)
    with batch.drafter_timer:
        generator.drafter.observe(batch.drafts, seen)


def retire(generator, batch: Batch, outcome) -> List[int]:
    """5. Finalize the rows that emitted EOS and drop them; returns their ids."""
    finished = []
    if outcome.ended_rows:
        ended = outcome.ended
        for r in np.flatnonzero(ended).tolist():
            row = batch.rows_host[r]
            batch.finalized[row] = [batch.hypothesis(r)]
            finished.append(row)
        alive = np.flatnonzero(ended == 0).tolist()
        if not alive:  # the batch is done: nothing to reorder
            batch.rows_host = []
            return finished
        batch.keep(alive)
    batch.step.compact(batch.cache, generator.compact_holes)
    return finished
