"""One batch's drafting schedule: which rows draft in an iteration, with which drafter and how
many tokens, and in which iterations the drafter need not be asked at all.

It is the one owner of what decides that: per drafter kind the rows' acceptance estimates and
caps (AdaptiveCaps), the prices a draft must pay (pricing.py) and the clock that measures them,
the probes of rows that draft nothing (ProbeSchedule), the quiet spells in which no row will
draft (QuietSpell), and the per-row back-off of rejected drafts (backoff.py). The engine makes
one per batch and asks it before every iteration (``drafts_now``, ``room``) and tells it each
verification's outcome (``backed_off``); the drafters have it plan their rows' drafts
(``plan``) and tell it what each row kept (``verified``), the drafter models (gad's, blockwise's
heads) as the drafters on the host: the host knows what each row kept, so their caps need no
read of the device either. A drafter that never drafts says so (``never_drafts``): the engine
then never asks it.
"""

import math
from typing import Dict, List, Optional

from torch import Tensor

from fairseq_pardec.decoding.draft_verify.backoff import DraftBackoff
from fairseq_pardec.decoding.draft_verify.drafters.base import (AcceptanceHistory, AdaptiveCaps,
                                                                ProbeSchedule, QuietSpell,
                                                                place_rows)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import (IterationClock,
                                                                  IterationPrices, draft_gain,
                                                                  paying_length)

NONE = "none"  # a row-iteration without a draft (statistics)


