"""``--generator auto``: per row and per iteration, the draft that pays the most, or none.

The drafters that need no model of their own are always at hand: copying the source (iad's
match), lookup in the source and the output itself, and the n-gram table of ``--draft-corpus``.
Where the verifier has proposal heads (blockwise) or ``--drafter-path`` names a GAD drafter, that
drafter joins them. Each row keeps, per drafter, an estimate of its per-position acceptance rate
(AdaptiveCaps: accepted draft tokens against first rejections, recent drafts weighing more; a
fresh row starts from the drafter's rate over the rows before it). Each iteration the prices of
pricing.py (measured from the engine's own iterations) say what a token is worth at this many
active rows, what a verified position and a drafting row cost; each row then drafts with the
drafter whose paying draft gains the most (pricing.paying_length, draft_gain), falling back to
the next where it has nothing to propose, or drafts nothing. A drafter model runs only when the
rows that would take its draft gain more, together, than what its run costs. A row that drafts
nothing probes with one token of its most accepted cheap drafter after 8, 16, 32, then every 64
such iterations, so that its estimates can recover.

Verification is exact: the output is greedy decoding's whatever is drafted. With ``--sampling``
the cheap drafts are one-hot (q = 1 at the drafted token) and a drafter model's rows carry its
own q, so speculative sampling keeps fairseq's distribution; the prices are then fixed, so that a
``--seed`` gives the same samples whatever the timing.
"""

import math
from typing import Dict, List, Optional

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import (AcceptanceHistory, AdaptiveCaps,
                                                                ProbeSchedule, QuietSpell)
from fairseq_pardec.decoding.draft_verify.drafters.lookup import (LookupDrafter, LookupState,
                                                                  NgramTable)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import (IterationPrices,
                                                                  MeasuredPrices, draft_gain,
                                                                  paying_length)

COPY, LOOKUP, NGRAM = "copy", "lookup", "ngram"
NONE = "none"  # a row-iteration without a draft (statistics)


class AutoState(LookupState):
    """One batch's values of ``auto``: a lookup drafter's, and per drafter kind its rows'
    estimates, per row the last choice and its probes, and the drafter model's own state."""

    def __init__(self):
        super().__init__()
        self.kind_caps = {}  # kind -> the rows' AdaptiveCaps for that drafter
        self.chosen = []  # per batch row: (kind, draft length) of the last propose, or None
        self.row_probes = None  # the rows' ProbeSchedule, whichever drafter they probe
        self.model = None  # the drafter model's DraftState
        self.model_device = None


