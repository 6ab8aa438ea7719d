"""Input-guided aggressive decoding's drafter (IAD): copy drafts from the source."""

import logging
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_pardec.decoding.draft_verify.drafters.base import (AcceptanceHistory, DraftState,
                                                                Drafter)
from fairseq_pardec.decoding.draft_verify.drafters.schedule import DraftSchedule
from fairseq_pardec.decoding.cuda.static import draft_cap_for_bucket
from fairseq_pardec.decoding.draft_verify.drafters.pricing import (CPU_PRICES, FixedPrices,
                                                                  IterationPrices)

logger = logging.getLogger(__name__)

COPY = "copy"  # the kind of draft: the source after the output's match


class SourceVocabularyMap:
    """Maps source token ids to target ids by their string (for separate dictionaries).

    Tokens with no target counterpart map to -1: copy drafts leave them out.
    """

    def __init__(self, src_dict, tgt_dict):
        self.identity = src_dict is tgt_dict or src_dict.symbols == tgt_dict.symbols
        if self.identity:
            self.table = None
            return
        table = torch.full((len(src_dict),), -1, dtype=torch.long)
        for idx, symbol in enumerate(src_dict.symbols):
            tgt = tgt_dict.index(symbol)
            if tgt != tgt_dict.unk() or symbol == tgt_dict.unk_word:
                table[idx] = tgt
        for special in ("bos", "pad", "eos", "unk"):
            table[getattr(src_dict, special)()] = getattr(tgt_dict, special)()
        self.table = table
        mapped = int((table >= 0).sum())
        logger.info(
            "copy drafter: source and target dictionaries differ; %d of %d source types map to "
            "target types by string", mapped, len(src_dict)
        )

    def __call__(self, src_ids: Tensor) -> Tensor:
        if self.identity:
            return src_ids
        return self.table.to(src_ids.device)[src_ids]


class CopyState(DraftState):
    """One batch's values of a copy drafter (and of the drafters built on it)."""

    def __init__(self):
        super().__init__()
        self.on_cpu = True  # whether the batch decodes on the CPU (the ceiling follows it)
        self.rows = 0
        # per row: its source tokens and their target ids as given (``start``), then, from
        # its first draft on (``source``), [BOS] + its source in target ids and each token's
        # places in it: at batch 32 on the CPU most rows never draft
        self.given = []
        self.sources, self.positions = [], []
        self.bos = self.src_pad = None
        self.last_match = []  # per row: (source index, output length) of its last match
        self.outputs = []  # per row: BOS + the accepted tokens read so far
        # what each row drafts, how much and when (schedule.py): caps, prices, probes, quiet
        # spells and the back-off
        self.schedule = None
        self.drafted_rows = None  # the rows of the last propose that drafted, for observe

    ROW_FIELDS = ("given", "sources", "positions", "last_match", "outputs")

    def absorb(self, other: "CopyState", ids: List[int]):
        super().absorb(other, ids)
        self.rows = len(self.given)

    def source(self, row: int) -> List[int]:
        """[BOS] + the row's source in target ids; its tokens' places are then in
        ``positions[row]``. A source token the target dictionary lacks cannot be drafted: it
        is left out, and copying goes on with the tokens after it."""
        source = self.sources[row]
        if source is None:
            src_pad = self.src_pad
            tokens, ids = self.given[row]
            source = [self.bos] + [t for s, t in zip(tokens, ids) if s != src_pad and t != -1]
            where = {}
            for i, token in enumerate(source):
                where.setdefault(token, []).append(i)
            self.sources[row], self.positions[row] = source, where
        return source


