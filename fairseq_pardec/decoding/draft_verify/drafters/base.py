"""The drafter interface of the draft-and-verify engine, and what drafters share.

A drafter gets the batch once (``start``, which returns the batch's state) and then has two
methods: ``propose(state, view)``, per active row a draft of at most its room of tokens, as a
list, and ``observe(state, outcome)``, what each row kept of it. The view and the outcome hold
the host's lists; what a drafter model needs on the device (the rows, the token table, the
verifier's features after each row's last kept token) they copy or gather when first asked,
and the drafts a model made there are read through ``view.read``: the engine's copies and
reads, made only for a drafter that asks. The parts of a batch's schedule (schedule.py): the per-row caps and acceptance estimates
(``AdaptiveCaps``), when rows that draft nothing try again (``ProbeSchedule``), the iterations
in which surely no row drafts (``QuietSpell``) and a drafter's acceptance across batches
(``AcceptanceHistory``).
"""

import math
from typing import List, Optional

import torch
from torch import Tensor


def pad_drafts(drafts: List[List[int]], pad: int, device) -> (Tensor, Tensor):
    """Ragged python drafts -> (B, K) padded tensor and (B,) lengths, on ``device`` (the
    engine gives drafters on the host its host tables: there they stay, as made)."""
    lengths = [len(d) for d in drafts]
    width = max(lengths, default=0)
    padded = [d + [pad] * (width - n) for d, n in zip(drafts, lengths)]
    out = torch.tensor(padded, dtype=torch.long).view(len(drafts), width)
    lengths = torch.tensor(lengths, dtype=torch.long)
    if torch.device(device).type == "cpu":
        return out, lengths
    # fresh tensors: copies queued without waiting for the device
    return out.to(device, non_blocking=True), lengths.to(device, non_blocking=True)


def place_rows(target, source, names, ids: List[int]):
    """Lists kept per row id (``names``, attributes of both): ``source``'s rows 0, 1, ... are
    written at ``ids`` of ``target``'s, where rows joining a running batch are given ids (an
    id freed by a row that left is taken again, else the next new one)."""
    for name in names:
        mine = getattr(target, name)
        for row, value in zip(ids, getattr(source, name)):
            if row < len(mine):
                mine[row] = value
            elif row == len(mine):
                mine.append(value)
            else:
                raise ValueError("row id %d skips ids after the %d kept in %s"
                                 % (row, len(mine), name))


def _host_to(device):
    """The engine's way to ``device`` where none is given: a plain copy."""
    def copy(values):
        return values.to(device, non_blocking=True)
    return copy


def _plain_read(tensor: Tensor) -> Tensor:
    return tensor.cpu()


class _ActiveRows:
    """The active rows' ids on the host (``rows``), and the engine's way to the model's device
    for what a drafter asks of them there."""

    __slots__ = ("rows", "device", "_copy", "_rows_on_device")

    def __init__(self, rows: List[int], device=None, copy=None,
                 rows_on_device: Optional[Tensor] = None):
        self.rows = rows
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._copy = copy if copy is not None else _host_to(self.device)
        self._rows_on_device = rows_on_device

    def on_device(self, values: List[int]) -> Tensor:
        """(B,) int64 on the model's device, from a list of the host's."""
        return self._copy(torch.tensor(values, dtype=torch.long))

    def rows_on_device(self) -> Tensor:
        if self._rows_on_device is None:
            self._rows_on_device = self.on_device(self.rows)
        return self._rows_on_device