class AutoDrafter(LookupDrafter):
    """Chooses, per row and iteration, among copy, lookup, n-gram and an optional drafter model
    (see the module's text)."""

    State = AutoState
    # most iterations a quiet spell lasts under measured prices (they must go on measuring)
    LONGEST_MEASURED_QUIET = 64

    def __init__(self, src_dict, tgt_dict, table: Optional[NgramTable] = None,
                 prices: IterationPrices = None, model=None, model_kind: Optional[str] = None):
        super().__init__(src_dict, tgt_dict, table, block_size=None, adaptive=True,
                         prices=prices if prices is not None else MeasuredPrices())
        # model: a CachedNARDrafter / NARDrafter ("gad", drafts in propose) or a HeadsDrafter
        # ("blockwise", proposes after each verification, from the verifier's features)
        self.model, self.model_kind = model, model_kind if model is not None else None
        self.cheap = [COPY, LOOKUP] + ([NGRAM] if table is not None else [])
        self.kinds = self.cheap + ([self.model_kind] if model is not None else [])
        self.histories = {kind: AcceptanceHistory() for kind in self.kinds}
        # the rows' probes, across batches: a fresh row's first wait (AcceptanceHistory.probed)
        self.probe_history = AcceptanceHistory()
        self.heads = model is not None and model_kind == "blockwise"
        self.observes_features = self.heads
        self.stats = None  # the generator's DecodeStats (drafters' shares), set by the builder

    def set_sampler(self, sampler, temperature: float = 1.0):
        super().set_sampler(sampler, temperature)
        if self.model is not None:
            self.model.set_sampler(sampler, temperature)

    def start(self, sample, encoder_out, bos: int) -> AutoState:
        state = super().start(sample, encoder_out, bos)
        rows = state.rows
        state.kind_caps = {kind: AdaptiveCaps(rows, float("inf"), "cpu", self.histories[kind])
                          for kind in self.kinds}
        state.chosen = [None] * rows  # per batch row: (kind, draft length) of the last propose
        # a row's probes try its most accepted cheap drafter, whichever: one schedule per row
        state.row_probes = ProbeSchedule(rows, self.probe_history)
        state.quiet = self._quiet_at_start(state, rows)
        if self.model is not None:
            state.model_device = sample["net_input"]["src_tokens"].device
            state.model = self.model.start(sample, encoder_out, bos)
        return state

    def _quiet_at_start(self, state: AutoState, rows: int):
        """A batch whose fresh rows would all draft nothing (no drafter's acceptance so far
        pays) starts quiet, until their first probe (see ``_quiet_after``)."""
        if self.model is not None or rows == 0:
            return None
        value, position, drafting_row = self.prices.prices(rows)
        if value > position and self._options(state, 0, self._ceiling(state, rows), value,
                                              position, drafting_row, self.cheap):
            return None
        if value <= position:  # while at least as many rows are left as pay nothing
            spell, fewest = math.inf, self.prices.nothing_pays_from(rows)
        else:
            spell, fewest = state.row_probes.wait[0], rows
        if self.prices.measured:
            spell = min(spell, self.LONGEST_MEASURED_QUIET)
        return QuietSpell(rows, spell, fewest)

    # ------------------------------------------------------------------ choosing
    def _options(self, state: AutoState, row: int, limit: int, value: float, position: float,
                 drafting_row: float, kinds) -> List[tuple]:
        """(gain, kind, length) of each drafter whose draft pays for this row, best first."""
        options = []
        for kind in kinds:
            caps = state.kind_caps[kind]
            rate = caps.acceptance_rate(row)
            if rate * value <= position:  # not even a first token pays (most rows, at batch 32)
                continue
            cap = min(limit, int(min(2 * caps.mean[row], caps.CEILING)) + 1)
            length = paying_length(rate, value, position, drafting_row, cap)
            if length > 0:
                options.append((draft_gain(rate, value, position, length) - drafting_row,
                                kind, length))
        options.sort(key=lambda option: -option[0])
        return options

    def _probe(self, state: AutoState, row: int) -> List[tuple]:
        """After its wait, a row that drafts nothing tries one token of its cheap drafters,
        the most accepted first; the next probe waits twice as long."""
        if not state.row_probes.probes_now(row):
            return []
        rates = [(state.kind_caps[kind].acceptance_rate(row), kind) for kind in self.cheap]
        rates.sort(key=lambda rate: -rate[0])
        return [(0.0, kind, 1) for _, kind in rates]

    def cheap_draft(self, state: AutoState, kind: str, row: int, n: int,
                    length: int) -> List[int]:
        """Up to ``length`` tokens of the model-free drafter ``kind`` for ``row`` after its
        output so far (``n`` tokens; a copy match moves the row's expected place in the
        source); benchmark/draft_ceiling.py scores them on greedy outputs."""
        output = state.outputs[row]
        if kind == COPY:
            at = self._match(state, row, output)
            if at is None:
                return []
            state.last_match[row] = (at, n)
            return state.sources[row][at + 1: at + 1 + length]
        if kind == LOOKUP:
            return self._local(state, row, length)
        return self.table.continuation(output, length)

    # ------------------------------------------------------------------ quiet spells
    # (a drafter model proposes from each verification: with one, no spell is ever set)
    def _not_asked(self, state: AutoState, active_rows: int):
        if self.prices.measured:
            state.clock.open = None  # its time would span the iterations not asked
        self._count_none(active_rows)

    def _catch_up(self, state: AutoState):
        """The iterations that passed without ``propose`` count towards the rows' probes."""
        if state.skipped:
            state.row_probes.skip(state.skipped)
            state.skipped = 0

    def _quiet_after(self, state: AutoState, row_ids, limits, active: int, nothing_pays: bool):
        """After an iteration in which no row drafted or probed: for how many iterations none
        will (until a row's probe, or for good where not even a certain token pays)."""
        if nothing_pays:  # while at least as many rows are left as pay nothing
            spell, fewest = math.inf, self.prices.nothing_pays_from(active)
        else:
            spell, fewest = state.row_probes.quiet_for(row_ids, limits), active
        if self.prices.measured:
            spell = min(spell, self.LONGEST_MEASURED_QUIET)
        state.quiet = QuietSpell(active, spell, fewest) if spell > 0 else None

    def propose(self, state, rows, tokens, n_out, max_len):
        began = state.clock.now()
        self._catch_up(state)
        row_ids = rows.tolist()
        active = len(row_ids)
        value, position, drafting_row = self.prices.prices(active)
        if value <= position and self.model is None:
            # not even a certain token pays at this many rows (the CPU's prices from 8 rows):
            # no row drafts or probes, and the drafter stays quiet while the rows stay
            self._quiet_after(state, row_ids, (), active, nothing_pays=True)
            return self._nothing(state, rows, began)
        lengths = n_out.tolist()
        ceiling = self._ceiling(state, active)
        limits = [min(room, ceiling) for room in max_len.tolist()]
        # heads proposed after the last verification (their price is paid); gad's run is not
        model_kinds = [self.model_kind] if self.model is not None else []
        plans = []
        for row, limit in zip(row_ids, limits):
            options = self._options(state, row, limit, value, position, drafting_row,
                                    self.cheap + model_kinds) if limit > 0 else []
            if options:
                state.row_probes.drafted(row)
            elif limit > 0:
                options = self._probe(state, row)
            plans.append(options)
        if not any(plans) and self.model is None:
            self._quiet_after(state, row_ids, limits, active, nothing_pays=False)
            return self._nothing(state, rows, began)
        model_rows = self._model_rows(plans, active)
        self._read_drafting_rows(state, row_ids, tokens, lengths, [len(p) for p in plans])

        model_drafts, model_q = None, None
        if model_rows:
            model_drafts, model_q = self._model_drafts(state, rows, tokens, n_out, plans,
                                                        model_rows)
        drafts, chosen = [], []
        for i, (row, n, options) in enumerate(zip(row_ids, lengths, plans)):
            draft, kind = [], None
            for _, option, length in options:
                if option == self.model_kind:
                    draft = model_drafts[i] if i in model_rows else []
                else:
                    draft = self.cheap_draft(state, option, row, n, length)
                if draft:
                    kind = option
                    break
            drafts.append(draft)
            chosen.append(kind)
            state.chosen[row] = (kind, len(draft)) if kind is not None else None
        self._count(chosen)
        state.draft_probs = None
        if model_q is not None:
            state.draft_probs = self._mixed_q(drafts, chosen, model_q, model_q.device)
        if began is not None:
            state.clock.tick(began, active, sum(len(d) for d in drafts),
                            sum(1 for d in drafts if d), model=bool(model_rows) and not self.heads)
        return self._drafts_out(state, rows, drafts, tokens.device, None)

    def _model_rows(self, plans, active: int) -> set:
        """Rows that take the drafter model's draft: where it is their best option and, for
        gad, only when those rows gain more together than the model's run costs."""
        kind = self.model_kind
        if kind is None:
            return set()
        rows, extra = set(), 0.0
        for i, options in enumerate(plans):
            if options and options[0][1] == kind:
                rows.add(i)
                runner_up = next((gain for gain, other, _ in options[1:]), 0.0)
                extra += options[0][0] - max(runner_up, 0.0)
        if self.heads or not rows:
            return rows
        if extra > self.prices.model_price(active):
            return rows
        for i in rows:  # not worth a run: their next best
            plans[i] = [option for option in plans[i] if option[1] != kind]
        return set()

    def _model_drafts(self, state: AutoState, rows, tokens, n_out, plans, model_rows):
        """The drafter model's drafts of ``model_rows`` (by position among the active rows),
        each cut at its paying length, and their q under speculative sampling."""
        caps = [0] * rows.numel()
        for i in model_rows:
            caps[i] = next(length for _, kind, length in plans[i] if kind == self.model_kind)
        # the drafter model drafts on the model's device, from copies of the host's tables
        device = state.model_device
        caps = torch.tensor(caps, dtype=torch.long).to(device, non_blocking=True)
        draft, lengths = self.model.propose(state.model, rows.clone().to(device, non_blocking=True),
                                            tokens.clone().to(device, non_blocking=True),
                                            n_out.clone().to(device, non_blocking=True), caps)
        draft, lengths = draft.tolist(), lengths.tolist()  # the drafter model's read
        drafts = {i: draft[i][: lengths[i]] for i in model_rows}
        return drafts, state.model.draft_probs if self.sampler is not None else None

    def _mixed_q(self, drafts, chosen, model_q, device):
        """(B, K, V) q of every row's draft: one-hot for the deterministic drafts (and
        padding), the drafter model's own distribution for its rows."""
        width = max((len(d) for d in drafts), default=0)
        padded = torch.tensor([d + [self.pad] * (width - len(d)) for d in drafts],
                              dtype=torch.long, device=device).view(len(drafts), width)
        q = torch.zeros(len(drafts), width, model_q.size(-1), dtype=model_q.dtype, device=device)
        q.scatter_(2, padded.unsqueeze(-1), 1.0)
        for i, kind in enumerate(chosen):
            if kind == self.model_kind and drafts[i]:
                q[i, : len(drafts[i])] = model_q[i, : len(drafts[i])]
        return q

    def _nothing(self, state: AutoState, rows, began):
        """No row drafts in this iteration: empty drafts, and nothing for ``observe``."""
        active = rows.numel()
        self._count_none(active)
        if began is not None:
            state.clock.tick(began, active, 0, 0)
        state.drafted = None
        lengths = torch.zeros(active, dtype=torch.long, device=rows.device)
        return lengths.new_zeros(active, 0), lengths

    def _count_none(self, active: int):
        if self.stats is not None:
            counts = self.stats.drafter_iterations
            counts[NONE] = counts.get(NONE, 0) + active

    def _count(self, chosen):
        stats = self.stats
        if stats is None:
            return
        counts = stats.drafter_iterations
        for kind in chosen:
            name = kind or NONE
            counts[name] = counts.get(name, 0) + 1

    # ------------------------------------------------------------------ after verification
    def observe(self, state, rows, features, last, tokens=None):
        drafted = state.drafted
        state.drafted = None
        if drafted is not None:
            drafted_rows = drafted[0].tolist()
            accepted = last.tolist()
            by_kind: Dict[str, tuple] = {}
            stats = self.stats
            for row, kept in zip(drafted_rows, accepted):
                choice = state.chosen[row]
                if choice is None:
                    continue
                kind, length = choice
                group = by_kind.setdefault(kind, ([], [], []))
                group[0].append(row)
                group[1].append(length)
                group[2].append(kept)
                state.row_probes.verified(row, kept)
                if stats is not None:
                    stats.drafter_accepted[kind] = (stats.drafter_accepted.get(kind, 0)
                                                    + min(kept, length))
            for kind, (kind_rows, lengths, kept) in by_kind.items():
                state.kind_caps[kind].host_update(kind_rows, lengths, kept)
        if self.model is None:
            return
        if self.heads:
            self._heads_propose(state, rows, features, last, tokens)
        else:  # gad's own caps follow what its drafts kept (a no-op where it did not run);
            # they live on the model's device, and the engine gives auto the host's rows
            device = state.model_device
            self.model.observe(state.model, rows.to(device, non_blocking=True), features,
                               last.to(device, non_blocking=True), tokens)

    def _heads_propose(self, state: AutoState, rows, features, last, tokens):
        """Run the proposal heads for the rows whose heads' draft would pay next iteration
        (by their estimates now), the others get none."""
        heads = self.model
        heads_state = state.model
        heads_state.next_len.zero_()
        row_ids = rows.tolist()
        active = len(row_ids)
        value, position, drafting_row = self.prices.prices(active)
        ceiling = min(self._ceiling(state, active), heads.width)
        chosen, caps = [], []
        for i, row in enumerate(row_ids):
            options = self._options(state, row, ceiling, value, position, drafting_row,
                                    self.kinds)
            if options and options[0][1] == self.model_kind:
                chosen.append(i)
                caps.append(options[0][2])
        if not chosen:
            return
        # the heads run on the model's device: what they read is copied there
        device = features.device
        at = torch.tensor(chosen, dtype=torch.long)
        on_device = at.to(device, non_blocking=True)
        heads.observe(heads_state, rows[at].to(device, non_blocking=True), features[on_device],
                      last[at].to(device, non_blocking=True),
                      None if tokens is None else tokens[on_device],
                      caps=torch.tensor(caps, dtype=torch.long).to(device, non_blocking=True))
        state.clock.model_ran()
