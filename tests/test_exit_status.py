"""An error that ends a run part-way ends the process with status 1 and its one line, never an
abort: fairseq's batch-prefetch thread, still collating when the process exits, once took it
down with "terminate called without an active exception" (SIGABRT, 134 in a shell) after the
right line (prefetch_threads.py).

The command lines run as a user starts them (a new interpreter each: the forked runs of
cli_setup.run end by os._exit, before the interpreter finalizes, where the abort happened)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cli_setup import PLUGIN, generate

# each case's runs, side by side: the abort came in most runs, not all
REPEATS = 3

CASES = {
    "min-len above the length limit": (
        ["--generator", "iad", "--min-len", 100, "--max-len-a", 1, "--max-len-b", 0], {},
        "is below --min-len 100"),
    "negative max-len-a": (
        ["--generator", "iad", "--max-len-a", -1, "--max-len-b", 5], {}, "--max-len-a -1 x"),
    "unknown kernel": (
        ["--generator", "auto"], {"FAIRSEQ_PARDEC_KERNEL": "bogus"},
        "FAIRSEQ_PARDEC_KERNEL=bogus is not a product kernel"),
    "kernel in upper case": (
        ["--generator", "auto"], {"FAIRSEQ_PARDEC_KERNEL": "NATIVE"},
        "FAIRSEQ_PARDEC_KERNEL=NATIVE is not a product kernel"),
    "switch neither on nor off": (
        ["--generator", "auto"], {"FAIRSEQ_PARDEC_NATIVE": "maybe"},
        "FAIRSEQ_PARDEC_NATIVE=maybe is not a yes/no value"),
}


def assert_ended_in_one_line(proc, needle):
    """Exit status 1 (an abort is -6 here, 134 in a shell), one error line, no traceback."""
    said = [line for line in proc.stderr.splitlines() if line.startswith("fairseq_pardec: error:")]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(said) == 1 and needle in said[0], proc.stderr[-2000:]


@pytest.mark.parametrize("case", CASES)
def test_an_error_while_decoding_exits_with_status_one(cli_data, stock_checkpoint, monkeypatch,
                                                       case):
    flags, variables, needle = CASES[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    with ThreadPoolExecutor(REPEATS) as pool:
        runs = list(pool.map(lambda _: generate(data, ckpt, *flags, check=False, fresh=True),
                             range(REPEATS)))
    for proc in runs:
        assert_ended_in_one_line(proc, needle)


# A prefetch thread that is always inside a torch product (its queue never fills) when the
# error ends the run: without the exit handler, this aborted in every run
BUSY_PREFETCH = r"""
import sys
sys.argv = ["/venv/bin/fairseq-generate"]  # the boundary is installed for fairseq's CLIs
sys.path.insert(0, %r)
import fairseq_pardec  # noqa: F401
import torch
from fairseq.data.iterators import BufferedIterator
from fairseq_pardec.errors import UsageError


class Products:
    def __len__(self):
        return 1000

    def __iter__(self):
        a = torch.randn(600, 600)
        while True:
            yield a @ a


batches = BufferedIterator(1000, Products())
next(batches)
raise UsageError("stopped while a batch is being collated")
""" % os.path.dirname(PLUGIN)


def test_a_prefetch_thread_inside_torch_does_not_abort_the_exit():
    proc = subprocess.run([sys.executable, "-c", BUSY_PREFETCH], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert_ended_in_one_line(proc, "stopped while a batch is being collated")


def test_stopping_a_prefetch_thread():
    """In process: the thread ends after the batch at hand, its queue full or not."""
    import torch
    from fairseq.data.iterators import BufferedIterator

    from fairseq_pardec.prefetch_threads import prefetch_threads, stop_prefetch_threads

    class Batches:
        def __len__(self):
            return 10 ** 6

        def __iter__(self):
            while True:
                yield torch.ones(64, 64) @ torch.ones(64, 64)

    for size in (1, 50):  # blocked on its full queue / collating
        batches = BufferedIterator(size, Batches())
        next(batches)
        assert batches._consumer in prefetch_threads()
        assert stop_prefetch_threads(within_s=60) == []
        assert not batches._consumer.is_alive()
