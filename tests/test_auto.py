"""``--generator auto``: per row, the draft that pays at the iteration's prices, or none.

Outputs are compared with fairseq's ``SequenceGenerator`` (beam 1). Costs are counted in
verified positions per output token (1.0 for a greedy step), never timed: the tests give the
drafter fixed prices (``FixedPrices``) so that what it drafts does not depend on the machine."""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import (AutoDrafter, CopyDrafter, FixedPrices,
                                                          HeadsDrafter, LookupDrafter,
                                                          MeasuredPrices, NARDrafter, NoDrafter)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import (CPU_PRICES, IterationClock,
                                                                  draft_gain, paying_length)
from fairseq_pardec.decoding.registry import SPECS, DraftVerifyGenerator, ExactAcceptance

from helpers import (by_id, fairseq_greedy, make_dictionary, make_task, pooled, random_batch,
                     tiny_transformer)
from test_blockwise import blockwise_model
from test_gad import drafter_model
from test_speculative import (ALPHA, SETTINGS, chi_square_pvalue, fairseq_counts, one_source,
                              ours_counts, peaked)

# a plain iteration of R rows costs 2 + R positions, a drafting row half a position more
PRICES = dict(fixed=2.0, drafting_row=0.5)


def auto_generator(model, d, table=None, drafter_model=None, kind=None, prices=None, **kwargs):
    drafter = AutoDrafter(d, d, table, prices=prices or FixedPrices(**PRICES),
                          model=drafter_model, model_kind=kind)
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), backoff=False,
                                     **kwargs)
    drafter.stats = generator.stats
    return generator


def never_copying_model():
    """A random model whose output follows the position more than the tokens before it: it
    neither copies its source nor repeats its own output (lookup drafts are all rejected)."""
    d = make_dictionary(200)
    model = tiny_transformer(make_task(d), seed=2, decoder_learned_pos=True)
    with torch.no_grad():
        model.decoder.embed_tokens.weight.mul_(0.1)
        model.decoder.embed_positions.weight.mul_(20.0)
    return model, d