class DraftView(_ActiveRows):
    """One iteration's active rows as a drafter reads them (``Drafter.propose``).

    On the host: ``rows`` (their ids), ``n_out`` (tokens each has accepted), ``room`` (the most
    draft tokens each may take), ``tokens`` (B, T) (BOS, then each row's accepted tokens) and
    ``longest`` (the most any has accepted). On ``device`` (the model's), copies made when first
    asked for and kept for the iteration (``rows_on_device``, ``n_out_on_device``,
    ``tokens_on_device``, ``on_device`` for a list of the drafter's own), and ``read`` for the
    drafts made there. The engine gives its own copies and its read (which it counts); the
    defaults copy and read plainly (tests, examples)."""

    __slots__ = ("n_out", "room", "tokens", "longest", "_read", "_n_out_on_device",
                 "_tokens_on_device")

    def __init__(self, rows: List[int], n_out: List[int], room: List[int], tokens: Tensor,
                 device=None, longest: Optional[int] = None, copy=None, read=None,
                 rows_on_device: Optional[Tensor] = None,
                 n_out_on_device: Optional[Tensor] = None):
        super().__init__(rows, device, copy, rows_on_device)
        self.n_out, self.room, self.tokens = n_out, room, tokens
        self.longest = max(n_out, default=0) if longest is None else longest
        self._read = read if read is not None else _plain_read
        self._n_out_on_device = n_out_on_device
        self._tokens_on_device = None

    def n_out_on_device(self) -> Tensor:
        if self._n_out_on_device is None:
            self._n_out_on_device = self.on_device(self.n_out)
        return self._n_out_on_device

    def tokens_on_device(self) -> Tensor:
        """The token table on the device (a copy, which the drafter may not change)."""
        if self._tokens_on_device is None:
            self._tokens_on_device = self._copy(self.tokens)
        return self._tokens_on_device

    def read(self, draft: Tensor, lengths) -> List[List[int]]:
        """Drafts made on the device, (B, K) and each row's length ((B,) on the device too, or
        a list), as lists: one read."""
        if isinstance(lengths, list):
            return [row[:n] for row, n in zip(self._read(draft).tolist(), lengths)]
        host = self._read(torch.cat([lengths.unsqueeze(1), draft], 1)).tolist()
        return [row[1: 1 + row[0]] for row in host]


class DraftOutcome(_ActiveRows):
    """What the verification of one iteration's drafts gave (``Drafter.observe``): per active
    row (``rows``, their ids) the draft tokens it kept (``accepted``) and, on the model's
    device and gathered when first asked for, the verifier's features after its last kept
    token (``features``, (B, d)) and that token (``newest``, (B,)): blockwise decoding's heads
    propose from them (merged invocation)."""

    __slots__ = ("accepted", "_features", "_newest", "_gathered")

    def __init__(self, rows: List[int], accepted: List[int], device=None, features=None,
                 newest=None, copy=None, rows_on_device: Optional[Tensor] = None):
        super().__init__(rows, device, copy, rows_on_device)
        self.accepted = accepted
        # tensors, or callables that gather them (the engine's: nothing is gathered unasked)
        self._features, self._newest = features, newest
        self._gathered = {}

    def _get(self, name: str, made):
        if name not in self._gathered:
            self._gathered[name] = made() if callable(made) else made
        return self._gathered[name]

    def features(self) -> Optional[Tensor]:
        return self._get("features", self._features)

    def newest(self) -> Optional[Tensor]:
        return self._get("newest", self._newest)


