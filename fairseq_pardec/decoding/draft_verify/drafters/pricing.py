"""What an iteration costs, and what a draft must therefore gain: the prices drafting decides by.

An iteration of the draft-and-verify engine with R active rows, of which D draft, verifying E
draft positions beyond the R one-position steps, costs about

    T = plain(R) + E * position(R) + D * drafting_row(R)

``plain(R)``: the iteration where no row drafts (a greedy step of R rows: the layers, the output
layer, the engine's decisions); ``position(R)``: one more verified position (in the products and
the attention, accepted or not); ``drafting_row(R)``: what a drafting row adds beyond its
positions (its match in Python, the ragged block's layout, the cache's holes, reading back its
tokens). A token of a row decoded by plain steps is worth ``plain(R) / R``: a draft of k tokens
whose j-th is accepted with probability p^j pays where

    plain(R) / R * (p + p^2 + ... + p^k)  >  k * position(R) + drafting_row(R).

:class:`MeasuredPrices` learns the three prices from the engine's own iterations as they run: a
drafter sees the wall time from one ``propose`` to the next, which is exactly one iteration
(drafting, verifying, deciding, retiring rows), and what it drafted in it. Nothing is timed
before decoding starts, and what is measured is what an iteration really costs on this machine,
model and load, the drafting's own Python included (which a step table of the decoder call alone
leaves out, and which at batch 1 on a CPU costs about what a verified position does). Prices
change only how much is drafted; the verification is exact, so the output does not depend on
them. :class:`FixedPrices` are constants: for reproducible counts (tests) and for speculative
sampling, whose draws depend on what was drafted (a fixed ``--seed`` then gives the same
samples whatever the timing).
"""

import math
import time
from typing import List, Optional

import numpy as np


class IterationPrices:
    """Prices of an iteration's parts by active row count, in any unit (only ratios matter)."""

    measured = False

    def prices(self, rows: int):
        """(value of a token, price of a verified position, price of a drafting row) at
        ``rows`` active rows."""
        raise NotImplementedError

    def model_price(self, rows: int) -> float:
        """What running a drafter model (gad's, blockwise's heads) for an iteration costs."""
        raise NotImplementedError

    def nothing_pays_from(self, rows: int) -> int:
        """Where not even a certain token pays at ``rows`` active rows: the fewest rows from
        which on, up to ``rows``, that holds too (measured prices change as they run: ``rows``
        only)."""
        return rows

    def observe(self, rows: int, extra_positions: int, drafting_rows: int, seconds: float,
                model: bool = False):
        """One iteration's wall time (``MeasuredPrices``; fixed prices ignore it); ``model``:
        whether a drafter model ran in it."""


class FixedPrices(IterationPrices):
    """Constant prices, in units of what one more row adds to a plain iteration: a plain
    iteration of R rows costs ``fixed + R``, a verified draft position ``position``, a drafting
    row ``drafting_row`` beyond its positions, a drafter model's run ``model`` (None: a plain
    iteration). A first draft token then pays where its acceptance reaches
    ``position * R / (R + fixed)`` (:meth:`threshold`): at batch 1 most drafts pay, and from
    ``R >= fixed / (position - 1)`` rows none does, so that a full batch decodes as plain steps
    and drafting starts as rows finish."""

    def __init__(self, fixed: float = 2.0, position: float = 1.0, drafting_row: float = 0.0,
                 model: float = None):
        self.fixed, self.position, self.row = float(fixed), float(position), float(drafting_row)
        self.model = model

    def prices(self, rows: int):
        rows = max(1, rows)
        return (self.fixed + rows) / rows, self.position, self.row

    def nothing_pays_from(self, rows: int) -> int:
        # a token's value, (fixed + R) / R, falls as rows are added: where it does not reach
        # a position's price at R rows, it does not at more rows either
        while rows > 1 and self.prices(rows - 1)[0] <= self.position:
            rows -= 1
        return rows

    def threshold(self, rows: int) -> float:
        """The least acceptance at which a first draft token pays for its position (above 1:
        none does)."""
        rows = max(1, rows)
        return self.position * rows / (rows + self.fixed)

    def model_price(self, rows: int) -> float:
        return self.fixed + max(1, rows) if self.model is None else self.model


