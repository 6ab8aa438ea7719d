"""The one thread that decodes: a queue of rows, the running batch, and the futures that
requests wait on.

HTTP handlers only :meth:`Batcher.submit` a request's rows and wait on its future; the batcher's
thread alone touches the model. Between two steps of the running batch it drops the rows of
requests that were cancelled (a client that went away, a deadline passed), lets waiting rows
join as its admission policy says, steps, and resolves the requests whose last row finished.
"""

import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq_pardec.serve.free_memory import FreeMemory
from fairseq_pardec.serve.running_batch import Row, RunningBatch

logger = logging.getLogger("fairseq_pardec.serve")

# how long the idle thread sleeps before it looks at its stop flag again
_IDLE_WAIT_S = 0.5


class QueueFull(Exception):
    """The server holds as many rows as --max-pending-rows allows; retry after ``retry_after`` s."""

    def __init__(self, pending: int, limit: int, retry_after: int):
        super().__init__("the server has %d texts waiting or decoding, and --max-pending-rows is "
                         "%d; retry after %d s" % (pending, limit, retry_after))
        self.retry_after = retry_after


class Stopping(Exception):
    """The server is draining (SIGTERM) or stopped, and takes no new work."""


@dataclass(eq=False)
class Job:
    """One request: its rows, its deadline (``time.monotonic()``) and the future it waits on,
    which resolves with the job itself once every row is decoded."""

    rows: List[Row]
    deadline: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    remaining: int = 0

    def dead(self, now: float) -> bool:
        return self.cancelled or now > self.deadline

    def settle(self, result=None, error: Optional[BaseException] = None):
        """Resolve the future once; a future already done (cancelled by its waiter) stays so."""
        if self.future.done():
            return
        try:
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by the waiter meanwhile


class JoinNow:
    """Waiting rows join the running batch at each opportunity, as many as it has room for."""

    name = "join"

    def ready(self, waiting, running: int, free: int, now: float) -> bool:
        return bool(waiting) and free > 0


class Buffer:
    """Per-request batching: once the batch is empty, gather up to ``capacity`` rows or wait
    ``wait_s`` after the first, then decode that batch to its end before the next."""

    name = "buffer"

    def __init__(self, capacity: int, wait_s: float):
        self.capacity, self.wait_s = capacity, wait_s

    def ready(self, waiting, running: int, free: int, now: float) -> bool:
        if running or not waiting:
            return False
        return len(waiting) >= self.capacity or now >= waiting[0].job.submitted_at + self.wait_s

    def wake_at(self, waiting) -> Optional[float]:
        return waiting[0].job.submitted_at + self.wait_s if waiting else None


