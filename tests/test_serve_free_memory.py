"""The server hands freed memory back when its running batch empties, at most every so often
(serve/free_memory.py), and the batcher tells it when the batch has emptied."""

import platform
import time

import pytest

from fairseq_pardec.serve.free_memory import FreeMemory, _malloc_trim


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_trims_at_most_once_every_interval():
    clock, calls = _Clock(), []
    memory = FreeMemory(every_s=30.0, clock=clock)
    memory.trim = lambda pad: calls.append(pad) or 1
    memory.batch_emptied()  # just started: nothing freed worth a trim yet
    clock.now += 31
    memory.batch_emptied()
    memory.batch_emptied()
    clock.now += 10
    memory.batch_emptied()
    clock.now += 25
    memory.batch_emptied()
    assert calls == [0, 0] and memory.trims == 2


def test_without_malloc_trim_nothing_is_called():
    clock = _Clock()
    memory = FreeMemory(every_s=0.0, clock=clock)
    memory.trim = None
    clock.now += 1
    memory.batch_emptied()
    assert memory.trims == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_has_malloc_trim():
    trim = _malloc_trim()
    assert trim is not None
    assert trim(0) in (0, 1)


def test_the_batcher_says_when_its_batch_has_emptied():
    pytest.importorskip("prometheus_client")
    from fairseq_pardec.serve.batcher import Batcher, JoinNow
    from test_serve_batcher import WAIT, ScriptedBatch, rows

    class Recorder:
        emptied = 0

        def batch_emptied(self):
            self.emptied += 1

    batch = ScriptedBatch(capacity=2)
    batcher = Batcher(batch, JoinNow(), max_pending_rows=100)
    batcher.free_memory = recorder = Recorder()
    batcher.start()
    try:
        for value in (10, 20):  # one request at a time: each empties the batch once
            batcher.submit(rows(value, value + 1), 60).future.result(WAIT)
        deadline = time.monotonic() + WAIT
        while recorder.emptied < 2 and time.monotonic() < deadline:  # told after the answers
            time.sleep(0.01)
        assert recorder.emptied == 2
    finally:
        batcher.stop()
