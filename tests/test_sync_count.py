"""How often an iteration of the engine would make the host wait for CUDA, counted on the CPU
(tests/sync_counter.py).

The bounds below are the counts as measured when they were written: they may only go down.
The target is one read of the device per iteration (decisions.read_positions), plus one in an
iteration with a close call, whose replay (fairseq's own search, counted as one) reads the
device anyway. On the CPU the read is the native kernel's pass over the log-probabilities
where the step has one, which no torch hook sees: the engine counts it itself
(``device_reads``), and the counter sees what else would wait.
"""

import pytest

from fairseq_pardec.decoding.draft_verify import decisions
from fairseq_pardec.decoding.step import calibration
from fairseq_pardec.decoding.draft_verify.acceptance import TopBetaTauAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import (AutoDrafter, CopyDrafter, LookupDrafter,
                                                          NoDrafter)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import CPU_PRICES
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance

from helpers import (by_id, fairseq_greedy, make_dictionary, make_task, random_batch,
                     tiny_transformer)
from sync_counter import SyncCounter, per_iteration

LIMITS = dict(max_len_a=1.2, max_len_b=10)

# generator -> (the most in one iteration, the most per iteration on average, the most per batch
# outside the iterations), as measured on the batches of _setting, the engine's own read included
# (the other read in an iteration: the fast step's own, when it starts its cache for a batch in
# the first iteration; the fast step runs on the CPU only; outside them, the fast encoder's
# check for padding and a copy drafter's read of the sources, which on CUDA are the batch's)
BOUNDS = {
    "lean_greedy": (2, 1.05, 1),
    "iad": (2, 1.1, 2),
    "lookup": (2, 1.1, 2),
    "auto": (2, 1.15, 2),
}
# with every decision replayed (each replay one read): the most in one iteration
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
    monkeypatch.setattr(decisions, "fairseq_decision",
                        counter.counted_once(decisions.fairseq_decision))
    _margins_measured_beforehand(generator, model, samples[0])
    iterations, batches = per_iteration(counter, generator, monkeypatch)
    for sample in samples:
        expected = by_id(sample, fairseq_greedy(model, generator.tgt_dict, sample, **LIMITS))
        with counter:
            got = generator.generate([model], sample)
        assert by_id(sample, got) == expected
    return iterations, batches


def _margins_measured_beforehand(generator, model, sample):
    """The margins in force are measured on a model before its first batch, once a model
    (step/calibration.py): here, outside the count, which then holds what every batch does."""
    step, encode = generator._step_and_encoder()
    if generator._guard_margin(step) is not None and generator.margin is None:
        d = generator.tgt_dict
        calibration.margins_for(model, step, encode, sample["net_input"], d.eos(), d.eos(),
                                d.pad(), d.pad())


def _with_engine_reads(iterations, generator, native_reads):
    """The counts per iteration with the engine's reads the counter cannot see added (the
    native kernel's, one per iteration where it ran)."""
    return [count + native_reads for count in iterations]


@pytest.mark.parametrize("name", ["lean_greedy", "iad", "lookup", "auto"])
def test_syncs_per_iteration(name, monkeypatch):
    d, model, samples = _setting()
    generator = _generator(name, d, model)
    iterations, batches = _counted(generator, model, samples, monkeypatch)
    # the engine's one read per iteration
    assert generator.device_reads == len(iterations)
    unseen = 1 if generator.block_decoder.scores_kernel() is not None else 0
    iterations = _with_engine_reads(iterations, generator, unseen)
    most, mean, outside = max(iterations), sum(iterations) / len(iterations), max(batches)
    bound = BOUNDS[name]
    assert most <= bound[0] and mean <= bound[1] and outside <= bound[2], (most, mean, outside)


def test_close_call_replays_count_one_read_each(monkeypatch):
    """With a margin that hands every decision to fairseq, each replay counts as one read."""
    d, model, samples = _setting()
    generator = _generator("iad", d, model, margin=1e3)
    iterations, batches = _counted(generator, model, samples, monkeypatch)
    assert generator.stats.close_calls > 0
    assert max(iterations) <= REPLAYED_BOUND
    assert generator.device_reads == len(iterations)


# drafter models on the device (gad's GLAT drafter, blockwise decoding's heads), untrained: the
# counts as measured (3 and 6 in most iterations), the engine's read included; they too may only
# go down. Besides the engine's read and its read of the drafts: gad, fairseq's decoder of the
# drafter (its check whether any row is padded; the drafts' width comes from the host's
# lengths); blockwise, the caps on the host fed with device tensors (4; on CUDA the caps stay
# on the device).
MODEL_DRAFTER_BOUNDS = {
    "gad": (4, 3.1, 2),
    "blockwise": (7, 6.25, 1),
}


def _model_drafter_generator(name, d):
    """(generator, verifier): gad with an untrained GLAT drafter on a tiny verifier, or
    blockwise decoding with random heads on a tiny blockwise transformer (its first head is the
    verifier)."""
    from test_blockwise import blockwise_model
    from test_gad import drafter_model

    from fairseq_pardec.decoding.draft_verify.drafters import HeadsDrafter, NARDrafter

    task = make_task(d)
    if name == "gad":
        model = tiny_transformer(task, seed=3)
        drafter = NARDrafter(drafter_model(task, k=4), 4, d.eos(), d.pad())
    else:
        model = blockwise_model(task, heads=4, seed=3)
        drafter = HeadsDrafter(model.decoder, d.pad(), 4, adaptive=True)
    return DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), **LIMITS), model


@pytest.mark.parametrize("name", ["gad", "blockwise"])
def test_syncs_per_iteration_with_drafter_models(name, monkeypatch):
    d, _, samples = _setting()
    generator, model = _model_drafter_generator(name, d)
    iterations, batches = _counted(generator, model, samples, monkeypatch)
    unseen = 1 if generator.block_decoder.scores_kernel() is not None else 0
    iterations = _with_engine_reads(iterations, generator, unseen)
    most, mean, outside = max(iterations), sum(iterations) / len(iterations), max(batches)
    bound = MODEL_DRAFTER_BOUNDS[name]
    assert most <= bound[0] and mean <= bound[1] and outside <= bound[2], (most, mean, outside)