def sources(d, batch_size, seed):
    return random_batch(d, [6 + (i * 7) % 15 for i in range(batch_size)], seed=seed)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_random_model_equals_greedy(batch_size):
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=2)
    generator = auto_generator(model, d, max_len_a=1.2, max_len_b=10)
    for seed in range(3):
        sample = sources(d, batch_size, seed)
        expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_never_copying_model_costs_a_greedy_step(batch_size):
    """Where no draft is accepted, auto verifies about one position per token, as lean_greedy
    does (within 5%), and so do iad and lookup with priced drafts; the outputs are fairseq's."""
    model, d = never_copying_model()
    lookup = DraftVerifyGenerator([model], d, LookupDrafter(d, d, block_size=4),
                                  ExactAcceptance(), backoff=False, max_len_a=1.2, max_len_b=10)
    lean = DraftVerifyGenerator([model], d, NoDrafter(), ExactAcceptance(), max_len_a=1.2,
                                max_len_b=10)
    auto = auto_generator(model, d, max_len_a=1.2, max_len_b=10)
    priced = {name: DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.2,
                                         max_len_b=10)
              for name, drafter in (
                  ("iad", CopyDrafter(d, d, adaptive=True, prices=FixedPrices(**PRICES))),
                  ("lookup", LookupDrafter(d, d, adaptive=True, prices=FixedPrices(**PRICES))))}
    # iad and lookup as the command line builds them: adaptive caps at the CPU's prices, and
    # the engine's back-off
    command_line = {name: DraftVerifyGenerator([model], d, drafter, ExactAcceptance(),
                                               max_len_a=1.2, max_len_b=10)
                    for name, drafter in (("iad (cli)", CopyDrafter(d, d, adaptive=True)),
                                          ("lookup (cli)", LookupDrafter(d, d, adaptive=True)))}
    generators = dict(priced, **command_line, auto=auto, lean=lean)
    # what the drafters learn costs positions once, at the start: 16 sentences at batch 1, 64
    # at 8 and 64 rows, where a batch's rows try their first drafts at once
    for seed in range(max(1, (16 if batch_size == 1 else 64) // batch_size)):
        sample = sources(d, batch_size, 50 + seed)
        expected = by_id(sample, fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10))
        for generator in [lookup] + list(generators.values()):
            assert by_id(sample, generator.generate([model], sample)) == expected
    assert lookup.stats.tokens_per_iteration < 1.05  # the model (nearly) never copies
    cost = {name: g.stats.positions_verified / g.stats.target_tokens
            for name, g in generators.items()}
    assert cost["lean"] == 1.0
    assert cost["auto"] <= 1.05 * cost["lean"]
    assert cost["iad"] <= 1.05 * cost["lean"] and cost["lookup"] <= 1.05 * cost["lean"]
    assert cost["iad (cli)"] <= 1.05 * cost["lean"]
    assert cost["lookup (cli)"] <= 1.05 * cost["lean"]


@pytest.mark.parametrize("name", ["iad", "lookup", "auto"])
def test_a_drafter_that_drafts_nothing_is_not_asked(name):
    """At the CPU's prices no draft position pays from 8 active rows on: a batch of 32 decodes
    by plain steps without asking the drafter until fewer than 8 rows are left, which are then
    asked; the output is fairseq's."""
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=2)
    drafter = {"iad": CopyDrafter(d, d, adaptive=True),
               "lookup": LookupDrafter(d, d, adaptive=True),
               "auto": AutoDrafter(d, d, prices=CPU_PRICES)}[name]
    asked = []
    propose = drafter.propose

    def counting(state, view):
        asked.append(len(view.rows))
        return propose(state, view)

    drafter.propose = counting
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.2,
                                     max_len_b=10, backoff=name != "auto")
    sample = random_batch(d, [10 + (i * 7) % 25 for i in range(32)], seed=3)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
    assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
    # a batch of 8 rows or more starts quiet: asked only once fewer rows are left (on this
    # model most rows run to the batch's length limit together)
    assert max(asked, default=0) < 8
    assert generator.stats.decoder_calls > 10


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_copying_model_equals_greedy_and_drafts(copy_model, batch_size):
    model, d, make_sample = copy_model
    generator = auto_generator(model, d, max_len_a=1.0, max_len_b=10)
    for sample in pooled(make_sample, batch_size, first_seed=300 + batch_size):
        expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
    stats = generator.stats
    drafted = sum(n for name, n in stats.drafter_iterations.items() if name != "none")
    assert drafted > 0 and stats.tokens_per_iteration > 1.0
    if batch_size == 1:
        # an iteration's fixed part is most of its price: most row-iterations draft, and the
        # drafts pay, well over a token per iteration. At 8 and 64 rows a position costs a
        # tenth of an iteration or more, and only near-certain drafts pay
        assert drafted > 0.5 * sum(stats.drafter_iterations.values())
        assert stats.tokens_per_iteration > 2.0


def test_sampling_keeps_fairseqs_distribution():
    """The cheap drafts are one-hot q (test_speculative.py's harness: whole outputs of one short
    source, a chi-square test at the 0.1% level with fixed seeds)."""
    setting = SETTINGS[0]
    d = make_dictionary(5)
    verifier = peaked(tiny_transformer(make_task(d), seed=31))
    reference = fairseq_counts(verifier, d, one_source(d, 64), 3000, *setting)
    drafter = AutoDrafter(d, d, prices=MeasuredPrices())  # fixed by --sampling
    counts, stats = ours_counts(verifier, d, drafter, one_source(d, 16), 2000, *setting)
    assert isinstance(drafter.prices, FixedPrices)
    assert stats.tokens_per_iteration > 1.0  # drafts were accepted: the path was exercised
    assert chi_square_pvalue(reference, counts) > ALPHA


