"""What the engine keeps while a batch decodes (engine.py): the active rows and everything kept
per row (:class:`Batch`), and one iteration's block of last tokens and drafts (:class:`Block`).

The host decides every token (decisions.py), so the accepted tokens, their scores and the row
lengths live on the host, on every device. The device gets what the decoder step and the
drafters that run there read: the block's tokens and layout, the rows' lengths, the kept counts
of a rollback, each a copy queued like a kernel (``to_device``), never a wait. On the CPU a
plain step reads the host's own lengths and last tokens: every reader runs before the
decisions write them.
"""

from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_pardec.decoding.decode_stats import PartTimer
from fairseq_pardec.decoding.draft_verify.decisions import Outcome
from fairseq_pardec.decoding.draft_verify.margin_guard import RowReplay
from fairseq_pardec.decoding.draft_verify.drafters.base import pad_drafts, place_rows
from fairseq_pardec.decoding.draft_verify.drafters.schedule import DraftSchedule
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.interface import DecoderStep
from fairseq_pardec.decoding.step.lean import cat_padded, joined_padding
from fairseq_pardec.native.library import (DECIDE_EOS, DECIDE_SLOTS, DECIDE_TABLES,
                                                native_kernel)


def join_encoder_outs(a: dict, rows_a: int, b: dict, rows_b: int) -> dict:
    """Two batches' encoder outputs (fairseq's dictionary), one batch after the other; the
    shorter source is padded at its end and marked as padding."""
    out = {}
    for key in a:
        x, y = a[key], b.get(key, [])
        if not x or not y:
            out[key] = []
        elif key in ("encoder_out", "encoder_states"):  # (S, B, C)
            out[key] = [cat_padded(p, q, source_dim=0, rows_dim=1) for p, q in zip(x, y)]
        elif key == "encoder_embedding":  # (B, S, C)
            out[key] = [cat_padded(x[0], y[0], source_dim=1, rows_dim=0)]
        elif key == "src_lengths":
            out[key] = [torch.cat([x[0], y[0]], dim=0)]
        else:  # read by no decoder step (src_tokens, fc_results): left out
            out[key] = []
    states_a, states_b = a["encoder_out"][0], b["encoder_out"][0]
    pad = joined_padding((a.get("encoder_padding_mask") or [None])[0],
                         (b.get("encoder_padding_mask") or [None])[0], rows_a, rows_b,
                         states_a.size(0), states_b.size(0), states_a.device)
    out["encoder_padding_mask"] = [] if pad is None else [pad]
    return out


def filled_in(alive: List[int]) -> List[int]:
    """The ascending ``alive`` rows in the order where each place of a row that left is taken
    by one of the last rows: [0, 1, 3, 4] -> [0, 1, 4, 3] (row 4 takes row 2's place)."""
    kept = len(alive)
    staying = set(alive)
    tail = [r for r in alive if r >= kept]
    return [r if r in staying else tail.pop() for r in range(kept)]


def to_device(host: Tensor, device) -> Tensor:
    """A device copy of a host tensor, queued without waiting for the device. A new tensor on
    the CPU too: the host's own keeps changing, and the copy must not."""
    return host.clone().to(device, non_blocking=True)


