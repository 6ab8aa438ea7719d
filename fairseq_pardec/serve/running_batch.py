"""What the batcher decodes through: a running batch that rows join, that advances in steps,
and that rows leave when finished or cancelled.

:class:`RunningBatch` is the one interface the batcher uses, with two implementations:

* :class:`IterationBatch`: rows join between two decoder iterations (the draft-and-verify
  engine's ``open`` and ``join``: their encoder runs once, their cache entries join the running
  batch's) and leave the moment they finish or are cancelled; a step is one iteration. Each
  row's output is the one its sentence gets decoded alone.
* :class:`RoundBatch`: rows join at the start of a round, and one step decodes the round to its
  end (``task.inference_step`` over every row): fairseq's own search, a generator whose step or
  drafter keeps no per-row state to join (the CUDA static step, a drafter model), and
  ``--batching rounds`` and ``--batching buffer``.
"""

import logging
import time

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from fairseq_pardec.decoding.draft_verify.encoded_rows import encodes_ahead
from fairseq_pardec.decoding.draft_verify.engine import DraftVerifyGenerator

logger = logging.getLogger("fairseq_pardec.serve")


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

    def prepared(self) -> int:
        """Of the running rows, those admitted and not yet decoding (they count as waiting)."""
        return 0

    def room(self) -> int:
        """How many more rows ``admit`` takes now."""
        return self.capacity - self.running()

    @abstractmethod
    def admit(self, rows: List[Row]) -> None:
        """``rows`` join the batch (at most ``room()`` of them)."""

    def _check_room(self, rows: List[Row]):
        if self.running() + len(rows) > self.capacity:
            raise ValueError("%d rows admitted to a batch of %d running rows and capacity %d"
                             % (len(rows), self.running(), self.capacity))

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
        self._check_room(rows)
        self._rows.extend(rows)

    def cancel(self, row: Row) -> None:
        # between rounds every row has finished or not yet started: a cancelled one is dropped
        self._rows = [r for r in self._rows if r is not row]

    def step(self) -> StepReport:
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


