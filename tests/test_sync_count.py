"""How often an iteration of the engine would make the host wait for CUDA, counted on the CPU
(tests/sync_counter.py), for the host path (the CPU's default) and the tensor path (what CUDA
runs: ``host_decisions = False``).

The bounds below are the counts as measured when they were written: they may only go down.
The target for the tensor path is one read of the device per iteration (the engine's ``_read``),
plus one in an iteration with a close call, whose replay (fairseq's own search, counted as one)
reads the device anyway. What stands between, per plain iteration of the tensor path here:
``running_scores``' numpy shortcut on the CPU and its copy back (fairseq_rules.py: a CPU branch,
absent on CUDA) and ``bool(ahead.all())`` in ``beam_one_choice`` (fairseq_rules.py); per
iteration with drafts, ``BlockLayout``'s ``any`` and ``nonzero`` over a ragged block
(step/block_layout.py), the drafters' reads of the rows and lengths (drafters/) and
``pad_drafts``' copy to the device (drafters/base.py). The host path reads the tensors it writes
through numpy views: it runs on the CPU only, where nothing waits.
"""

import pytest

from fairseq_pardec.decoding.draft_verify import engine, host_decisions
from fairseq_pardec.decoding.draft_verify.acceptance import TopBetaTauAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import (AutoDrafter, CopyDrafter, LookupDrafter,
                                                          NoDrafter)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import CPU_PRICES
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance

from helpers import (by_id, fairseq_greedy, make_dictionary, make_task, random_batch,
                     tiny_transformer)
from sync_counter import SyncCounter, per_iteration

LIMITS = dict(max_len_a=1.2, max_len_b=10)

# (generator, path) -> (the most in one iteration, the most per iteration on average, the most
# per batch outside the iterations), as measured on the batches of _setting
BOUNDS = {
    ("lean_greedy", "host"): (4, 2.2, 4),
    ("lean_greedy", "tensor"): (6, 4.2, 4),
    ("iad", "host"): (12, 3.0, 6),
    ("iad", "tensor"): (17, 5.2, 6),
    ("lookup", "host"): (12, 5.1, 6),
    ("lookup", "tensor"): (17, 7.9, 6),
    ("auto", "host"): (11, 8.2, 6),
    ("auto", "tensor"): (16, 13.2, 6),
}
# the tensor path with every decision replayed (each replay one read): the most in one iteration
REPLAYED_BOUND = 22


def _generator(name, d, model, **kwargs):
    """Each generator as the registry builds it (registry.py), on the CPU's prices."""
    if name == "lean_greedy":
        drafter, acceptance = NoDrafter(), ExactAcceptance()
    elif name == "iad":
        drafter, acceptance = CopyDrafter(d, d, adaptive=True), ExactAcceptance()
    elif name == "lookup":
        # registry.py's defaults: --gad-beta 1 --gad-tau 0, exact
        drafter = LookupDrafter(d, d, None, adaptive=True)
        acceptance = TopBetaTauAcceptance(1, 0.0)
    else:
        drafter, acceptance = AutoDrafter(d, d, prices=CPU_PRICES), ExactAcceptance()
    generator = DraftVerifyGenerator([model], d, drafter, acceptance, backoff=name != "auto",
                                     **LIMITS, **kwargs)
    if name == "auto":
        drafter.stats = generator.stats
    return generator


def _setting():
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=3)
    samples = [random_batch(d, [5, 12, 9, 3], seed=2), random_batch(d, [11], seed=5)]
    return d, model, samples


def _counted(generator, model, samples, monkeypatch):
    """(per-iteration counts, per-batch counts outside the iterations) over ``samples``; the
    outputs are checked against fairseq's greedy search."""
    counter = SyncCounter()
    for module in (engine, host_decisions):
        monkeypatch.setattr(module, "fairseq_decision",
                            counter.counted_once(module.fairseq_decision))
    iterations, batches = per_iteration(counter, generator)
    for sample in samples:
        expected = by_id(sample, fairseq_greedy(model, generator.tgt_dict, sample, **LIMITS))
        with counter:
            got = generator.generate([model], sample)
        assert by_id(sample, got) == expected
    return iterations, batches


@pytest.mark.parametrize("path", ["host", "tensor"])
@pytest.mark.parametrize("name", ["lean_greedy", "iad", "lookup", "auto"])
def test_syncs_per_iteration(name, path, monkeypatch):
    d, model, samples = _setting()
    generator = _generator(name, d, model)
    generator.host_decisions = path == "host"
    iterations, batches = _counted(generator, model, samples, monkeypatch)
    most, mean, outside = max(iterations), sum(iterations) / len(iterations), max(batches)
    bound = BOUNDS[name, path]
    assert most <= bound[0] and mean <= bound[1] and outside <= bound[2], (most, mean, outside)
    if path == "tensor":
        # the engine's own reads: one per iteration, one more where close calls were replayed
        assert len(iterations) <= generator.device_reads
        assert generator.device_reads <= len(iterations) + generator.stats.close_calls


def test_close_call_replays_count_one_read_each(monkeypatch):
    """With a margin that hands every decision to fairseq, each replay counts as one read."""
    d, model, samples = _setting()
    generator = _generator("iad", d, model, margin=1e3)
    generator.host_decisions = False
    iterations, batches = _counted(generator, model, samples, monkeypatch)
    assert generator.stats.close_calls > 0
    assert max(iterations) <= REPLAYED_BOUND
    assert generator.device_reads <= len(iterations) + generator.stats.close_calls
