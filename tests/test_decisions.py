"""Every token the engine keeps is decided on the host from one read per iteration
(decisions.py): every generator gives fairseq's greedy output through that one path, at batch
1, 8 and 64, near-ties and close calls included, and reads the device once per iteration."""

import pytest

from fairseq_pardec.decoding.draft_verify.drafters import AutoDrafter, NoDrafter
from fairseq_pardec.decoding.draft_verify.drafters.pricing import CPU_PRICES
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.acceptance import TopBetaTauAcceptance

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_beam_one import twin_vocabulary_model


def _drafter(name, src, tgt):
    if name == "none":
        return NoDrafter(), ExactAcceptance()
    if name == "copy":
        return CopyDrafter(src, tgt, adaptive=True), ExactAcceptance()
    if name == "auto":
        return AutoDrafter(src, tgt, prices=CPU_PRICES), ExactAcceptance()
    # registry.py's lookup: --gad-beta 1 --gad-tau 0, exact
    return LookupDrafter(src, tgt, None, adaptive=True), TopBetaTauAcceptance(1, 0.0)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("drafter", ["none", "copy", "lookup", "auto"])
def test_every_generator_gives_fairseq_greedy(batch_size, fast, drafter):
    src = make_dictionary(50)
    tgt = make_dictionary(50)
    tgt.add_symbol("only_in_target")
    model = tiny_transformer(make_task(src, tgt), seed=60 + batch_size)
    sample = random_batch(src, [1 + (i * 13) % 45 for i in range(batch_size)], seed=batch_size)
    limits = dict(max_len_a=1.2, max_len_b=10)
    draft, acceptance = _drafter(drafter, src, tgt)
    generator = DraftVerifyGenerator([model], tgt, draft, acceptance, fast=fast, **limits)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, fairseq_greedy(model, tgt, sample, **limits))
    # one read of the device per iteration (the close calls' replays read on their own)
    assert generator.device_reads == generator.stats.decoder_calls


@pytest.mark.parametrize("drafter", ["none", "copy", "lookup", "auto"])
def test_without_the_native_walk(drafter, monkeypatch):
    """Where the native library is off (no compiler, FAIRSEQ_PARDEC_NATIVE=off), Python's walk
    decides every row: the same output."""
    from fairseq_pardec.decoding.draft_verify import batch_state

    monkeypatch.setattr(batch_state, "native_kernel", lambda: None)
    test_every_generator_gives_fairseq_greedy(8, False, drafter)


@pytest.mark.parametrize("fast", [True, False])
def test_near_ties(fast):
    """The twin-token model ties fairseq's choice after adding the score at many steps: the
    host redoes those rows' ``topk`` as fairseq does, and hands the positions the step cannot
    certify to the margin guard."""
    model, d = twin_vocabulary_model(seed=4)
    # with the fast step, or any step once a block was verified, every twin tie goes to
    # fairseq's own search: a small batch. Plain steps through the model's own output layer
    # round as fairseq does (no guard): there the tie rule alone decides, on a larger batch.
    sample = random_batch(d, [4, 11, 7] if fast else [3 + (7 * i) % 30 for i in range(8)], seed=5)
    limits = dict(max_len_a=1.0 if fast else 1.5, max_len_b=6 if fast else 20)
    drafter = CopyDrafter(d, d) if fast else NoDrafter()
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), fast=fast, **limits)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, fairseq_greedy(model, d, sample, **limits))
    assert (generator.stats.close_calls > 0) == fast


def test_every_position_close():
    """A margin that leaves every decision to fairseq: fairseq's outputs."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=9)
    sample = random_batch(d, [5, 12, 9], seed=2)
    limits = dict(max_len_a=1.0, max_len_b=4)
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                     margin=1e3, **limits)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, fairseq_greedy(model, d, sample, **limits))
    # every token but an EOS forced at the length limit (the only candidate left)
    assert generator.stats.close_calls >= generator.stats.target_tokens - 3


def test_minimum_block_keeps_the_longer_of_the_run_and_the_floor():
    """--min-block-size: the rule's run of accepted tokens from the left, or the floor where
    that is longer (MinimumBlock.accept), never tokens the rule accepts after its run broke."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from fairseq_pardec.decoding.draft_verify.acceptance import MinimumBlock
    from fairseq_pardec.decoding.draft_verify.decisions import Reading, walk_row

    rule = MinimumBlock(ExactAcceptance(), 3)  # keeps at least 2 draft tokens
    draft, best = [5, 6, 7, 8], [9, 9, 7, 8, 4]  # the verifier agrees at positions 2 and 3 only
    generator = SimpleNamespace(acceptance=rule, eos=2, stats=None)
    batch = SimpleNamespace(n_out_np=np.zeros(1, dtype=np.int64), margin=None,
                            prev_score=np.zeros(1, dtype=np.float32), prefix_host=None)
    block = SimpleNamespace(rows=1, drafts=[draft], lengths=[4], pos=np.arange(5).reshape(1, 5))
    top = [[-0.1, -3.0]] * 5
    reading = Reading(np.array(top, dtype=np.float32), np.array(best), None,
                      draft_lp=np.full(5, -1.0, dtype=np.float32), verdict=np.zeros(5))
    tokens, _, accepted, _, _ = walk_row(generator, batch, block, reading, top, None, None, 0)
    valid = torch.ones(1, 4, dtype=torch.bool)
    expected = int(rule.accept(torch.tensor([draft]), valid, None, torch.tensor([best[:4]]))[0])
    assert accepted == expected == 2
    assert tokens == [5, 6, 7]  # two draft tokens kept, then the verifier's own