class Batcher:
    """The decoding thread over ``batch`` (a :class:`RunningBatch`)."""

    def __init__(self, batch: RunningBatch, admission, max_pending_rows: int, metrics=None):
        self.batch = batch
        self.admission = admission
        self.max_pending_rows = max_pending_rows
        self.metrics = metrics
        self._lock = threading.Condition()
        self._waiting = collections.deque()  # rows not yet admitted
        self._running_jobs = set()
        self._pending = 0  # rows waiting or running
        self._draining = False
        self._stopped = False
        self._rows_per_s = 0.0  # recent decoding rate, for Retry-After
        self.free_memory = FreeMemory()
        self._thread = threading.Thread(target=self._loop, name="pardec-batcher", daemon=True)

    # ------------------------------------------------------------------ the handlers' side
    def start(self):
        self._thread.start()

    def submit(self, rows: List[Row], timeout_s: float) -> Job:
        job = Job(rows=rows, deadline=time.monotonic() + timeout_s, remaining=len(rows))
        for row in rows:
            row.job = job
        with self._lock:
            if self._draining or self._stopped:
                raise Stopping("the server is shutting down and takes no new requests")
            if self._pending + len(rows) > self.max_pending_rows:
                raise QueueFull(self._pending, self.max_pending_rows, self._retry_after())
            self._pending += len(rows)
            self._waiting.extend(rows)
            self._gauges()
            self._lock.notify()
        return job

    def cancel(self, job: Job):
        """``job``'s rows leave: those waiting are never decoded, those running leave the batch
        at its next step boundary."""
        with self._lock:
            job.cancelled = True
            self._lock.notify()

    def begin_drain(self):
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def stop(self, timeout: float = 30.0):
        """Stop after the current step; requests still pending get :class:`Stopping`."""
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            jobs = {row.job for row in self._waiting} | self._running_jobs
            self._waiting.clear()
            self._running_jobs.clear()
            self._pending = 0
        for job in jobs:
            job.settle(error=Stopping("the server stopped before this request was decoded"))

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the decoding thread
    def _loop(self):
        while True:
            with self._lock:
                rows, gone = self._take()
                if self._stopped:
                    return
            for row in gone:
                self.batch.cancel(row)
            if gone:  # rows left the running batch between two iterations
                with self._lock:
                    self._gauges()
            if rows:
                now = time.perf_counter()
                for row in rows:
                    row.joined_at = now
                self.batch.admit(rows)
            if self.batch.running():
                self._step()

    def _take(self):
        """Under the lock: wait until there is something to do; returns (rows that join, running
        rows whose request is gone)."""
        while not self._stopped:
            now = time.monotonic()
            gone = self._drop_dead(now)
            running = self.batch.running()
            free = self.batch.room()
            if self.admission.ready(self._waiting, running, free, time.perf_counter()):
                rows = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self._running_jobs.update(row.job for row in rows)
                self._gauges(running + len(rows))
                return rows, gone
            if running or gone:
                return [], gone
            wake = getattr(self.admission, "wake_at", lambda waiting: None)(self._waiting)
            wait = _IDLE_WAIT_S if wake is None else max(0.0, min(_IDLE_WAIT_S, wake - time.perf_counter()))
            self._lock.wait(wait)
        return [], []

    def _drop_dead(self, now: float):
        """Under the lock: forget the waiting rows of cancelled or expired requests; returns the
        running rows of such requests (the batch drops them outside the lock)."""
        dropped = 0
        if any(row.job.dead(now) for row in self._waiting):
            kept = collections.deque(row for row in self._waiting if not row.job.dead(now))
            dropped = len(self._waiting) - len(kept)
            self._waiting = kept
        gone = []
        for job in [job for job in self._running_jobs if job.dead(now)]:
            self._running_jobs.discard(job)
            gone += [row for row in job.rows if row.hypotheses is None and row.joined_at]
        dropped += len(gone)
        if dropped:
            self._pending -= dropped
            if self.metrics:
                self.metrics.rows_cancelled.inc(dropped)
            self._gauges()
        return gone

    def _step(self):
        try:
            report = self.batch.step()
        except Exception as error:  # the round's requests fail; the server goes on
            logger.exception("decoding failed")
            self._fail_running(error)
            return
        finished_jobs = []
        with self._lock:
            for row in report.finished:
                job = row.job
                if job not in self._running_jobs:
                    continue  # cancelled meanwhile: already counted as dropped
                self._pending -= 1
                job.remaining -= 1
                if job.remaining == 0:
                    self._running_jobs.discard(job)
                    finished_jobs.append(job)
            if report.seconds > 0 and report.finished:
                rate = len(report.finished) / report.seconds
                self._rows_per_s = rate if not self._rows_per_s else 0.8 * self._rows_per_s + 0.2 * rate
            self._gauges()
        if self.metrics:
            self.metrics.observe_step(report)
        for job in finished_jobs:
            job.settle(result=job)
        if not self.batch.running():
            self.free_memory.batch_emptied()

    def _fail_running(self, error):
        with self._lock:
            jobs = set(self._running_jobs)
            for job in jobs:
                job.cancelled = True
            # the batch forgets them at the next take (cancelled): counted there
        for job in jobs:
            job.settle(error=error)

    def _retry_after(self) -> int:
        if self._rows_per_s <= 0:
            return 1
        return int(min(60, max(1, math.ceil(self._pending / self._rows_per_s))))

    def _gauges(self, held: Optional[int] = None):
        """``held``: the rows the batch holds (running or prepared), where it just took more."""
        if self.metrics:
            held = self.batch.running() if held is None else held
            prepared = self.batch.prepared()  # admitted, and waiting for a place
            self.metrics.set_rows(len(self._waiting) + prepared, held - prepared)