# The CPU's prices, in rows of a plain iteration, from the measured costs of a d256 3+3 model's
# iterations (docs/results.md, "What an iteration costs on the CPU"): a plain iteration's fixed
# cost is that of about 8 rows, a verified draft position that of about 2 (its products and its
# share of the decisions), a drafting row about 1 row of Python beyond them once its block is
# built from the drafter's lists (matching, reading its outcome). So a draft position pays at 1
# row where it is accepted with probability 0.22, at 4 rows 0.67, and never from 8 rows on:
# there every product is bound by arithmetic and a position costs more than a row's share of
# the plain step. The price of a drafting row was chosen between 0, 1 and 2 by the speed of auto
# and lookup on a GEC and a translation model (docs/results.md).
CPU_PRICES = FixedPrices(fixed=8.0, position=2.0, drafting_row=1.0)


class _Fit:
    """Least squares of an iteration's time on [1, R, E, D, M], one row-count range's, with older
    iterations weighted down (FORGET per iteration) and ridge terms that pull the coefficients
    toward a prior set from the range's first iteration: until drafts of several lengths have
    been seen, the prior decides."""

    FORGET = 0.995
    RIDGE = 0.25  # the prior's weight, in iterations
    SOLVE_EVERY = 8

    def __init__(self, rows: int, seconds: float):
        # prior: a plain iteration of R rows costs 2 + R positions (CopyDrafter.CPU_FIXED), a
        # drafting row half a position, a drafter model's run a plain iteration
        unit = seconds / (rows + 2.0)
        self.prior = [2.0 * unit, unit, unit, 0.5 * unit, seconds]
        self.scale = [1.0, float(rows), 1.0, 1.0, 1.0]  # so that the ridge weighs terms alike
        self.gram = [[0.0] * 5 for _ in range(5)]
        self.moment = [0.0] * 5
        self.seen = 0
        self.coef = list(self.prior)

    def predict(self, x: List[float]) -> float:
        return sum(c * v for c, v in zip(self.coef, x))

    def add(self, x: List[float], seconds: float):
        if self.seen >= 8:
            # an iteration with a close call replays fairseq's search (tens of steps): clipped,
            # so that one rare outlier does not price every draft out
            seconds = min(seconds, 3.0 * max(self.predict(x), 1e-9))
        forget, gram, moment = self.FORGET, self.gram, self.moment
        for i, xi in enumerate(x):  # the upper triangle only (symmetric)
            moment[i] = forget * moment[i] + xi * seconds
            row = gram[i]
            for j in range(i, 5):
                row[j] = forget * row[j] + xi * x[j]
        self.seen += 1
        if self.seen % self.SOLVE_EVERY == 0 or self.seen <= 4:
            self._solve()

    def _solve(self):
        gram = np.array(self.gram)
        gram = np.triu(gram) + np.triu(gram, 1).T  # the lower triangle was not kept
        ridge = self.RIDGE * np.square(self.scale)
        try:
            coef = np.linalg.solve(gram + np.diag(ridge),
                                   np.array(self.moment) + ridge * np.array(self.prior))
        except np.linalg.LinAlgError:
            return
        if np.all(np.isfinite(coef)):
            self.coef = coef.tolist()