class Batch:
    """The rows of one ``generate`` call still decoding, and everything kept per row: what the
    steps of an iteration read and write, reordered together when rows finish."""

    def __init__(self, generator, step: DecoderStep, bsz: int,
                 max_len: int, bos: int, prefix: Optional[Tensor], device,
                 guard: Optional[float] = None, margins=None,
                 row_max_len: Optional[np.ndarray] = None, sources: Optional[Tensor] = None,
                 bos_token: Optional[int] = None):
        self.generator = generator
        # the BOS the caller gave (None: fairseq's default), as the guard's replays pass it on
        self.bos_token = bos_token
        # the decoder step of this batch, chosen when it started (its cache is this step's)
        self.step = step
        self.device = torch.device(device)
        # the most tokens a row outputs: one limit for every row (fairseq's, from the batch's
        # padded source length), or per active row (``row_max_len``, each from its own source
        # length, as at batch 1: rows that join a running batch); ``max_len`` is then the
        # largest, the width of the tables
        self.max_len = max_len
        self.row_max_len = row_max_len
        self._row_limits = None  # row_max_len as a (B, 1) tensor on the device, when read
        # row id -> its source tokens (the guard's replays decode the sentence alone)
        self.sources = sources
        # row ids of rows that left and whose outputs were taken (``release``): rows that join
        # take them again
        self.free_ids: List[int] = []
        # until which iteration a row may still be below --min-len (each row gains >= 1 token
        # per iteration from the one it joined at)
        self.bar_eos_until = generator.min_len
        self.prefix = prefix  # (B, P) forced prefix tokens, pad = not forced; or None
        # the same on the host (read once per batch: rows inside it draft it)
        self.prefix_host = prefix.cpu() if prefix is not None and prefix.size(1) else None
        self.rows = torch.arange(bsz, device=device)  # active row -> row of the batch (its id)
        self.rows_host = list(range(bsz))
        # active row -> its row of the encoder's output (``encoder_out``)
        self.encoder_rows = self.rows
        # the margin guard: its margin (None: no guard), and whether every step so far ran one
        # position per row on a step that then rounds as fairseq does (no guard needed yet)
        self.guard = guard
        # the margins in force on this model (step/calibration.py), None where given or unguarded
        self.margins = margins
        self.exact_so_far = generator.margin is None and step.one_position_exact
        # on the host: BOS and the accepted tokens, their cumulative scores, the row lengths
        self.tokens = torch.full((bsz, max_len + 2), generator.pad, dtype=torch.long)
        self.tokens[:, 0] = bos
        self.cum_scores = torch.zeros(bsz, max_len + 1)
        self.n_out_host = torch.zeros(bsz, dtype=torch.long)
        # each row's last accepted token (BOS at first): the next block starts with it
        self.last = np.full(bsz, bos, dtype=np.int64)
        # the row lengths on the device (the decoder step's positions), after every commit; on
        # the CPU the host's own tensor: whatever reads it there runs before the decisions
        # write the host's
        self.shares_lengths = self.device.type == "cpu"
        self.n_out = (self.n_out_host if self.shares_lengths
                      else torch.zeros(bsz, dtype=torch.long, device=device))
        self.longest = 0
        # the cumulative score of each row's last accepted token, in float32
        self.prev_score = np.zeros(bsz, dtype=np.float32)
        # the native decisions (native/decide.c; None: Python's walk decides) and their
        # argument table, whose slots for the tables above ``views`` fills
        self.decider = native_kernel()
        self.decide_args = np.zeros(DECIDE_SLOTS, dtype=np.int64)
        self.decide_args_at = self.decide_args.ctypes.data
        self.decide_args[DECIDE_EOS] = generator.eos
        # row count -> the Outcome arrays an iteration's decisions write (outcome)
        self._outcomes = {}
        self.views()
        self.cache = step.new_state(max_len=max_len)
        # which rows draft, how much and when (drafters/schedule.py), and the drafter's state
        # for this batch (Drafter.start)
        self.schedule = DraftSchedule(bsz, backoff=generator.backoff)
        self.drafts = None
        # row count -> a block without drafts, less its tokens (Block.last_tokens)
        self.plain_blocks = {}
        # the device tensors that depend on a block's shape alone, kept across batches
        self.shapes = generator.block_shapes(self.device)
        self.finalized = [[] for _ in range(bsz)]
        # row of the batch -> its close calls' replay state (margin_guard.RowReplay)
        self._replays = {}
        # every active row has gained >= 1 token per iteration: n_out >= iteration
        self.iteration = 0
        # the drafter's, the verifier's, the encoder's and the guard's shares of the time
        # (benchmark)
        self.drafter_timer = PartTimer(generator.stats, "drafter_time", self.device)
        self.verifier_timer = PartTimer(generator.stats, "verifier_time", self.device)
        self.encoder_timer = PartTimer(generator.stats, "encoder_time", self.device)
        self.guard_timer = PartTimer(generator.stats, "guard_time", self.device)

    def keep(self, alive: List[int]):
        """Keep the active rows ``alive`` (indices into the active rows), in that order; in a
        running batch (``row_max_len``: rows join it) the last rows take the places of those
        that left instead, so that the step moves only as many rows as left."""
        if self.row_max_len is not None:
            alive = filled_in(alive)
        alive_host = torch.tensor(alive, dtype=torch.long)
        self.n_out_host = self.n_out_host[alive_host]
        self.tokens, self.cum_scores = self.tokens[alive_host], self.cum_scores[alive_host]
        self.prev_score, self.last = self.prev_score[alive], self.last[alive]
        self.views()
        self.rows_host = [self.rows_host[i] for i in alive]
        if self._replays:
            staying = set(self.rows_host)
            self._replays = {row: replay for row, replay in self._replays.items()
                             if row in staying}
        self.longest = int(self.n_out_host.max()) if alive else 0
        if self.prefix_host is not None:
            self.prefix_host = self.prefix_host[alive_host]
        if self.row_max_len is not None:
            self.row_max_len, self._row_limits = self.row_max_len[alive], None
        self.schedule.keep(alive_host)
        alive_dev = to_device(alive_host, self.device)
        self.rows = self.rows[alive_dev]
        self.encoder_rows = self.encoder_rows[alive_dev]
        self.n_out = self.n_out_host if self.shares_lengths else self.n_out[alive_dev]
        if self.prefix is not None:
            self.prefix = self.prefix[alive_dev]
        if alive:
            self.step.reorder(self.cache, alive_dev)

    def absorb(self, other: "Batch", sources=None) -> List[int]:
        """The rows of ``other``, a batch just started on the same generator and step (not yet
        iterated), join this one after its active rows; returns their row ids, at which their
        outputs will be (``finalized``). Ids freed by ``release`` are taken first. No row
        already here is copied but where a table grows by the new rows. ``sources``: their
        sources as the step projected them ahead (step.project_sources), or None."""
        if other.step is not self.step or other.device != self.device:
            raise ValueError("rows join a running batch of the same decoder step and device")
        if self.prefix is not None or other.prefix is not None:
            raise ValueError("rows with forced prefixes (--prefix-size) join no running batch")
        count = len(other.rows_host)
        reused = self.free_ids[:count]
        del self.free_ids[:count]
        fresh = len(self.finalized)
        ids = reused + list(range(fresh, fresh + count - len(reused)))
        self.finalized.extend([] for _ in range(count - len(reused)))
        for row in ids:
            self.finalized[row] = []
            self._replays.pop(row, None)
        # the tables: every row's limit kept, as wide as the longest limit
        width = max(self.max_len, other.max_len)
        mine = (self.row_max_len if self.row_max_len is not None
                else np.full(len(self.rows_host), self.max_len, dtype=np.int64))
        theirs = (other.row_max_len if other.row_max_len is not None
                  else np.full(count, other.max_len, dtype=np.int64))
        self.row_max_len, self._row_limits = np.concatenate([mine, theirs]), None

        def wider(t: Tensor, columns: int, value) -> Tensor:
            if t.size(1) == columns:
                return t
            return torch.cat([t, t.new_full((t.size(0), columns - t.size(1)), value)], dim=1)

        pad = self.generator.pad
        self.tokens = torch.cat([wider(self.tokens, width + 2, pad),
                                 wider(other.tokens, width + 2, pad)])
        self.cum_scores = torch.cat([wider(self.cum_scores, width + 1, 0.0),
                                     wider(other.cum_scores, width + 1, 0.0)])
        self.max_len = width
        self.n_out_host = torch.cat([self.n_out_host, other.n_out_host])
        self.last = np.concatenate([self.last, other.last])
        self.prev_score = np.concatenate([self.prev_score, other.prev_score])
        self.views()
        self.n_out = (self.n_out_host if self.shares_lengths
                      else to_device(self.n_out_host, self.device))
        self.rows_host = self.rows_host + ids
        self.rows = torch.cat([self.rows, to_device(torch.tensor(ids), self.device)])
        if not isinstance(self.sources, list):
            self.sources = list(self.sources)
        place_rows(self, other, ("sources",), ids)
        joined = None
        if not self.step.reads_encoder_out(self.cache):  # started: the new rows join it
            self.step.join_rows(self.cache, other.encoder_out, count, sources)
            # the lean step's cache has entries before their first (holes), which fairseq's
            # steps never have
            self.exact_so_far = False
        else:  # not run yet: its first call projects every row's encoder output
            joined = join_encoder_outs(self.encoder_out, len(self.rows_host) - count,
                                       other.encoder_out, count)
            self.exact_so_far = self.exact_so_far and other.exact_so_far
        self.encoder_rows = torch.arange(len(self.rows_host), device=self.device)
        # once the cache holds every row's projected encoder output nothing reads the
        # encoder's own again (the drafters that join rows read none): none is kept, so that
        # a batch running for hours holds no output of the rows it has served
        self._encoder_out_all = joined
        self._encoder_out = None if joined is None else (self.encoder_rows, joined)
        # the margins in force grow while the model's first rows are measured
        # (step/calibration.py): the later batch's apply to every row from now on
        if other.guard is not None and self.guard is not None and other.guard > self.guard:
            self.guard, self.margins = other.guard, other.margins
        self.schedule.absorb(other.schedule, ids)
        self.drafts.absorb(other.drafts, ids)
        self.bar_eos_until = max(self.bar_eos_until, self.iteration + self.generator.min_len)
        return ids

    def release(self, ids: List[int]):
        """The outputs of rows ``ids`` (which left) were taken: rows joining later take the
        ids again."""
        for row in ids:
            self.finalized[row] = []
        self.free_ids.extend(ids)

    def row_limits(self):
        """Each active row's length limit as fairseq's edits read it: the batch's one limit,
        or a (B, 1) tensor of the rows' own on the device."""
        if self.row_max_len is None:
            return self.max_len
        if self._row_limits is None:
            self._row_limits = to_device(torch.from_numpy(self.row_max_len).view(-1, 1),
                                         self.device)
        return self._row_limits

    def room(self) -> List[int]:
        """Each active row's room before EOS is forced."""
        if self.row_max_len is None:
            max_len = self.max_len
            return [max_len - n for n in self.n_out_np.tolist()]
        return (self.row_max_len - self.n_out_np).tolist()

    def reaches_limit(self, width: int) -> bool:
        """Whether some row's block of ``width`` drafts may reach its length limit."""
        if self.row_max_len is None:
            return self.longest + width >= self.max_len
        return bool((self.n_out_np + width >= self.row_max_len).any())

    def source(self, r: int) -> Tensor:
        """Active row ``r``'s source tokens."""
        return self.sources[self.rows_host[r]]

    def row_replay(self, r: int) -> RowReplay:
        """Active row ``r``'s replay state, kept for its later close calls until it leaves."""
        row = self.rows_host[r]
        replay = self._replays.get(row)
        if replay is None:
            replay = self._replays[row] = RowReplay()
        return replay

    @property
    def margin(self) -> Optional[float]:
        """The margin the guard applies in the current iteration (None: none applies)."""
        return None if self.exact_so_far else self.guard

    def views(self):
        """numpy views of the host tables, which the decisions write through, and their
        addresses in the native decisions' argument table (native/decide.c's slots)."""
        self.tokens_np, self.scores_np = self.tokens.numpy(), self.cum_scores.numpy()
        self.n_out_np = self.n_out_host.numpy()
        self.decide_args[DECIDE_TABLES] = (
            self.prev_score.ctypes.data, self.n_out_np.ctypes.data, self.last.ctypes.data,
            self.tokens_np.ctypes.data, self.tokens_np.shape[1], self.scores_np.ctypes.data,
            self.scores_np.shape[1])

    def outcome(self) -> Outcome:
        """The arrays an iteration's decisions write, kept per row count."""
        rows = self.n_out_np.size
        outcome = self._outcomes.get(rows)
        if outcome is None:
            outcome = self._outcomes[rows] = Outcome(rows)
        return outcome

    def lengths_to_device(self):
        """Queue the row lengths the decisions wrote for the device (on the CPU it reads the
        host's own)."""
        if not self.shares_lengths:
            self.n_out = to_device(self.n_out_host, self.device)

    def forcing_prefix(self) -> Optional[Tensor]:
        """The forced prefixes while some row's next step lies inside them (known on the
        host), else None: past every prefix fairseq forces nothing and bars no EOS for it."""
        if self.prefix_host is None or int(self.n_out_host.min()) >= self.prefix_host.size(1):
            return None
        return self.prefix

    def prefix_drafts(self, drafts: List[List[int]], q: Optional[Tensor] = None):
        """The drafts with the rows still inside their --prefix-size prefix drafting the prefix
        itself (a deterministic draft: with --sampling their q becomes one-hot)."""
        prefix, pad = self.prefix_host, self.generator.pad
        if prefix is None or prefix.size(1) == 0:
            return drafts, q
        n_out = self.n_out_host.tolist()
        inside = [r for r, n in enumerate(n_out) if n < prefix.size(1)]
        if not inside:
            return drafts, q
        drafts = list(drafts)
        for r in inside:
            forced = [t for t in prefix[r, n_out[r]:].tolist() if t != pad]
            drafts[r] = forced[: self.max_len - n_out[r]]
        if q is not None:
            padded, _ = pad_drafts(drafts, pad, q.device)
            width = padded.size(1)
            one_hot = torch.zeros(len(drafts), width, q.size(-1), device=q.device, dtype=q.dtype)
            one_hot.scatter_(2, padded.unsqueeze(-1), 1.0)
            keep = min(width, q.size(1))
            for r in range(len(drafts)):
                if r not in inside:
                    one_hot[r, :keep] = q[r, :keep]
            q = one_hot
        return drafts, q

    def hypothesis(self, r: int):
        """fairseq's finalized hypothesis dict of active row ``r`` (scores as
        SequenceGenerator computes them), on the batch's device."""
        generator, device = self.generator, self.device
        length = int(self.n_out_np[r])
        cum = self.scores_np[r, :length]
        # each token's own score: float32 differences, as fairseq's (numpy rounds one float32
        # subtraction as torch does)
        positional = np.empty(length, dtype=np.float32)
        positional[0] = cum[0]
        np.subtract(cum[1:], cum[:-1], out=positional[1:])
        # divided on the batch's device, as fairseq divides (CUDA's division by a scalar rounds
        # otherwise than the CPU's)
        score = torch.from_numpy(cum[length - 1:].copy()).view(()).to(device, non_blocking=True)
        if generator.normalize_scores:
            score /= length ** generator.len_penalty
        tokens = torch.from_numpy(self.tokens_np[r, 1: length + 1].copy())
        return {
            "tokens": tokens.to(device, non_blocking=True),
            "score": score,
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": torch.from_numpy(positional).to(device, non_blocking=True),
        }

    def uniform_gains(self, count: int) -> Tensor:
        """(B,) ``count`` for every active row on the device, kept per row count and count
        (each iteration of a generator that drafts nothing gains one token in every row)."""
        return self.shapes.uniform_gains(self.n_out_np.size, count)

    def set_encoder_out(self, encoder_out):
        """The encoder's output for the batch's rows; for the active rows it is reordered when
        read (``encoder_out``): the fast step reads it once, when the batch starts."""
        self._encoder_out_all = encoder_out
        self._encoder_out = (self.encoder_rows, encoder_out)

    @property
    def encoder_out(self):
        """The encoder's output for the active rows."""
        if self._encoder_out is None:
            raise RuntimeError("rows joined this running batch after its first iteration: the "
                               "decoder step's cache holds their encoder output, and the batch "
                               "keeps none")
        rows, encoder_out = self._encoder_out
        if rows is not self.encoder_rows:
            encoder_out = self.generator.model.encoder.reorder_encoder_out(
                self._encoder_out_all, self.encoder_rows)
            self._encoder_out = (self.encoder_rows, encoder_out)
        return encoder_out