class CopyDrafter(Drafter):
    """Input-guided aggressive decoding (IAD): draft by copying the source.

    Matching rule (Algorithm 1 of Sun et al. 2021, made a little more aggressive): take the
    shortest suffix of the output (BOS included) that occurs exactly once in [BOS] + source, and
    draft the source tokens that follow that occurrence. When every suffix is ambiguous (a
    repeated token such as a comma), the paper falls back to one greedy step; we instead pick the
    occurrence nearest to where the previous match predicts it (previous match position plus the
    tokens output since then: GEC output follows the source left to right). A suffix whose last token does not occur in the source gives no draft
    (one plain greedy step). Any draft is safe: exact verification keeps the output identical to
    greedy decoding; the rule only changes how many tokens are accepted.
    """

    # its state is lists per row on the host (CopyState.absorb)
    joins_rows = True

    # Ceiling of the adaptive caps on the CPU (--block-size not given). There a verified position
    # costs compute once the batch is compute-bound, so the ceiling shrinks with the number of
    # active rows: CPU_POSITIONS block positions per iteration shared by the rows, each row's
    # ceiling within [CPU_MIN_CEILING, CPU_MAX_CEILING] (16 for 1-4 rows, 8 for 8, 6 from 11);
    # chosen by measurement (docs/results.md, "iad draft-cap sweep").
    CPU_POSITIONS = 64
    CPU_MIN_CEILING = 6
    CPU_MAX_CEILING = 16
    # On the CPU (adaptive caps) a draft must pay for its verified positions and its drafting:
    # each row drafts the length that gains the most at the CPU's prices, or nothing
    # (DraftSchedule.plan; pricing.CPU_PRICES). At batch 1 an iteration's fixed cost
    # dominates and long drafts pay; from 8 rows on the products are bound by arithmetic and
    # no position pays, so a full batch decodes as plain steps and the rows left at its end
    # draft. None: the caps follow acceptance only.
    CPU_PRICES = CPU_PRICES
    # On a GPU a longer block costs about as much as one token, so rows may draft what remains
    # of their source, within a budget of block positions per iteration: the verifier holds a
    # (positions, vocabulary) tensor of log-probabilities, which for 64 rows x 200 source
    # positions x a 32k vocabulary would take gigabytes. GPU_POSITIONS are shared by the active rows, each row's
    # ceiling at least GPU_MIN_CEILING (32 for 64 rows; 2048 for one row).
    GPU_POSITIONS = 2048
    GPU_MIN_CEILING = 16

    # whether the schedule may rest (quiet spells: the drafter is not asked while no row would
    # draft); False for a drafter model that drafts from every verification
    rests = True
    State = CopyState  # what ``start`` makes (the drafters built on this one add to it)

    def __init__(self, src_dict, tgt_dict, block_size=None, adaptive=False,
                 prices: IterationPrices = None):
        self.vocab_map = SourceVocabularyMap(src_dict, tgt_dict)
        self.src_pad = src_dict.pad()
        self.pad = tgt_dict.pad()
        self.block_size = block_size
        # per-row caps from each row's recent acceptance (AdaptiveCaps)
        self.adaptive = adaptive
        # with prices (pricing.py; adaptive caps only), each row drafts only what pays for its
        # verification and its drafting, on any device; a fresh row starts from the drafter's
        # acceptance so far. Without, CPU_PRICES decide on the CPU with no --block-size, and
        # elsewhere each row's recent acceptance alone (``_prices``).
        self.prices = prices if adaptive else None
        # a fresh row's estimate starts from the drafter's acceptance over the rows before it
        # (on the CPU): on a model whose drafts are rejected (translation) a new sentence does
        # not open with a long rejected draft, on one that copies it drafts from the start
        self.history = AcceptanceHistory() if adaptive else None
        # the kinds of draft the schedule chooses among for a row (schedule.py)
        self.kinds = [COPY]

    def set_sampler(self, sampler, temperature: float = 1.0):
        super().set_sampler(sampler, temperature)
        if self.prices is not None and self.prices.measured:
            # speculative sampling's draws depend on what was drafted: with prices that follow
            # the timing, one --seed would give other samples on another run
            self.prices = FixedPrices()

    def start(self, sample, encoder_out, bos: int,
              schedule: Optional[DraftSchedule] = None) -> CopyState:
        src = sample["net_input"]["src_tokens"]
        state = self.State()
        state.on_cpu = src.device.type == "cpu"
        rows = state.rows = src.size(0)
        given = src.tolist()
        mapped = given if self.vocab_map.identity else self.vocab_map(src).tolist()
        state.given = list(zip(given, mapped))
        state.sources, state.positions = [None] * rows, [None] * rows
        state.bos, state.src_pad = bos, self.src_pad
        state.last_match = [(0, 0)] * rows
        # BOS + the accepted tokens seen so far, per row: accepted tokens never change, so each
        # iteration reads only the new ones from the engine's buffer
        state.outputs = [[bos] for _ in range(rows)]
        # the schedule lives on the host whatever the device: the engine gives this drafter
        # its host tables, and what it drafts is decided there
        state.schedule = schedule if schedule is not None else DraftSchedule(rows)
        self._plan_drafts(state.schedule, state)
        # a batch whose fresh rows would all draft nothing at these prices (the drafter's
        # acceptance so far does not pay) starts quiet, until their first probe: on a model
        # whose drafts are rejected a sentence is not asked for drafts at its first token
        if self.rests:
            state.schedule.quiet_at_start(self._ceiling(state, rows))
        return state

    def _plan_drafts(self, schedule: DraftSchedule, state: CopyState):
        """Have the batch's schedule plan this drafter's kinds of draft."""
        schedule.plan_drafts(self.kinds, {kind: self.history for kind in self.kinds},
                             self.history, self._prices(state), self.adaptive)

    def _prices(self, state: CopyState) -> Optional[IterationPrices]:
        """The prices this batch's drafts must pay: the given ones, else on the CPU with no
        --block-size the CPU's; None (adaptive caps: each row's recent acceptance alone)."""
        if not self.adaptive:
            return None
        if self.prices is not None:
            return self.prices
        if state.on_cpu and self.block_size is None:
            return self.CPU_PRICES
        return None

    def _match(self, state: CopyState, row: int, output: List[int]):
        """Index in the source of the match of the output's last token, or None."""
        source = state.source(row)
        candidates = state.positions[row].get(output[-1])
        if not candidates:
            return None
        q = 0
        while len(candidates) > 1 and q + 1 < len(output):
            q += 1
            longer = [i for i in candidates if i >= q and source[i - q] == output[-1 - q]]
            if not longer:
                break
            candidates = longer
        if len(candidates) > 1:
            at, n_then = state.last_match[row]
            expected = at + len(output) - 1 - n_then
            return min(candidates, key=lambda i: (abs(i - expected), i))
        return candidates[0]

    def _ceiling(self, state: CopyState, active_rows: int):
        """The cap every row drafts under this iteration."""
        if self.block_size is not None:
            return self.block_size
        if not state.on_cpu:
            # a block of 2^k - 1 drafts and the row's last token fills its bucket of the CUDA
            # step's graphs: 16 drafts would run a block of 17 on 32 columns
            return draft_cap_for_bucket(
                max(self.GPU_MIN_CEILING, self.GPU_POSITIONS // max(1, active_rows)))
        share = self.CPU_POSITIONS // max(1, active_rows)
        return max(self.CPU_MIN_CEILING, min(self.CPU_MAX_CEILING, share))

    @staticmethod
    def _read_new_tokens(state: CopyState, row_ids: List[int], tokens: Tensor,
                         n_out: List[int]):
        """Append each row's tokens accepted since the last call, from the engine's table on
        the host (a view of its buffer: each row's new tokens are one slice)."""
        table = tokens.numpy()
        for i, (row, n) in enumerate(zip(row_ids, n_out)):
            known = len(state.outputs[row])
            if n + 1 > known:
                state.outputs[row].extend(table[i, known: n + 1].tolist())

    def _read_drafting_rows(self, state: CopyState, row_ids: List[int], tokens: Tensor,
                            lengths: List[int], caps: List[int]):
        """Bring the outputs of the rows that may draft now up to date (a row's tokens are
        read when it next drafts: at batch 32 on the CPU most rows draft nothing)."""
        drafting = [i for i, cap in enumerate(caps) if cap > 0]
        if len(drafting) == len(row_ids):
            self._read_new_tokens(state, row_ids, tokens, lengths)
        elif drafting:
            self._read_new_tokens(state, [row_ids[i] for i in drafting], tokens[drafting],
                                  [lengths[i] for i in drafting])

    def propose(self, state, view):
        rows, tokens, n_out, room = view.rows, view.tokens, view.n_out, view.room
        schedule = state.schedule
        began = schedule.start_clock()
        ceiling = self._ceiling(state, len(rows))
        limits = [min(limit, ceiling) for limit in room]
        plans = schedule.plan(rows, limits, may_rest=self.rests)
        if plans is None:  # no row drafts: nothing for ``observe`` either
            schedule.count_none(len(rows))
            schedule.tick(began, len(rows), [])
            state.drafted_rows = None
            return [[]] * len(rows)
        self._read_drafting_rows(state, rows, tokens, n_out, [len(p) for p in plans])
        drafts, kinds = self._first_drafts(state, rows, n_out, plans)
        schedule.chose(rows, kinds, drafts)
        schedule.tick(began, len(rows), drafts)
        state.drafted_rows = rows  # observe's rows are these (tests pass none)
        return drafts

    def _first_drafts(self, state: CopyState, row_ids: List[int], lengths: List[int],
                      plans: List[List[tuple]], made: Optional[dict] = None):
        """Per row the draft of the first of its planned options that drafts anything, and
        that option's kind (None: no draft). ``made``: kind -> {row's position: draft} of the
        drafts made elsewhere (a drafter model's); the others are the cheap drafters'."""
        drafts, kinds = [], []
        for i, (row, n, options) in enumerate(zip(row_ids, lengths, plans)):
            draft, chosen = [], None
            for _, kind, length in options:
                elsewhere = made.get(kind) if made else None
                if elsewhere is not None:
                    draft = elsewhere.get(i, [])
                else:
                    draft = self.cheap_draft(state, kind, row, n, length)
                if draft:
                    chosen = kind
                    break
            drafts.append(draft)
            kinds.append(chosen)
        return drafts, kinds

    def cheap_draft(self, state: CopyState, kind: str, row: int, n: int,
                    length: int) -> List[int]:
        """Up to ``length`` tokens of the model-free drafter ``kind`` for ``row`` after its
        output so far (``n`` tokens; a copy match moves the row's expected place in the
        source); benchmark/draft_ceiling.py scores them on greedy outputs."""
        at = self._match(state, row, state.outputs[row])
        if at is None:
            return []
        state.last_match[row] = (at, n)
        return state.sources[row][at + 1: at + 1 + length]

    def _learn(self, state: CopyState, kept: List[int]):
        """What each row of the last propose kept of its draft, for the schedule."""
        if self.adaptive and state.drafted_rows is not None:
            state.schedule.verified(state.drafted_rows, kept)
        state.drafted_rows = None

    def observe(self, state, outcome):
        self._learn(state, outcome.accepted)