class MeasuredPrices(IterationPrices):
    """Prices learned from the wall times of the engine's iterations (see the module's text).

    One fit per range of active rows (1, 2-3, 4-7, ...: a position's price changes as the
    products go from bound by memory to bound by arithmetic); a range not seen yet borrows the
    nearest one seen. Kept by the generator's drafter, so across its batches. The prices never
    fall below a floor (a position at least a twentieth of a row's plain step): measured noise
    cannot make drafting look free.
    """

    measured = True

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.fits = {}

    @staticmethod
    def _range(rows: int) -> int:
        return max(1, rows).bit_length()

    def _fit(self, rows: int) -> Optional[_Fit]:
        fit = self.fits.get(self._range(rows))
        if fit is None and self.fits:
            nearest = min(self.fits, key=lambda r: abs(r - self._range(rows)))
            fit = self.fits[nearest]
        return fit

    def observe(self, rows: int, extra_positions: int, drafting_rows: int, seconds: float,
                model: bool = False):
        if seconds <= 0 or rows <= 0:
            return
        key = self._range(rows)
        fit = self.fits.get(key)
        if fit is None:
            fit = self.fits[key] = _Fit(rows, seconds)
        fit.add([1.0, float(rows), float(extra_positions), float(drafting_rows), float(model)],
                seconds)

    def _coefficients(self, rows: int):
        fit = self._fit(rows)
        return None if fit is None else fit.coef

    def prices(self, rows: int):
        rows = max(1, rows)
        coef = self._coefficients(rows)
        if coef is None:  # nothing measured yet: the CPU's constant
            return FixedPrices().prices(rows)
        fixed, per_row, position, drafting_row, _ = coef
        plain = max(fixed + per_row * rows, 1e-9)
        value = plain / rows
        return value, max(position, value / 20.0), max(drafting_row, 0.0)

    def model_price(self, rows: int) -> float:
        coef = self._coefficients(rows)
        if coef is None:
            return FixedPrices().model_price(rows)
        value, position, _ = self.prices(rows)
        return max(coef[4], position)


class IterationClock:
    """A batch's timing of its iterations for :class:`MeasuredPrices`: each ``propose`` ticks
    once, with the time it began and what it drafted; the time to the next tick is that
    iteration's (drafting, verifying, deciding, retiring rows). After a batch's first
    ``EVERY_FROM`` iterations one in ``EVERY`` is fitted: plenty for the fit, and its
    arithmetic in Python stays a small fraction of an iteration."""

    EVERY_FROM, EVERY = 16, 4

    def __init__(self, prices: IterationPrices):
        self.prices = prices
        self.measured = prices.measured
        self.open = None
        self.ticks = 0

    def now(self) -> Optional[float]:
        return self.prices.clock() if self.measured else None

    def tick(self, began: Optional[float], rows: int, extra_positions: int, drafting_rows: int,
             model: bool = False):
        if began is None:
            return
        self.ticks += 1
        if self.open is not None and (self.ticks <= self.EVERY_FROM
                                      or self.ticks % self.EVERY == 0):
            was_rows, was_extra, was_drafting, was_model, was_began = self.open
            self.prices.observe(was_rows, was_extra, was_drafting, began - was_began, was_model)
        self.open = [rows, extra_positions, drafting_rows, model, began]

    def model_ran(self):
        """A drafter model ran in the open iteration after its tick (blockwise's heads run
        after the verification, for the next iteration's draft)."""
        if self.open is not None:
            self.open[3] = True


def draft_gain(rate: float, value: float, position: float, length: int) -> float:
    """What a draft of ``length`` tokens is expected to gain over its positions' price, for a row
    whose j-th draft token is accepted with probability ``rate`` ** j."""
    if length <= 0:
        return 0.0
    expected = length if rate >= 1.0 else rate * (1.0 - rate ** length) / (1.0 - rate)
    return value * expected - length * position


def paying_length(rate: float, value: float, position: float, drafting_row: float,
                  cap: int) -> int:
    """The draft length, at most ``cap``, that gains the most over its price for a row whose
    j-th draft token is accepted with probability ``rate`` ** j; 0 where no length pays.

    Each further token pays while ``rate ** j * value >= position``; the whole draft must also
    pay for the drafting row's price."""
    if cap <= 0 or not 0.0 < rate < 1.0 or value <= 0.0:
        return 0
    if position <= 0.0:
        length = cap
    else:
        ratio = position / value
        if ratio >= rate:  # not even the first token pays for its position
            return 0
        length = min(cap, int(math.log(ratio) / math.log(rate)))
    return length if draft_gain(rate, value, position, length) > drafting_row else 0
