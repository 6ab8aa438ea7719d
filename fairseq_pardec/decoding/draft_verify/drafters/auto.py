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

from typing import Optional

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import AcceptanceHistory
from fairseq_pardec.decoding.draft_verify.drafters.lookup import (LOOKUP, NGRAM, LookupDrafter,
                                                                  LookupState, NgramTable)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import IterationPrices, MeasuredPrices
from fairseq_pardec.decoding.draft_verify.drafters.schedule import NONE, DraftSchedule
from fairseq_pardec.decoding.draft_verify.drafters.source_copy import COPY

__all__ = ["AutoDrafter", "AutoState", "COPY", "LOOKUP", "NGRAM", "NONE"]


class AutoState(LookupState):
    """One batch's values of ``auto``: a lookup drafter's, and the drafter model's own state."""

    def __init__(self):
        super().__init__()
        self.model = None  # the drafter model's DraftState


class AutoDrafter(LookupDrafter):
    """Chooses, per row and iteration, among copy, lookup, n-gram and an optional drafter model
    (see the module's text); the batch's schedule (schedule.py) plans the choice."""

    State = AutoState

    def __init__(self, src_dict, tgt_dict, table: Optional[NgramTable] = None,
                 prices: IterationPrices = None, model=None, model_kind: Optional[str] = None):
        super().__init__(src_dict, tgt_dict, table, block_size=None, adaptive=True,
                         prices=prices if prices is not None else MeasuredPrices())
        # model: a CachedNARDrafter / NARDrafter ("gad", drafts in propose) or a HeadsDrafter
        # ("blockwise", proposes after each verification, from the verifier's features)
        self.model, self.model_kind = model, model_kind if model is not None else None
        # the table is a kind of its own here, not the local match's fallback
        self.table_fallback = False
        self.cheap = [COPY, LOOKUP] + ([NGRAM] if table is not None else [])
        self.kinds = self.cheap + ([self.model_kind] if model is not None else [])
        self.histories = {kind: AcceptanceHistory() for kind in self.kinds}
        # the rows' probes, across batches: a fresh row's first wait (AcceptanceHistory.probed)
        self.probe_history = AcceptanceHistory()
        self.heads = model is not None and model_kind == "blockwise"
        # a drafter model drafts from every verification: the schedule never rests then
        self.rests = model is None
        self.stats = None  # the generator's DecodeStats (drafters' shares), set by the builder
        # a drafter model's state lives on the device: no rows join it (Drafter.joins_rows)
        self.joins_rows = model is None

    def set_sampler(self, sampler, temperature: float = 1.0):
        super().set_sampler(sampler, temperature)
        if self.model is not None:
            self.model.set_sampler(sampler, temperature)

    def _plan_drafts(self, schedule: DraftSchedule, state: AutoState):
        # a row's probes try its most accepted cheap drafter, whichever: one schedule per row
        schedule.plan_drafts(self.kinds, self.histories, self.probe_history, self.prices, True,
                             probed_kinds=self.cheap, stats=self.stats)

    def start(self, sample, encoder_out, bos: int, schedule=None) -> AutoState:
        state = super().start(sample, encoder_out, bos, schedule)
        if self.model is not None:
            state.model = self.model.start(sample, encoder_out, bos)
        return state

    # ------------------------------------------------------------------ choosing
    def propose(self, state, view):
        if self.model is None:  # the cheap drafters alone: the copy drafter's way
            return super().propose(state, view)
        rows, tokens, n_out, room = view.rows, view.tokens, view.n_out, view.room
        schedule = state.schedule
        began = schedule.start_clock()
        active = len(rows)
        ceiling = self._ceiling(state, active)
        limits = [min(limit, ceiling) for limit in room]
        # heads proposed after the last verification (their price is paid); gad's run is not
        plans = schedule.plan(rows, limits, may_rest=False)
        model_rows = self._model_rows(plans, active)
        self._read_drafting_rows(state, rows, tokens, n_out, [len(p) for p in plans])
        model_drafts, model_q = None, None
        if model_rows:
            model_drafts, model_q = self._model_drafts(state, view, plans, model_rows)
        drafts, chosen = self._first_drafts(state, rows, n_out, plans,
                                            {self.model_kind: model_drafts or {}})
        schedule.chose(rows, chosen, drafts)
        state.draft_probs = None
        if model_q is not None:
            state.draft_probs = self._mixed_q(drafts, chosen, model_q, model_q.device)
        schedule.tick(began, active, drafts, model=bool(model_rows) and not self.heads)
        state.drafted_rows = rows
        return drafts

    def _model_rows(self, plans, active: int) -> set:
        """Rows that take the drafter model's draft: where it is their best option and, for
        gad, only when those rows gain more together than the model's run costs."""
        kind = self.model_kind
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

    def _model_drafts(self, state: AutoState, view, plans, model_rows):
        """The drafter model's drafts of ``model_rows`` (by position among the active rows),
        each cut at its paying length, and their q under speculative sampling."""
        caps = [0] * len(view.rows)
        for i in model_rows:
            caps[i] = next(length for _, kind, length in plans[i] if kind == self.model_kind)
        # the heads' proposals were made after the last verification; gad drafts now, on the
        # model's device, from the view's copies
        draft = self.model.draft(state.model, view, caps)
        drafts = {i: draft[i] for i in model_rows}
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

    # ------------------------------------------------------------------ after verification
    def observe(self, state, outcome):
        self._learn(state, outcome.accepted)
        if self.heads:
            self._heads_propose(state, outcome)

    def _heads_propose(self, state: AutoState, outcome):
        """Run the proposal heads for the rows whose heads' draft would pay next iteration
        (by their estimates now), the others get none."""
        heads, schedule = self.model, state.schedule
        heads_state = state.model
        heads_state.next_len = [0] * len(heads_state.next_len)
        active = len(outcome.rows)
        value, position, drafting_row = self.prices.prices(active)
        ceiling = min(self._ceiling(state, active), heads.width)
        chosen, caps = [], []
        for i, row in enumerate(outcome.rows):
            options = schedule.options(row, ceiling, value, position, drafting_row, self.kinds)
            if options and options[0][1] == self.model_kind:
                chosen.append(i)
                caps.append(options[0][2])
        if not chosen:
            return
        # the heads run on the model's device: what they read is gathered there
        at = outcome.on_device(chosen)
        features = outcome.features().index_select(0, at)
        tokens = None
        if heads.decoder.proposals_read_tokens:
            tokens = outcome.newest().index_select(0, at)
        heads.propose_next(heads_state, outcome, features, tokens, caps, at=chosen)
        if schedule.clock is not None:
            schedule.clock.model_ran()