class ProbeSchedule:
    """When the rows that draft nothing try again (CPU lists): per row, the iterations since it
    last drafted or probed, and how long it waits for its next probe, one draft token. The wait
    starts at ``PROBE_AFTER``, doubles after each probe up to ``LONGEST_PROBE_WAIT`` while
    probes fail, and starts over once a draft token is kept. With a ``history``
    (AcceptanceHistory) a fresh row's first wait is what the drafter's last probing row waited,
    and every probe's outcome goes there. AdaptiveCaps keeps one per drafter, auto one for its
    rows whatever the drafter."""

    PROBE_AFTER = 8
    LONGEST_PROBE_WAIT = 64
    ROW_FIELDS = ("idle", "wait", "probing")  # kept per row id (place_rows)

    def __init__(self, rows: int, history: "AcceptanceHistory" = None):
        first_wait = self.PROBE_AFTER if history is None else history.probe_wait
        self.history = history
        self.idle = [0] * rows
        self.wait = [first_wait] * rows
        self.probing = [False] * rows

    @classmethod
    def longer(cls, wait: int) -> int:
        """The wait after a probe that was not the last: twice as long, up to the longest."""
        return min(2 * wait, cls.LONGEST_PROBE_WAIT)

    def drafted(self, row: int):
        """The row drafts in this iteration (not a probe): its count starts over."""
        self.idle[row] = 0

    def probes_now(self, row: int) -> bool:
        """An iteration in which no draft pays for the row: whether it probes in it (its wait
        is over; the next one then waits twice as long)."""
        self.idle[row] += 1
        if self.idle[row] <= self.wait[row]:
            return False
        self.idle[row] = 0
        self.wait[row] = self.longer(self.wait[row])
        self.probing[row] = True
        return True

    def verified(self, row: int, kept: float):
        """After the row's draft was verified: ``kept`` draft tokens were accepted."""
        if kept > 0:
            self.wait[row] = self.PROBE_AFTER
        if self.probing[row]:
            self.probing[row] = False
            if self.history is not None:
                self.history.probed(kept > 0)

    def quiet_for(self, rows: List[int], limits: Optional[List[int]] = None) -> float:
        """How many iterations surely pass before the first of ``rows`` probes (rows whose
        ``limits`` is 0 never do)."""
        idle, waits = self.idle, self.wait
        if limits is None:
            return min(waits[r] - idle[r] for r in rows)
        return min((waits[r] - idle[r] for r, limit in zip(rows, limits) if limit > 0),
                   default=math.inf)

    def skip(self, iterations: int):
        """``iterations`` passed without the rows being asked: their waits move on by them."""
        self.idle = [i + iterations for i in self.idle]


class AdaptiveCaps:
    """Per-row draft caps that follow acceptance: a row drafts at most twice its recent mean of
    accepted draft tokens, plus one (an exponential mean, weight 1/2 on the last iteration).

    A row whose drafts keep being rejected (translation, a heavy rewrite) drafts one token, so
    its iterations cost about a greedy step; a row that drafts well drafts up to the drafter's
    ceiling. ``initial`` is every row's mean before its first draft (``inf``: uncapped until
    then, the first draft's acceptance then is the mean). Float64: the halving keeps adding bits.

    The means are a Python list (double precision too), read and updated with a few list
    operations per row where tensor operations cost a few microseconds each, on every device:
    the host knows what each row kept, so no iteration reads the device for them.

    Each row also keeps an estimate of its per-position acceptance rate p (counts of
    accepted draft tokens and of first rejections, earlier drafts weighted down by RATE_DECAY,
    after a prior: 0.95, or with a ``history`` the drafter's rate over the rows before it): the
    j-th draft token is accepted with probability about p^j. A batch's schedule
    (schedule.py) prices drafts by it: a row drafts the length that gains the most over what
    its positions and its drafting cost, or nothing where no length pays; and with a history a
    fresh row's first cap is what the drafter's recent drafts were worth, so that a batch on a
    model that does not copy does not start by drafting.
    """

    CEILING = 2 ** 30
    PRIOR_ACCEPTED, PRIOR_REJECTED = 0.95, 0.05
    RATE_DECAY = 0.75  # weight of a row's earlier drafts in its acceptance rate, per draft
    ROW_FIELDS = ("mean", "accepted", "rejected")  # on the host, per row id (place_rows)
    PROBE_AFTER = ProbeSchedule.PROBE_AFTER
    LONGEST_PROBE_WAIT = ProbeSchedule.LONGEST_PROBE_WAIT

    def __init__(self, rows: int, initial: float, history: "AcceptanceHistory" = None):
        self.history = history
        if history is not None and history.mean_accepted is not None:
            # a fresh row's first draft is as long as the drafter's recent drafts were worth,
            # not uncapped: on translation a sentence's first copy is rejected
            initial = min(initial, history.mean_accepted)
        self.mean = [float(initial)] * rows
        self.accepted = [0.0] * rows
        self.rejected = [0.0] * rows

    def cap(self, row: int, limit: int) -> int:
        """The most draft tokens ``row`` may draft now, at most ``limit``."""
        return min(limit, int(min(2 * self.mean[row], self.CEILING)) + 1)

    def acceptance_rate(self, row: int) -> float:
        """The row's estimated probability that a draft token is accepted, given the ones
        before it were."""
        if self.history is None:
            prior_accepted, prior_rejected = self.PRIOR_ACCEPTED, self.PRIOR_REJECTED
        else:  # the drafter's rate so far, the rows of this batch included
            prior_accepted = self.history.rate()
            prior_rejected = 1.0 - prior_accepted
        accepted = self.accepted[row] + prior_accepted
        return accepted / (accepted + self.rejected[row] + prior_rejected)

    def update(self, rows: List[int], drafted: List[int], accepted: List[int]):
        """After a verification: ``drafted`` draft lengths, ``accepted`` draft tokens accepted
        (double precision). A row that drafted nothing keeps its mean: no draft says nothing
        about how well it drafts."""
        mean, rate_accepted, rate_rejected = self.mean, self.accepted, self.rejected
        history = self.history
        for r, tried, kept in zip(rows, drafted, accepted):
            if tried > 0:
                kept = float(min(kept, tried))
                mean[r] = kept if math.isinf(mean[r]) else 0.5 * (mean[r] + kept)
                rate_accepted[r] = self.RATE_DECAY * rate_accepted[r] + kept
                rate_rejected[r] = self.RATE_DECAY * rate_rejected[r] + (kept < tried)
                if history is not None:
                    history.update(kept, kept < tried, mean[r])


