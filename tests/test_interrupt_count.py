"""Ctrl-C's line counts what was printed: fairseq prints a batch after its generate call returns,
so an interrupt between the two leaves the batch just decoded partly printed."""

import torch

from fairseq_pardec.decoding.decode_stats import DecodeStats, count_hypotheses, timed
from fairseq_pardec.tasks import translation_pardec


class _Task:
    datasets = {"test": list(range(300))}


def _reporter(monkeypatch):
    monkeypatch.setattr(translation_pardec.atexit, "register", lambda *a: None)
    monkeypatch.setattr(translation_pardec.errors, "on_interrupt", lambda *a, **k: None)
    return translation_pardec._SummaryReporter(_Task())


def _decode(stats, sentences):
    with timed(stats, torch.device("cpu")):
        pass
    count_hypotheses(stats, [[{"tokens": torch.tensor([4, 2])}]] * sentences)


class _Generator:
    def __init__(self):
        self.stats = DecodeStats()


def test_interrupt_inside_a_batch_counts_the_batches_before_it(monkeypatch):
    reporter, generator = _reporter(monkeypatch), _Generator()
    reporter.add("auto", generator)
    for _ in range(44):
        _decode(generator.stats, 1)
    generator.stats.decoding = True  # Ctrl-C while the 45th sentence decodes
    assert reporter.interrupted() == ("44 of 300 sentences decoded (--generator auto), the output "
                                      "is incomplete")


def test_interrupt_after_a_batch_returned_says_it_may_be_unprinted(monkeypatch):
    reporter, generator = _reporter(monkeypatch), _Generator()
    reporter.add("auto", generator)
    for _ in range(9):
        _decode(generator.stats, 5)
    assert reporter.interrupted() == (
        "40 of 300 sentences decoded and printed (--generator auto), 5 more decoded whose lines "
        "may be missing; the output is incomplete")
