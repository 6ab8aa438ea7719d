"""What the engine keeps while a batch decodes (engine.py): the active rows and everything kept
per row (:class:`Batch`), one iteration's block of last tokens and drafts (:class:`Block`), and
what an iteration keeps of each row (:class:`Outcome`). They change together when the engine's
state changes; the iteration itself reads top to bottom in engine.py."""

from typing import List, Optional

import torch
from torch import Tensor

from fairseq_pardec.decoding.decode_stats import PartTimer
from fairseq_pardec.decoding.draft_verify.backoff import DraftBackoff
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.interface import DecoderStep


class Batch:
    """The rows of one ``generate`` call still decoding, and everything kept per row: what the
    steps of an iteration read and write, reordered together when rows finish."""

    def __init__(self, generator, step: DecoderStep, bsz: int,
                 max_len: int, bos: int, encoder_out, prefix: Optional[Tensor], device,
                 guard: Optional[float] = None):
        self.generator = generator
        # the decoder step of this batch, chosen when it started (its cache is this step's)
        self.step = step
        self.max_len = max_len
        # whether the iterations are decided on the host (host_decisions.py; set by _generate)
        self.on_host = False
        self.prefix = prefix  # (B, P) forced prefix tokens, pad = not forced; or None
        # the same on the host (read once per batch: rows inside it draft it)
        self.prefix_host = prefix.cpu() if prefix is not None and prefix.size(1) else None
        self.rows = torch.arange(bsz, device=device)  # active row -> row of the batch
        self.rows_host = list(range(bsz))
        # the margin guard: its margin (None: no guard), and whether every step so far ran one
        # position per row on a step that then rounds as fairseq does (no guard needed yet)
        self.guard = guard
        self.exact_so_far = generator.margin is None and step.one_position_exact
        # the encoder's output for the batch's rows; for the active rows it is reordered when
        # read (``encoder_out``): the fast step reads it once, when the batch starts
        self._encoder_out_all = encoder_out
        self._encoder_out = (self.rows, encoder_out)
        # accepted tokens after BOS, and their cumulative scores
        self.tokens = torch.full((bsz, max_len + 2), generator.pad, dtype=torch.long,
                                 device=device)
        self.tokens[:, 0] = bos
        self.cum_scores = torch.zeros(bsz, max_len + 1, device=device)
        self.n_out = torch.zeros(bsz, dtype=torch.long, device=device)
        # the same lengths on the host (updated from the iteration's one read), and their max
        self.n_out_host = torch.zeros(bsz, dtype=torch.long)
        self.longest = 0
        # the cumulative score of each row's last accepted token, as a float32 value (kept by
        # the host path, host_decisions.py)
        self.prev_score = [0.0] * bsz
        self.cache = step.new_state(max_len=max_len)
        self.backoff = DraftBackoff(bsz) if generator.backoff else None
        # row count -> a block without drafts, less its tokens (Block.last_tokens)
        self.plain_blocks = {}
        # (row count, count) -> (B,) tensor of count (uniform_gains)
        self._uniform_gains = {}
        self.finalized = [[] for _ in range(bsz)]
        # every active row has gained >= 1 token per iteration: n_out >= iteration
        self.iteration = 0
        # the drafter's and the verifier's shares of the time (benchmark)
        self.drafter_timer = PartTimer(generator.stats, "drafter_time", torch.device(device))
        self.verifier_timer = PartTimer(generator.stats, "verifier_time", torch.device(device))

    def keep(self, alive: Tensor):
        """Keep the active rows ``alive`` (indices into the active rows, on the host), in that
        order."""
        self.n_out_host = self.n_out_host[alive]
        order = alive.tolist()
        self.prev_score = [self.prev_score[i] for i in order]
        self.rows_host = [self.rows_host[i] for i in order]
        self.longest = int(self.n_out_host.max()) if alive.numel() else 0
        if self.prefix_host is not None:
            self.prefix_host = self.prefix_host[alive]
        if self.backoff is not None:
            self.backoff.keep(alive)
        # without waiting for the device (a copy from the host is queued like a kernel)
        alive = alive.to(self.rows.device, non_blocking=True)
        self.rows, self.tokens = self.rows[alive], self.tokens[alive]
        self.cum_scores, self.n_out = self.cum_scores[alive], self.n_out[alive]
        if self.prefix is not None:
            self.prefix = self.prefix[alive]
        if alive.numel() > 0:
            self.step.reorder(self.cache, alive)

    def forcing_prefix(self) -> Optional[Tensor]:
        """The forced prefixes while some row's next step lies inside them (known on the
        host), else None: past every prefix fairseq forces nothing and bars no EOS for it."""
        if self.prefix_host is None or int(self.n_out_host.min()) >= self.prefix_host.size(1):
            return None
        return self.prefix

    def uniform_gains(self, count: int) -> Tensor:
        """(B,) ``count`` for every active row, kept per row count and count (each iteration
        of a generator that drafts nothing gains one token in every row)."""
        key = (self.n_out_host.numel(), count)
        gains = self._uniform_gains.get(key)
        if gains is None:
            gains = self._uniform_gains[key] = torch.full(key[:1], count, dtype=torch.long,
                                                           device=self.rows.device)
        return gains

    @property
    def encoder_out(self):
        """The encoder's output for the active rows."""
        rows, encoder_out = self._encoder_out
        if rows is not self.rows:
            encoder_out = self.generator.model.encoder.reorder_encoder_out(
                self._encoder_out_all, self.rows)
            self._encoder_out = (self.rows, encoder_out)
        return encoder_out