class QuietSpell:
    """Iterations in which a drafter surely drafts nothing (``DraftSchedule.drafts_now``):
    while the count of active rows stays between ``fewest`` and ``rows`` (by default exactly
    ``rows``: fewer rows change the prices), ``remaining`` more of them; ``skipped`` counts
    those that passed. Kept in the batch's schedule and changed in place: the engine asks every
    iteration, so that asking costs next to nothing."""

    __slots__ = ("rows", "fewest", "remaining", "skipped")

    def __init__(self, rows: int, remaining: float, fewest: Optional[int] = None):
        self.rows, self.remaining, self.skipped = rows, remaining, 0
        self.fewest = rows if fewest is None else fewest

    def step(self, active_rows: int) -> bool:
        """Whether this iteration is one of the spell's (then counted)."""
        if self.fewest <= active_rows <= self.rows and self.remaining > 0:
            self.remaining -= 1
            self.skipped += 1
            return True
        return False


class AcceptanceHistory:
    """A drafter's per-position acceptance over all the rows it drafted for, across batches
    (earlier drafts weighted down by DECAY per draft): the prior of every row's estimate
    (AdaptiveCaps), with the weight of one draft, as it stands now: once a few rows' drafts
    fail, the others stop trying too. Starts at AdaptiveCaps' prior."""

    DECAY = 0.98

    def __init__(self):
        self.accepted, self.rejected = AdaptiveCaps.PRIOR_ACCEPTED, AdaptiveCaps.PRIOR_REJECTED
        # how long a fresh row waits for its first probe: as long as the last probe's row
        # waited after it (doubling while probes fail, up to LONGEST_PROBE_WAIT): on a model
        # whose drafts are rejected, short sentences do not each pay for a probe
        self.probe_wait = ProbeSchedule.PROBE_AFTER
        # the mean of the rows' recent means of accepted draft tokens (a fresh row's first cap)
        self.mean_accepted = None

    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def probed(self, accepted: bool):
        """A row's probe (one draft token after its wait) was accepted or not."""
        self.probe_wait = (ProbeSchedule.PROBE_AFTER if accepted
                           else ProbeSchedule.longer(self.probe_wait))

    def update(self, kept: float, rejected: bool, row_mean: Optional[float] = None):
        self.accepted = self.DECAY * self.accepted + kept
        self.rejected = self.DECAY * self.rejected + rejected
        if row_mean is not None:
            self.mean_accepted = (row_mean if self.mean_accepted is None else
                                  self.DECAY * self.mean_accepted + (1 - self.DECAY) * row_mean)