class DraftSchedule:
    """The drafting schedule of one batch of ``rows`` rows (see the module's text).

    Without ``plan_drafts`` it holds the back-off alone (``backoff``: the engine's option): the
    drafter drafts what the room allows. ``plan_drafts`` gives it the drafter kinds it chooses
    among and how: at ``prices`` (per row the kind whose paying draft gains the most, probes
    after waits, quiet spells), by each row's recent acceptance alone (``adaptive``, no prices),
    or up to the room (neither).
    """

    # most iterations a quiet spell lasts under measured prices (they must go on measuring)
    LONGEST_MEASURED_QUIET = 64

    def __init__(self, rows: int, backoff: bool = False):
        self.rows = rows
        self.backoff = DraftBackoff(rows) if backoff else None
        self.kinds: List[str] = []  # the kinds it plans for ([]: the drafter plans itself)
        self.probed_kinds: List[str] = []  # the kinds a probe tries (the cheap ones)
        self.caps: Dict[str, AdaptiveCaps] = {}
        self.probes: Optional[ProbeSchedule] = None
        self.prices: Optional[IterationPrices] = None
        self.clock: Optional[IterationClock] = None
        self.adaptive = False
        self.quiet: Optional[QuietSpell] = None
        self.skipped = 0  # iterations not asked since the last plan (the probes' count)
        # whether the drafter may be left unasked while every row waits in the back-off (a
        # drafter model that drafts from each verification must see every one)
        self.skips_while_waiting = False
        self.stats = None  # the generator's DecodeStats (auto's drafters' shares)
        self.chosen: List[Optional[tuple]] = []  # per batch row: (kind, length) last drafted
        self.silent = False  # the drafter never drafts (never_drafts)

    def plan_drafts(self, kinds: List[str], histories: Dict[str, AcceptanceHistory],
                    probe_history: Optional[AcceptanceHistory], prices: Optional[IterationPrices],
                    adaptive: bool, probed_kinds: Optional[List[str]] = None, stats=None,
                    sees_every_verification: bool = False):
        """The drafter that this schedule plans for: its ``kinds``, each row's estimate of each
        starting from that kind's ``histories`` (across batches), the probes' waits from
        ``probe_history``. ``sees_every_verification``: the drafter must be asked in every
        iteration (blockwise decoding's heads propose from each verification), never left
        unasked while its rows wait in the back-off."""
        self.kinds = list(kinds)
        self.probed_kinds = list(kinds if probed_kinds is None else probed_kinds)
        self.adaptive = adaptive
        self.caps = {kind: AdaptiveCaps(self.rows, float("inf"), histories.get(kind))
                     for kind in kinds}
        self.probes = ProbeSchedule(self.rows, probe_history)
        self.prices = prices if adaptive else None
        if self.prices is not None and self.prices.measured:
            self.clock = IterationClock(self.prices)
        self.skips_while_waiting = not sees_every_verification
        self.stats = stats
        self.chosen = [None] * self.rows

    def never_drafts(self):
        """The drafter drafts nothing, ever (``lean_greedy``): it is never asked, and nothing
        is withheld from it."""
        self.silent = True
        self.backoff = None

    # ------------------------------------------------------------------ before an iteration
    def drafts_now(self, active_rows: int, iteration: int) -> bool:
        """False where surely no row drafts in this iteration: a drafter that never drafts, a
        quiet spell, or (for a drafter that may be left unasked) every row waiting in the
        back-off. The engine then takes a plain step without asking the drafter: it costs what
        a greedy step costs."""
        if self.silent:
            return False
        spell = self.quiet
        if spell is not None:
            if spell.step(active_rows):  # rows that finish change the prices: the spell ends
                self._not_asked(active_rows)
                return False
            self.quiet = None
            self.skipped += spell.skipped
        if (self.skips_while_waiting and self.backoff is not None
                and self.backoff.waiting(iteration)):
            self.skipped += 1
            self._not_asked(active_rows)
            return False
        return True

    def room(self, room: List[int], iteration: int) -> List[int]:
        """Each active row's room for draft tokens less what the back-off withholds."""
        return room if self.backoff is None else self.backoff.room(room, iteration)

    def _not_asked(self, active_rows: int):
        if self.clock is not None:
            self.clock.open = None  # its time would span the iterations not asked
        self.count_none(active_rows)

    # ------------------------------------------------------------------ planning
    def start_clock(self) -> Optional[float]:
        """When the drafter began to plan this iteration (measured prices; else None)."""
        return self.clock.now() if self.clock is not None else None

    def tick(self, began: Optional[float], active: int, drafts: List[List[int]],
             model: bool = False):
        """The iteration that began at ``began`` drafted ``drafts`` (measured prices)."""
        if began is not None:
            self.clock.tick(began, active, sum(len(d) for d in drafts),
                            sum(1 for d in drafts if d), model=model)

    def quiet_at_start(self, ceiling: int):
        """A batch whose fresh rows would all draft nothing (no kind's acceptance so far pays)
        starts quiet, until their first probe."""
        rows = self.rows
        if self.prices is None or rows == 0:
            return
        value, position, drafting_row = self.prices.prices(rows)
        if value > position and self.options(0, ceiling, value, position, drafting_row,
                                             self.probed_kinds):
            return
        if value <= position:  # while at least as many rows are left as pay nothing
            spell, fewest = math.inf, self.prices.nothing_pays_from(rows)
        else:
            spell, fewest = self.probes.wait[0], rows
        if self.prices.measured:
            spell = min(spell, self.LONGEST_MEASURED_QUIET)
        self.quiet = QuietSpell(rows, spell, fewest)

    def plan(self, row_ids: List[int], limits: List[int], kinds: Optional[List[str]] = None,
             may_rest: bool = True) -> Optional[List[List[tuple]]]:
        """Per active row the drafts it may take, best first, as (gain, kind, length): at the
        prices, each of ``kinds`` (default: the schedule's) whose draft pays within the row's
        ``limits``, or a probe of one token after its wait; without prices, one draft of each
        kind up to the row's cap. None where no row drafts: the schedule then rests for as
        long as that surely lasts (``may_rest``: a quiet spell)."""
        self._catch_up()
        kinds = self.kinds if kinds is None else kinds
        if self.prices is None:
            return self._capped(row_ids, limits, kinds)
        active = len(row_ids)
        value, position, drafting_row = self.prices.prices(active)
        if value <= position and may_rest:
            # not even a certain token pays at this many rows (the CPU's prices from 8 rows):
            # no row drafts or probes while the rows stay as many
            self._rest(row_ids, (), active, nothing_pays=True)
            return None
        plans, probes = [], self.probes
        for row, limit in zip(row_ids, limits):
            options = (self.options(row, limit, value, position, drafting_row, kinds)
                       if limit > 0 else [])
            if options:
                probes.drafted(row)
            elif limit > 0:
                options = self._probe(row)
            plans.append(options)
        if may_rest and not any(plans):
            self._rest(row_ids, limits, active, nothing_pays=False)
            return None
        return plans

    def _capped(self, row_ids, limits, kinds) -> List[List[tuple]]:
        if self.adaptive:
            caps = self.caps
            return [[(0.0, kind, caps[kind].cap(row, limit)) for kind in kinds]
                    if limit > 0 else [] for row, limit in zip(row_ids, limits)]
        return [[(0.0, kind, limit) for kind in kinds] if limit > 0 else [] for limit in limits]

    def options(self, row: int, limit: int, value: float, position: float, drafting_row: float,
                kinds) -> List[tuple]:
        """(gain, kind, length) of each kind whose draft pays for this row, best first."""
        options = []
        for kind in kinds:
            caps = self.caps[kind]
            rate = caps.acceptance_rate(row)
            if rate * value <= position:  # not even a first token pays (most rows, at batch 32)
                continue
            cap = caps.cap(row, limit)
            length = paying_length(rate, value, position, drafting_row, cap)
            if length > 0:
                options.append((draft_gain(rate, value, position, length) - drafting_row,
                                kind, length))
        options.sort(key=lambda option: -option[0])
        return options

    def _probe(self, row: int) -> List[tuple]:
        """After its wait, a row that drafts nothing tries one token of the probed kinds, the
        most accepted first; the next probe waits twice as long."""
        if not self.probes.probes_now(row):
            return []
        rates = [(self.caps[kind].acceptance_rate(row), kind) for kind in self.probed_kinds]
        rates.sort(key=lambda rate: -rate[0])
        return [(0.0, kind, 1) for _, kind in rates]

    def _rest(self, row_ids, limits, active: int, nothing_pays: bool):
        """After an iteration in which no row drafted or probed: for how many iterations none
        will (until a row's probe, or for good where not even a certain token pays)."""
        if nothing_pays:  # while at least as many rows are left as pay nothing
            spell, fewest = math.inf, self.prices.nothing_pays_from(active)
        else:
            spell, fewest = self.probes.quiet_for(row_ids, limits), active
        if self.prices.measured:
            spell = min(spell, self.LONGEST_MEASURED_QUIET)
        self.quiet = QuietSpell(active, spell, fewest) if spell > 0 else None

    def _catch_up(self):
        """The iterations that passed without a plan count towards the rows' probes."""
        if self.skipped:
            self.probes.skip(self.skipped)
            self.skipped = 0

    def chose(self, row_ids: List[int], kinds: List[Optional[str]], drafts: List[List[int]]):
        """What each row drafts in this iteration (its kind, None: nothing)."""
        chosen = self.chosen
        for row, kind, draft in zip(row_ids, kinds, drafts):
            chosen[row] = (kind, len(draft)) if kind is not None else None
        stats = self.stats
        if stats is not None:
            counts = stats.drafter_iterations
            for kind in kinds:
                name = kind or NONE
                counts[name] = counts.get(name, 0) + 1

    def count_none(self, active: int):
        """An iteration in which none of ``active`` rows drafted (statistics)."""
        if self.stats is not None:
            counts = self.stats.drafter_iterations
            counts[NONE] = counts.get(NONE, 0) + active

    # ------------------------------------------------------------------ after an iteration
    def verified(self, row_ids: List[int], kept: List[int]):
        """After the verification of this iteration's plan: each row kept ``kept`` of its
        draft tokens. Each kind's estimates and the probes learn from it."""
        by_kind: Dict[str, tuple] = {}
        chosen, probes, stats = self.chosen, self.probes, self.stats
        for row, accepted in zip(row_ids, kept):
            choice = chosen[row]
            if choice is None:
                continue
            chosen[row] = None
            kind, length = choice
            group = by_kind.get(kind)
            if group is None:
                group = by_kind[kind] = ([], [], [])
            group[0].append(row)
            group[1].append(length)
            group[2].append(accepted)
            probes.verified(row, accepted)
            if stats is not None:
                stats.drafter_accepted[kind] = (stats.drafter_accepted.get(kind, 0)
                                                + min(accepted, length))
        for kind, (kind_rows, lengths, accepted) in by_kind.items():
            self.caps[kind].update(kind_rows, lengths, accepted)

    def backed_off(self, drafted: List[int], accepted, iteration: int):
        """The back-off's view of ``iteration``: per active row the draft tokens verified and
        how many of them were kept (an array)."""
        if self.backoff is not None:
            self.backoff.update(drafted, accepted.tolist(), iteration)

    def keep(self, alive: Tensor):
        """Keep (and reorder) the active rows, as the engine does when finished rows leave."""
        if self.backoff is not None:
            self.backoff.keep(alive)

    def absorb(self, other: "DraftSchedule", ids: List[int]):
        """The rows of ``other`` (a fresh batch's schedule) join this batch as the rows
        ``ids``, after its active rows. A quiet spell ends: it was priced without them."""
        if self.backoff is not None:
            self.backoff.extend(other.backoff)
        for kind, caps in self.caps.items():
            place_rows(caps, other.caps[kind], AdaptiveCaps.ROW_FIELDS, ids)
        if self.probes is not None:
            place_rows(self.probes, other.probes, ProbeSchedule.ROW_FIELDS, ids)
        if self.chosen:
            place_rows(self, other, ("chosen",), ids)
        self.rows = max(self.rows, max(ids) + 1)
        self.quiet = None
        if self.clock is not None:
            self.clock.open = None  # its time would span the joining