def test_paying_length_and_gain():
    # value 3 (batch 1, fixed 2), position 1: a token pays while rate^j >= 1/3
    assert paying_length(0.9, 3.0, 1.0, 0.0, 16) == 10  # 0.9^10 = 0.35, 0.9^11 = 0.31
    assert paying_length(0.9, 3.0, 1.0, 0.0, 4) == 4
    assert paying_length(0.3, 3.0, 1.0, 0.0, 16) == 0  # the first token does not pay
    # a drafting row's price must be paid by the whole draft
    gain = draft_gain(0.5, 3.0, 1.0, 1)
    assert gain == pytest.approx(0.5)
    assert paying_length(0.5, 3.0, 1.0, 0.4, 16) == 1
    assert paying_length(0.5, 3.0, 1.0, 0.6, 16) == 0


def test_measured_prices_learn_the_parts_of_an_iteration():
    """Iterations timed at T = 1 + 0.1 R + 0.2 E + 0.5 D (ms): the fit finds the prices."""
    ticks = []
    prices = MeasuredPrices(clock=lambda: ticks[-1])
    clock = IterationClock(prices)
    now = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        rows = 1
        extra = int(torch.randint(0, 9, (1,), generator=g))
        drafting = int(extra > 0)
        ticks.append(now)
        clock.tick(clock.now(), rows, extra, drafting)
        now += 1.0 + 0.1 * rows + 0.2 * extra + 0.5 * drafting
    value, position, drafting_row = prices.prices(1)
    assert value == pytest.approx(1.1, rel=0.05)
    assert position == pytest.approx(0.2, rel=0.1)
    assert drafting_row == pytest.approx(0.5, rel=0.1)


def test_auto_is_registered_greedy_only():
    spec = SPECS["auto"]
    assert spec.greedy_only and spec.family == "draft_verify"


@pytest.mark.parametrize("batch_size", [1, 8])
def test_with_proposal_heads_equals_greedy(batch_size):
    """The model's proposal heads join the cheap drafters (a drafter model that costs nothing
    here, so that rows take its drafts); the output stays fairseq's."""
    d = make_dictionary(30)
    model = blockwise_model(make_task(d), heads=4, seed=3)
    heads = HeadsDrafter(model.decoder, d.pad(), 4)
    generator = auto_generator(model, d, drafter_model=heads, kind="blockwise",
                               prices=FixedPrices(model=0.0), max_len_a=1.2, max_len_b=10)
    for seed in range(2):
        sample = sources(d, batch_size, 70 + seed)
        expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
    assert "blockwise" in generator.stats.drafter_iterations


@pytest.mark.parametrize("batch_size", [1, 8])
def test_with_a_gad_drafter_equals_greedy(batch_size):
    d = make_dictionary(30)
    task = make_task(d)
    model = tiny_transformer(task, seed=4)
    gad = NARDrafter(drafter_model(task, k=3, seed=5), 3, d.eos(), d.pad())
    generator = auto_generator(model, d, drafter_model=gad, kind="gad",
                               prices=FixedPrices(model=0.0), max_len_a=1.2, max_len_b=10)
    for seed in range(2):
        sample = sources(d, batch_size, 80 + seed)
        expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
    assert "gad" in generator.stats.drafter_iterations


def test_sampling_with_heads_keeps_fairseqs_distribution():
    """Rows drafting from the heads carry the heads' q, the others one-hot: speculative
    sampling still draws from fairseq's distribution."""
    setting = SETTINGS[0]
    d = make_dictionary(5)
    model = peaked(blockwise_model(make_task(d), heads=3, seed=4))
    reference = fairseq_counts(model, d, one_source(d, 64), 4000, *setting)
    drafter = AutoDrafter(d, d, prices=FixedPrices(model=0.0),
                          model=HeadsDrafter(model.decoder, d.pad(), 3), model_kind="blockwise")
    counts, _ = ours_counts(model, d, drafter, one_source(d, 16), 2000, *setting)
    assert chi_square_pvalue(reference, counts) > ALPHA