class DraftState:
    """One batch's values of a drafter: made by ``start`` and handed back to every call of that
    batch (``propose``, ``observe``). The drafter itself keeps only
    what holds across batches (its options, its acceptance history, its prices), so threads
    that share one generator, and so its drafter, each decode their own batch."""

    def __init__(self):
        # with --sampling, set by ``propose``: (B, K, V), the distribution each draft token
        # was drawn from (None: deterministic drafts, one-hot q)
        self.draft_probs = None

    # the lists a state keeps per row id (its subclasses' own), which ``absorb`` extends
    ROW_FIELDS = ()

    def absorb(self, other: "DraftState", ids: List[int]):
        """The rows of ``other`` (a state ``start`` just made) join this state's batch as the
        rows ``ids`` (engine: rows joining a running batch)."""
        place_rows(self, other, self.ROW_FIELDS, ids)


class Drafter:
    """Interface of the draft step of the draft-and-verify engine: ``start``, then per
    iteration ``propose`` and ``observe`` (see the module's text).

    ``start`` returns the batch's :class:`DraftState` (a drafter's own subclass), which the
    engine passes to every later call of that batch. With ``--sampling`` (speculative sampling)
    a drafter that draws its drafts from a distribution sets the state's ``draft_probs`` in
    ``propose``: (B, K, V), the distribution each draft token was drawn from. ``None`` (the
    default) declares the drafts deterministic (one-hot q).
    """

    sampler = None
    temperature = 1.0
    # whether rows may join a running batch of this drafter's (its state's ``absorb``): the
    # drafters on the host keep plain lists per row; a drafter model's state on the device
    # (its own cache) takes none
    joins_rows = False

    def set_sampler(self, sampler, temperature: float = 1.0):
        """Called once by a sampling engine: draw drafts with ``sampler`` (its filter and its
        seeded generator) at the verifier's temperature."""
        self.sampler, self.temperature = sampler, temperature

    def _draw(self, logits: Tensor):
        """(..., V) logits -> drawn tokens (...) and the filtered distribution (..., V)."""
        lprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        probs = self.sampler.filter.probs(lprobs)
        flat = probs.reshape(-1, probs.size(-1))
        tokens = self.sampler.sample(flat).view(probs.shape[:-1])
        return tokens, probs

    def start(self, sample, encoder_out, bos: int, schedule=None) -> DraftState:
        """Called once per batch, before the first iteration: the batch's state. ``schedule``:
        the batch's DraftSchedule (schedule.py), which plans the rows' drafts (None: a
        drafter that plans makes its own)."""
        return DraftState()

    def propose(self, state: DraftState, view: DraftView) -> List[List[int]]:
        """Per active row of ``view`` its draft: at most its ``view.room`` tokens, in order."""
        raise NotImplementedError

    def observe(self, state: DraftState, outcome: DraftOutcome):
        """After each verification of a proposal: what each row kept (``outcome``). Most
        drafters learn from ``outcome.accepted`` alone."""


class NoDrafter(Drafter):
    """Drafts nothing: every iteration is one greedy step of the lean engine (``lean_greedy``).
    Its schedule never drafts, so the engine never asks it."""

    joins_rows = True

    def start(self, sample, encoder_out, bos: int, schedule=None) -> DraftState:
        if schedule is not None:
            schedule.never_drafts()
        return DraftState()

    def propose(self, state, view):
        return [[] for _ in view.rows]