@pytest.mark.parametrize("seed", range(4))
def test_native_walk_decides_as_python(seed):
    """The native walk (native/decide.c) keeps what Python's walk keeps, tables and outcome
    alike, on random blocks with drafts that match for a while, EOS, and exact ties (rows the
    native walk leaves to Python's). Compared bit for bit: both walks add the same float32
    values in the same order, one IEEE single addition each, which rounds alike on every CPU."""
    import numpy as np
    import torch

    from fairseq_pardec.decoding.draft_verify.batch_state import Batch, Block
    from fairseq_pardec.decoding.draft_verify.decisions import Reading, decide

    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=1)
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance())
    rng = np.random.default_rng(seed)
    rows, vocab, eos = 12, len(d), d.eos()
    lengths = rng.integers(0, 5, rows).tolist()
    history = rng.integers(0, 6, rows)
    start_scores = -rng.random(rows).astype(np.float32) * 10

    def fresh_batch(native: bool) -> Batch:
        batch = Batch(generator, generator.block_decoder, rows, 30, eos, None, "cpu")
        if not native:
            batch.decider = None
        batch.n_out_np[:] = history
        batch.prev_score[:] = start_scores
        return batch

    layout = Block.from_lists(fresh_batch(True), [[4] * n for n in lengths], d.pad())
    lprobs = torch.from_numpy(rng.standard_normal((layout.pos.max() + 1, vocab)).astype(
        np.float32))
    lprobs[:, d.pad()] = -float("inf")
    ties = rng.random(lprobs.size(0)) < 0.1
    for at in np.flatnonzero(ties):  # an exact tie of the best two
        order = lprobs[at].argsort(descending=True)
        lprobs[at, order[1]] = lprobs[at, order[0]]
    lprobs[rng.random(lprobs.size(0)) < 0.1, eos] = 10.0  # EOS wins there
    values = lprobs.topk(2, dim=-1).values.numpy().copy()
    best = lprobs.numpy().argmax(1).astype(np.int64)
    drafts = []
    for r, n in enumerate(lengths):  # the verifier's tokens for a while, then another
        agree = rng.integers(0, n + 1)
        drafts.append([int(best[layout.pos[r, j]]) if j < agree else 5 for j in range(n)])

    kept = []
    for native in (True, False):
        batch = fresh_batch(native)
        block = Block.from_lists(batch, drafts, d.pad())
        reading = Reading(values, best, (values.ctypes.data, best.ctypes.data))
        outcome = decide(generator, batch, block, reading, lprobs, None)
        kept.append([batch.tokens_np.copy(), batch.scores_np.copy(), batch.n_out_np.copy(),
                     batch.prev_score.copy(), batch.last.copy(), outcome.gained.copy(),
                     outcome.accepted.copy(), outcome.ended.copy(), outcome.last_pos.copy(),
                     np.array(batch.longest)])
        assert outcome.ended_rows == int(outcome.ended.sum())  # what the engine retires by
        if native:
            left = outcome.left.copy()
    assert 0 < left.sum() < rows  # both walks ran
    for native_part, python_part in zip(*kept):
        assert np.array_equal(native_part, python_part)


def test_native_certainty_test_is_pythons():
    """native/decide.c's lead_is_certain answers as margin_guard.lead_is_certain on random
    inputs, on both sides of the boundary: leads drawn a few ulps around the smallest certain
    one, scores and margins of every size the engine meets."""
    import math
    import random

    from fairseq_pardec.decoding.draft_verify.margin_guard import _ADD_ROUNDING, lead_is_certain
    from fairseq_pardec.native.library import native_kernel

    kernel = native_kernel()
    if kernel is None:
        pytest.skip("no native kernel here")
    rng = random.Random(7)
    answers = set()
    for _ in range(20000):
        second = -rng.choice([0.0, 1e-3, 1.0, 30.0, 1e4]) * rng.random()
        margin = rng.choice([0.0, 1e-6, 1.6e-4, 5e-4, 0.5]) * rng.random()
        score_bound = rng.choice([0.0, 1.0, 1e3, 1e8]) * rng.random()
        # the smallest certain lead (near it), then a few ulps either side
        rounding = _ADD_ROUNDING * (score_bound + margin + abs(second))
        first = second + 2 * margin + rounding
        for _ in range(rng.randrange(0, 4)):
            first = math.nextafter(first, rng.choice([math.inf, -math.inf]))
        first = min(first, 0.0) if rng.random() < 0.9 else first
        args = (float(first), float(second), float(score_bound), float(margin))
        expected = lead_is_certain(*args)
        assert bool(kernel.lead_is_certain(*args)) == expected, args
        answers.add(expected)
    assert answers == {True, False}  # both sides of the boundary were met
    assert kernel.lead_is_certain(-1.0, -math.inf, 1e9, 1.0)