class BlockShapes:
    """The device tensors that depend on a block's shape alone, made once per shape on one
    device and shared by the batches that follow (each batch used to make its own: at batch 1
    most blocks drafting alike started a new shape). Nothing writes them once made. A
    generator keeps one per device; past ``LIMIT`` shapes of a kind they are made anew."""

    LIMIT = 1024

    def __init__(self, device):
        self.device = device
        # (row count, width) -> (cols, pad grid, layout) of a block whose rows all draft
        # ``width`` tokens
        self._dense = {}
        # width -> the block positions 0 .. width
        self._cols = {}
        # (row count, count) -> (B,) ``count`` for every row
        self._gains = {}
        # row count -> (B, 1) on the host: a plain block's grid for the native decisions
        self._plain_grids = {}

    @classmethod
    def _kept(cls, table: dict, key, make):
        value = table.get(key)
        if value is None:
            if len(table) >= cls.LIMIT:  # (clear: one step, safe where threads share it)
                table.clear()
            value = table[key] = make()
        return value

    def dense(self, rows: int, width: int):
        def make():
            pad_grid = torch.zeros(rows, width + 1, dtype=torch.bool, device=self.device)
            return self.cols(width), pad_grid, BlockLayout(pad_grid, dense=True)
        return self._kept(self._dense, (rows, width), make)

    def cols(self, width: int) -> Tensor:
        return self._kept(self._cols, width,
                          lambda: torch.arange(width + 1, device=self.device))

    def plain_grid(self, rows: int) -> Tensor:
        return self._kept(self._plain_grids, rows,
                          lambda: torch.zeros(rows, 1, dtype=torch.long))

    def uniform_gains(self, rows: int, count: int) -> Tensor:
        return self._kept(self._gains, (rows, count), lambda: torch.full(
            (rows,), count, dtype=torch.long, device=self.device))