class IterationBatch(RunningBatch):
    """Rows join the running batch between two iterations and leave it when they finish or are
    cancelled; one step is one iteration of the draft-and-verify engine (engine.py: ``open``,
    ``join``, ``iterate``, ``leave``). No row waits for another's end.

    When more rows are admitted than the batch has places, they are encoded together in one call
    and *prepared*: they join, in the order admitted, as places free up, with no encoder call of
    their own (encoded_rows.py). The batch asks for more (``room``) only once its prepared rows
    are too few to fill its free places, and then for up to ``prepare`` more than that, so that
    a server with a queue encodes its joiners a batch at a time, where joining one by one would
    encode them one by one."""

    def __init__(self, model, capacity: int, prepare: Optional[int] = None):
        self.model = model  # serve.model.LoadedModel, its generator a DraftVerifyGenerator
        self.generator = model.generator
        self.capacity = capacity
        if not encodes_ahead(self.generator.model):
            prepare = 0  # rows cannot be taken from its encoder's output
        self.prepare = capacity if prepare is None else prepare
        self._batch = None  # the engine's running Batch, None until rows first join
        self._rows: Dict[int, Row] = {}  # the batch's row id -> its Row
        # admitted rows encoded and waiting for a place: (row, its EncodedRows, its position)
        self._prepared: List[Tuple[Row, Any, int]] = []

    def running(self) -> int:
        return len(self._rows) + len(self._prepared)

    def prepared(self) -> int:
        return len(self._prepared)

    def room(self) -> int:
        free = self.capacity - len(self._rows) - len(self._prepared)
        return free + self.prepare if free > 0 else 0

    def admit(self, rows: List[Row]) -> None:
        if self.running() + len(rows) > self.capacity + self.prepare:
            raise ValueError("%d rows admitted to a batch of %d running or prepared rows, "
                             "capacity %d and %d prepared" % (len(rows), self.running(),
                                                              self.capacity, self.prepare))
        if not rows:
            return
        sample = self.model.batch([row.source for row in rows])
        order = sample["id"].tolist()  # the collater orders by length
        if self.running() + len(rows) <= self.capacity:  # every row has a place: they join
            self._join(rows, order, sample, None)
            return
        encoded = self.generator.encode_rows(sample)
        position_of = {index: position for position, index in enumerate(order)}
        self._prepared += [(row, encoded, position_of[i]) for i, row in enumerate(rows)]
        self._fill()

    def _fill(self):
        """Prepared rows take the free places, in the order they were admitted."""
        free = self.capacity - len(self._rows)
        taking, self._prepared = self._prepared[:free], self._prepared[free:]
        while taking:  # rows of one encoder call join together
            encoded = taking[0][1]
            group = [entry for entry in taking if entry[1] is encoded]
            taking = [entry for entry in taking if entry[1] is not encoded]
            sample, encoder_out, sources = encoded.take([position for _, _, position in group])
            self._join([row for row, _, _ in group], list(range(len(group))), sample,
                       encoder_out, sources)

    def _join(self, rows: List[Row], order: List[int], sample, encoder_out,
              sources=None) -> None:
        """``sample``'s rows, row ``order[i]`` of ``rows`` at its position i, join the batch."""
        if not self._rows:  # nothing running: a fresh batch
            self._batch = self.generator.open(sample, encoder_out)
            ids = list(range(len(rows)))
        else:
            ids = self.generator.join(self._batch, sample, encoder_out, sources)
        joined_at = time.perf_counter()
        for row_id, position in zip(ids, order):
            self._rows[row_id] = rows[position]
            rows[position].joined_at = joined_at

    def cancel(self, row: Row) -> None:
        self._prepared = [entry for entry in self._prepared if entry[0] is not row]
        gone = [row_id for row_id, running in self._rows.items() if running is row]
        for row_id in gone:
            del self._rows[row_id]
        if gone:
            self.generator.leave(self._batch, gone)

    def step(self) -> StepReport:
        self._fill()
        if not self._rows:
            return StepReport()
        stats = self.generator.stats
        before = (stats.decoder_calls, stats.row_iterations)
        started = time.perf_counter()
        ended = self.generator.iterate(self._batch)
        finished_at = time.perf_counter()
        finished, tokens = [], 0
        for row_id in ended:
            row = self._rows.pop(row_id)
            row.hypotheses = self._batch.finalized[row_id]
            row.finished_at = finished_at
            tokens += row.hypotheses[0]["tokens"].numel()
            finished.append(row)
        self._batch.release(ended)
        # what generate counts per call, counted per row here
        stats.sentences += len(finished)
        stats.target_tokens += tokens
        stats.wall_time += finished_at - started
        return StepReport(
            finished=finished,
            decoder_calls=stats.decoder_calls - before[0],
            row_iterations=stats.row_iterations - before[1],
            tokens=tokens,
            seconds=finished_at - started,
        )


def running_batch_for(model, capacity: int, batching: str,
                      prepare: Optional[int] = None) -> RunningBatch:
    """The running batch of a server: rows join at every iteration where the generator takes
    them (--batching join), else in rounds, with one line saying why."""
    generator = model.generator
    if batching != "join":
        return RoundBatch(model, capacity)
    if not isinstance(generator, DraftVerifyGenerator):
        logger.info("--batching join: fairseq's %s decodes in rounds (rows join between "
                    "rounds); a draft-and-verify --generator takes rows at every iteration",
                    type(generator).__name__)
        return RoundBatch(model, capacity)
    if not generator.joins_rows():
        logger.info("--batching join: the %s decoder step or this drafter keeps no per-row state "
                    "that rows could join; rows join between rounds",
                    type(generator.block_decoder).__name__)
        return RoundBatch(model, capacity)
    return IterationBatch(model, capacity, prepare)