class Outcome:
    """What one iteration keeps of each row: on the device, the (B, L) token grid and the (B,)
    gains and first EOS columns; on the host, from the iteration's one read, the gains, whether
    each row ended, what it drafted and accepted, and its first close call (None: no guard)."""

    def __init__(self, new_tokens: Tensor, gained: Tensor, first_eos: Tensor,
                 gained_host: List[int], done_host: List[int], drafted_host: List[int],
                 accepted_host: List[int], first_close: Optional[List[int]] = None):
        self.new_tokens, self.gained, self.first_eos = new_tokens, gained, first_eos
        self.gained_host, self.done_host = gained_host, done_host
        self.drafted_host, self.accepted_host = drafted_host, accepted_host
        self.first_close = first_close


class Block:
    """One iteration's block: per row, [last accepted token, draft], padded to one width."""

    # (drafts, draft lengths, packed positions) as lists, where they are known without reading
    # the tensors (a block without drafts); None: read them
    host_lists = None
    # whether the drafter proposed for this block (else it is not shown the outcome either)
    proposed = True

    @classmethod
    def last_tokens(cls, batch: Batch, pad: int, proposed: bool = True) -> "Block":
        """The block without drafts, each row's last accepted token (a greedy step), built in a
        few operations: at batch 32 the general constructor's dozen cost 3% of an iteration."""
        rows = batch.tokens.size(0)
        template = batch.plain_blocks.get(rows)
        if template is None:
            # what depends on the number of rows only: built once per row count and batch
            template = batch.plain_blocks[rows] = cls.__new__(cls)
            device = batch.tokens.device
            template.draft = batch.tokens.new_zeros(rows, 0)
            template.draft_len = template.drafted = batch.tokens.new_zeros(rows)
            template.q = None
            template.rows, template.width = rows, 0
            template.ar = torch.arange(rows, device=device)
            template.cols = torch.zeros(1, dtype=torch.long, device=device)
            template.pad = torch.zeros(rows, 1, dtype=torch.bool, device=device)
            template.layout = BlockLayout(template.pad, dense=True)
            template.draft_valid = template.pad[:, 1:]
            template.draft_pos = template.draft
            template.padded_draft = batch.tokens.new_full((rows, 1), pad)
            # what the host decisions read of it: no drafts, one position per row
            template.host_lists = ([[]] * rows, [0] * rows, [[r] for r in range(rows)])
        block = cls.__new__(cls)
        block.__dict__.update(template.__dict__)
        block.tokens = batch.tokens.gather(1, batch.n_out.unsqueeze(1))
        block.proposed = proposed
        return block

    @classmethod
    def from_lists(cls, batch: Batch, drafts: List[List[int]], draft: Tensor, drafted: Tensor,
                   pad: int) -> "Block":
        """The block of an iteration decided on the host (host_decisions.py), built from the
        drafter's lists: what the decoder step and the decisions read, in a few operations
        (the general constructor's dozen cost about as much as a verified position at batch
        1). The tensor path's own fields are made if read (``__getattr__``)."""
        block = cls.__new__(cls)
        block.draft, block.draft_len, block.drafted, block.q = draft, drafted, drafted, None
        block.padded_with = pad
        rows, lengths = len(drafts), [len(d) for d in drafts]
        width = max(lengths)
        block.rows, block.width = rows, width
        last = batch.tokens.numpy()
        n_out = batch.n_out_host.tolist()
        block.tokens = torch.tensor([[int(last[r, n_out[r]])] + d + [pad] * (width - len(d))
                                     for r, d in enumerate(drafts)])
        block.cols = torch.arange(width + 1)
        if min(lengths) == width:
            block.pad = torch.zeros(rows, width + 1, dtype=torch.bool)
            block.layout = BlockLayout(block.pad, dense=True)
            pos = [[j * rows + r for j in range(width + 1)] for r in range(rows)]
        else:  # real positions packed time-major: position j of every row, then j + 1
            pos = [[-1] * (width + 1) for _ in range(rows)]
            index = []
            for j in range(width + 1):
                for r in range(rows):
                    if j <= lengths[r]:
                        pos[r][j] = len(index)
                        index.append(j * rows + r)
            block.pad = torch.tensor([[j > n for j in range(width + 1)] for n in lengths])
            block.layout = BlockLayout.from_host(block.pad, index, pos)
        block.host_lists = (drafts, lengths, pos)
        return block

    def __getattr__(self, name):
        """The tensor path's fields of a block built ``from_lists`` (only read off the host
        path: a test forcing the tensor path, a replay)."""
        if name not in ("ar", "draft_valid", "draft_pos", "padded_draft"):
            raise AttributeError(name)
        device = self.draft.device
        self.ar = torch.arange(self.rows, device=device)
        self.draft_valid = ~self.pad[:, 1:]
        self.draft_pos = self.layout.pos[:, :self.width].clamp(min=0)
        self.padded_draft = torch.cat([self.draft, self.draft.new_full((self.rows, 1),
                                                                         self.padded_with)], dim=1)
        return getattr(self, name)

    def __init__(self, batch: Batch, draft: Tensor, draft_len: Tensor, drafted: Tensor,
                 q: Optional[Tensor], pad: int):
        device = draft.device
        self.draft, self.draft_len = draft, draft_len  # (B, K), (B,)
        self.drafted = drafted  # (B,) the drafter's own draft lengths (backoff reads them)
        self.q = q  # (B, K, V) the drafts' distributions (speculative sampling) or None
        self.rows, self.width = draft.size(0), draft.size(1)
        self.ar = torch.arange(self.rows, device=device)
        self.tokens = torch.cat([batch.tokens[self.ar, batch.n_out].unsqueeze(1), draft], dim=1)
        self.cols = torch.arange(self.width + 1, device=device)
        self.pad = self.cols.unsqueeze(0) > draft_len.unsqueeze(1)  # (B, K + 1)
        self.layout = BlockLayout(self.pad)
        self.draft_valid = ~self.pad[:, 1:]
        self.draft_pos = self.layout.pos[:, :self.width].clamp(min=0)  # packed row of each draft
        self.padded_draft = torch.cat([draft, draft.new_full((self.rows, 1), pad)], dim=1)