class Block:
    """One iteration's block: per row, [last accepted token, draft], padded to one width.

    Built on the host from the drafts as lists (``drafts``, ``lengths``; as arrays for the
    native decisions, with ``pos``: per row and block position its packed row, -1 at padding:
    ``host_arrays``); the decoder step reads ``tokens`` and ``layout`` on the device. The
    drafts as device tensors, which speculative sampling and the relaxed acceptance rules read,
    are made when first read (``__getattr__``).
    """

    # whether the drafter proposed for this block (else it is not shown the outcome either)
    proposed = True
    # (B, K, V) the drafts' distributions (speculative sampling) or None
    q = None

    @classmethod
    def last_tokens(cls, batch: Batch, pad: int, proposed: bool = True) -> "Block":
        """The block without drafts, each row's last accepted token (a greedy step), built in a
        few operations: what depends on the row count alone is kept per row count (its device
        tensors across batches: ``BlockShapes``)."""
        rows = batch.n_out_np.size
        template = batch.plain_blocks.get(rows)
        if template is None:
            template = batch.plain_blocks[rows] = cls.__new__(cls)
            template.device, template.padded_with = batch.device, pad
            template.last_array = None  # the array its tokens view, on the CPU
            template.rows, template.width = rows, 0
            template.cols, template.pad, template.layout = batch.shapes.dense(rows, 0)
            template.drafts, template.lengths = [[]] * rows, [0] * rows
            # (a plain row's block holds no draft: the grid's contents are never read)
            template.host_arrays(batch.shapes.plain_grid(rows))
        block = cls.__new__(cls)
        block.__dict__.update(template.__dict__)
        if batch.shares_lengths:  # on the CPU the step reads the host's own last tokens,
            # before the decisions write them (a view, kept while the array is the batch's)
            if template.last_array is not batch.last:
                template.last_array = batch.last
                template.tokens = torch.from_numpy(batch.last).view(rows, 1)
            block.tokens = template.tokens
        else:
            block.tokens = torch.from_numpy(batch.last.reshape(rows, 1)).to(
                batch.device, non_blocking=True, copy=True)
        block.proposed = proposed
        return block

    @classmethod
    def from_lists(cls, batch: Batch, drafts: List[List[int]], pad: int,
                   q: Optional[Tensor] = None) -> "Block":
        """The block of the drafter's lists ``drafts``, one per active row."""
        block = cls.__new__(cls)
        block.device, block.padded_with, block.q = batch.device, pad, q
        rows, lengths = len(drafts), [len(d) for d in drafts]
        width = max(lengths)
        block.rows, block.width, block.drafts, block.lengths = rows, width, drafts, lengths
        # a fresh array, never written again: the copy to the device may be queued
        grid = torch.from_numpy(np.array([[last] + d + [pad] * (width - len(d))
                                          for last, d in zip(batch.last.tolist(), drafts)],
                                         dtype=np.int64))
        block.tokens = grid.to(batch.device, non_blocking=True)
        if min(lengths) == width:  # what depends on the shape alone is kept per shape
            block.cols, block.pad, block.layout = batch.shapes.dense(rows, width)
            block.host_arrays(grid)
        else:  # real positions packed time-major: position j of every row, then j + 1
            block.cols = batch.shapes.cols(width)
            length_array = np.array(lengths, dtype=np.int64)
            real = np.arange(width + 1) <= length_array[:, None]  # (rows, width + 1)
            order = real.T.reshape(-1)  # time-major
            index = np.flatnonzero(order)
            packed = np.full(order.size, -1, dtype=np.int64)
            packed[index] = np.arange(index.size)
            block.pos = np.ascontiguousarray(packed.reshape(width + 1, rows).T)
            # a fresh array, never written again: on the CPU no copy of its own
            block.pad = torch.from_numpy(~real).to(batch.device, non_blocking=True)
            block.layout = BlockLayout.from_host(block.pad, index, block.pos)
            block.host_arrays(grid, torch.from_numpy(length_array), torch.from_numpy(block.pos))
        return block

    def host_arrays(self, grid: Tensor, lengths: Optional[Tensor] = None,
                    pos: Optional[Tensor] = None):
        """The block on the host as the native decisions read it, by address (native/decide.c's
        slots POS, BLOCK, LENGTHS): ``grid`` (rows, width + 1) the last tokens and the padded
        drafts; ``lengths`` (rows,) the draft lengths and ``pos`` (rows, width + 1) the packed
        position of each row's block position (-1 at padding), both None for a dense block."""
        self._host = (grid, lengths, pos)  # kept alive while the addresses are used
        self.addresses = (0 if pos is None else pos.data_ptr(), grid.data_ptr(),
                          0 if lengths is None else lengths.data_ptr())

    def __getattr__(self, name):
        """The drafts as device tensors (speculative sampling, relaxed acceptance), and a dense
        block's ``pos`` on the host (Python's walk)."""
        if name == "pos":  # a dense block's: position j of row r is packed at j * rows + r
            self.pos = np.arange((self.width + 1) * self.rows, dtype=np.int64).reshape(
                self.width + 1, self.rows).T
            return self.pos
        if name not in ("ar", "draft", "draft_len", "draft_valid", "draft_pos", "padded_draft"):
            raise AttributeError(name)
        device, width = self.device, self.width
        self.draft, self.draft_len = pad_drafts(self.drafts, self.padded_with, device)
        self.padded_draft = torch.cat(
            [self.draft, self.draft.new_full((self.rows, 1), self.padded_with)], dim=1)
        self.ar = torch.arange(self.rows, device=device)
        self.draft_valid = ~self.pad[:, 1:]
        self.draft_pos = self.layout.pos[:, :width].clamp(min=0)
        return getattr(self, name)
