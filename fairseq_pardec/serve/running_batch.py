"""What the batcher decodes through: a running batch that rows join, that advances in steps,
and that rows leave when finished or cancelled.

:class:`RunningBatch` is the one interface the batcher uses. :class:`RoundBatch` implements it
on the generator as it is today: rows join at the start of a round, and one step decodes the
round to its end (``task.inference_step`` over every row). An iteration-level batch (rows join
between two decoder iterations, finished rows leave at once, caches by slot) implements the same
four members with one iteration per ``step``; the batcher and the server stay as they are.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch


@dataclass(eq=False)
class Row:
    """One text of a request: its source tokens, and its best hypotheses once decoded."""

    source: torch.Tensor
    job: Any  # the batcher's Job it belongs to
    index: int  # its place in the request's texts
    hypotheses: Optional[list] = None
    # perf_counter() when it joined the running batch, and when it finished decoding
    joined_at: float = 0.0
    finished_at: float = 0.0


@dataclass
class StepReport:
    """What one step did: the rows that finished (hypotheses set), and the work it took."""

    finished: List[Row] = field(default_factory=list)
    decoder_calls: int = 0  # batched decoder invocations
    row_iterations: int = 0  # per row, the iterations it took part in, summed
    tokens: int = 0  # target tokens produced (EOS included)
    seconds: float = 0.0


class RunningBatch(ABC):
    """Rows decoding together. Only the batcher's thread calls these."""

    capacity: int  # the most rows running at once

    @abstractmethod
    def running(self) -> int:
        """Rows admitted and not yet finished or cancelled."""

    @abstractmethod
    def admit(self, rows: List[Row]) -> None:
        """``rows`` join the batch (at most ``capacity - running()`` of them)."""

    @abstractmethod
    def step(self) -> StepReport:
        """Advance every running row; the rows that finished leave the batch."""

    @abstractmethod
    def cancel(self, row: Row) -> None:
        """``row`` leaves the batch without an answer (its request was cancelled)."""


class RoundBatch(RunningBatch):
    """Per round: the rows admitted since the last step are decoded together, to their end, in
    one generator call. Rows admitted while a round runs wait for the next (the batcher admits
    only between steps, so nothing is ever admitted mid-round)."""

    def __init__(self, model, capacity: int):
        self.model = model  # serve.model.LoadedModel
        self.capacity = capacity
        self._rows: List[Row] = []

    def running(self) -> int:
        return len(self._rows)

    def admit(self, rows: List[Row]) -> None:
        if len(self._rows) + len(rows) > self.capacity:
            raise ValueError("%d rows admitted to a batch of %d running rows and capacity %d"
                             % (len(rows), len(self._rows), self.capacity))
        self._rows.extend(rows)

    def cancel(self, row: Row) -> None:
        # between rounds every row has finished or not yet started: a cancelled one is dropped
        self._rows = [r for r in self._rows if r is not row]

    def step(self) -> StepReport:
        import time

        rows, self._rows = self._rows, []
        if not rows:
            return StepReport()
        stats = self.model.generator.stats
        before = (stats.decoder_calls, stats.row_iterations, stats.target_tokens)
        started = time.perf_counter()
        sample = self.model.batch([row.source for row in rows])
        hypotheses = self.model.decode(sample)
        finished_at = time.perf_counter()
        for position, hypos in zip(sample["id"].tolist(), hypotheses):
            rows[position].hypotheses = hypos
            rows[position].finished_at = finished_at
        return StepReport(
            finished=rows,
            decoder_calls=stats.decoder_calls - before[0],
            row_iterations=stats.row_iterations - before[1],
            tokens=stats.target_tokens - before[2],
            seconds=finished_at - started,
        )
