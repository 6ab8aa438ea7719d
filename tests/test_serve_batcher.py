"""The batcher against a scripted RunningBatch (no model, no HTTP): what joins when, what a
cancelled request leaves behind, the queue's limit, drain and stop. Every wait is bounded."""

import threading
import time

import pytest
import torch

pytest.importorskip("prometheus_client")

from fairseq_pardec.serve.batcher import Batcher, Buffer, JoinNow, QueueFull, Stopping  # noqa: E402
from fairseq_pardec.serve.metrics import Metrics  # noqa: E402
from fairseq_pardec.serve.running_batch import Row, RunningBatch, StepReport  # noqa: E402

WAIT = 30


class ScriptedBatch(RunningBatch):
    """Each step finishes every running row (hypothesis: its source, reversed); ``gate``
    holds a step until the test lets it go. Records what joined, step by step."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.rows = []
        self.admitted = []  # one list of row sources per admit call
        self.cancelled = []
        self.gate = threading.Event()
        self.gate.set()

    def running(self):
        return len(self.rows)

    def admit(self, rows):
        assert len(self.rows) + len(rows) <= self.capacity
        self.admitted.append([r.source.tolist() for r in rows])
        self.rows += rows

    def cancel(self, row):
        self.cancelled.append(row.source.tolist())
        self.rows = [r for r in self.rows if r is not row]

    def step(self):
        assert self.gate.wait(WAIT)
        rows, self.rows = self.rows, []
        for row in rows:
            row.hypotheses = [{"tokens": row.source.flip(0)}]
            row.finished_at = time.perf_counter()
        return StepReport(finished=rows, decoder_calls=1, row_iterations=len(rows),
                          tokens=len(rows), seconds=1e-3)


def rows(*values):
    return [Row(source=torch.tensor([v, 2]), job=None, index=i) for i, v in enumerate(values)]


def running(batcher):
    batcher.start()
    return batcher


def test_every_row_is_answered_in_its_request_and_capacity_holds():
    batch = ScriptedBatch(capacity=3)
    batcher = running(Batcher(batch, JoinNow(), max_pending_rows=100))
    jobs = [batcher.submit(rows(10 * k + 1, 10 * k + 2, 10 * k + 3, 10 * k + 4), 60) for k in range(5)]
    for k, job in enumerate(jobs):
        done = job.future.result(WAIT)
        assert [r.hypotheses[0]["tokens"].tolist() for r in done.rows] == [
            [2, 10 * k + i] for i in (1, 2, 3, 4)]
    assert max(len(a) for a in batch.admitted) <= 3
    assert batcher.pending() == 0
    batcher.stop()


def test_buffer_gathers_a_full_batch_or_waits_its_time():
    batch = ScriptedBatch(capacity=4)
    batcher = running(Batcher(batch, Buffer(capacity=4, wait_s=0.3), max_pending_rows=100))
    job = batcher.submit(rows(1, 2, 3, 4), 60)  # a full batch: decoded without waiting
    job.future.result(WAIT)
    started = time.perf_counter()
    alone = batcher.submit(rows(5), 60)  # alone: after the buffer's wait
    alone.future.result(WAIT)
    assert time.perf_counter() - started >= 0.3
    assert batch.admitted == [[[1, 2], [2, 2], [3, 2], [4, 2]], [[5, 2]]]
    batcher.stop()


def test_buffer_admits_nothing_while_its_batch_runs():
    batch = ScriptedBatch(capacity=4)
    batcher = running(Batcher(batch, Buffer(capacity=4, wait_s=0.0), max_pending_rows=100))
    batch.gate.clear()
    first = batcher.submit(rows(1), 60)
    deadline = time.monotonic() + WAIT
    while not batch.admitted and time.monotonic() < deadline:
        time.sleep(0.01)
    second = batcher.submit(rows(2, 3), 60)
    batch.gate.set()
    first.future.result(WAIT), second.future.result(WAIT)
    assert batch.admitted == [[[1, 2]], [[2, 2], [3, 2]]]
    batcher.stop()


def test_a_cancelled_request_leaves_nothing_behind():
    metrics = Metrics()
    batch = ScriptedBatch(capacity=1)
    batcher = running(Batcher(batch, JoinNow(), max_pending_rows=100, metrics=metrics))
    batch.gate.clear()  # the first row runs and holds the batch
    holder = batcher.submit(rows(1), 60)
    gone = batcher.submit(rows(7, 8, 9), 60)
    batcher.cancel(gone)
    batch.gate.set()
    holder.future.result(WAIT)
    after = batcher.submit(rows(4), 60)
    after.future.result(WAIT)
    assert [7, 2] not in sum(batch.admitted, [])  # never decoded
    assert not gone.future.done()  # no answer from the batcher: the handler gives it
    assert batcher.pending() == 0
    assert metrics.rows_cancelled._value.get() == 3
    batcher.stop()


def test_an_expired_request_is_dropped_before_it_joins():
    batch = ScriptedBatch(capacity=1)
    batcher = running(Batcher(batch, JoinNow(), max_pending_rows=100))
    batch.gate.clear()
    holder = batcher.submit(rows(1), 60)
    late = batcher.submit(rows(5), 0.01)
    time.sleep(0.05)
    batch.gate.set()
    holder.future.result(WAIT)
    deadline = time.monotonic() + WAIT
    while batcher.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.pending() == 0
    assert [5, 2] not in sum(batch.admitted, [])
    assert not late.future.done()
    batcher.stop()


def test_a_full_queue_refuses_with_retry_after():
    batch = ScriptedBatch(capacity=1)
    batcher = running(Batcher(batch, JoinNow(), max_pending_rows=3))
    batch.gate.clear()
    batcher.submit(rows(1, 2), 60)
    with pytest.raises(QueueFull) as refused:
        batcher.submit(rows(3, 4), 60)
    assert refused.value.retry_after >= 1 and "--max-pending-rows is 3" in str(refused.value)
    batcher.submit(rows(3), 60)  # what fits is taken
    batch.gate.set()
    batcher.stop()


def test_draining_takes_nothing_new_and_stop_answers_what_is_left():
    batch = ScriptedBatch(capacity=1)
    batcher = running(Batcher(batch, JoinNow(), max_pending_rows=10))
    batch.gate.clear()
    running_job = batcher.submit(rows(1), 60)
    waiting_job = batcher.submit(rows(2), 60)
    batcher.begin_drain()
    with pytest.raises(Stopping):
        batcher.submit(rows(3), 60)
    stopper = threading.Thread(target=batcher.stop, kwargs={"timeout": WAIT})
    stopper.start()
    batch.gate.set()
    stopper.join(WAIT)
    with pytest.raises(Stopping):
        waiting_job.future.result(WAIT)
    # the running one either finished in its last step or was told the server stopped
    assert running_job.future.done()
