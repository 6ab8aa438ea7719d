"""The IAD copy drafter's matching rule, dictionary mapping and draft caps."""

import math

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import CopyDrafter, SourceVocabularyMap
from fairseq_pardec.decoding.draft_verify.drafters.base import (AcceptanceHistory, AdaptiveCaps,
                                                                DraftOutcome, DraftView,
                                                                ProbeSchedule)
from fairseq_pardec.decoding.draft_verify.drafters.pricing import CPU_PRICES, FixedPrices
from fairseq_pardec.decoding.draft_verify.drafters.schedule import DraftSchedule

from fairseq_pardec.decoding.draft_verify.drafters.base import Drafter
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance

from helpers import by_id, collate, fairseq_greedy, make_dictionary


def drafter_for(source_words, d, block_size=None, tgt=None, adaptive=False):
    """A copy drafter started on one sentence, and the batch's state."""
    drafter = CopyDrafter(d, tgt or d, block_size, adaptive=adaptive)
    src = torch.tensor([d.index(w) for w in source_words] + [d.eos()])
    return drafter, drafter.start(collate(d, [src]), None, d.eos())


def propose(started, d, output_words, limit=100, tgt=None):
    drafter, state = started
    tgt = tgt or d
    toks = torch.tensor([[tgt.eos()] + [tgt.index(w) for w in output_words]])
    draft = drafter.propose(state, DraftView([0], [len(output_words)], [limit], toks))[0]
    return [tgt[i] for i in draft]


def test_initial_draft_is_whole_source_with_eos():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w2", "w3"], d)
    assert propose(started, d, []) == ["w1", "w2", "w3", "</s>"]


def test_unique_suffix_match_and_block_size():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w2", "w3", "w4", "w5"], d)
    # output diverged ("w9" inserted) then returned to the source at w3
    assert propose(started, d, ["w1", "w9", "w3"]) == ["w4", "w5", "</s>"]
    assert propose(started, d, ["w1", "w9", "w3"], limit=2) == ["w4", "w5"]
    capped = drafter_for(["w1", "w2", "w3", "w4", "w5"], d, block_size=1)
    assert propose(capped, d, ["w1", "w9", "w3"]) == ["w4"]


def test_no_occurrence_gives_no_draft():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w2"], d)
    assert propose(started, d, ["w7"]) == []


def test_ambiguous_token_disambiguated_by_longer_suffix():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w0", "w2", "w3", "w0", "w4"], d)
    assert propose(started, d, ["w1", "w0"]) == ["w2", "w3", "w0", "w4", "</s>"]
    assert propose(started, d, ["w1", "w0", "w2", "w3", "w0"]) == ["w4", "</s>"]


def test_ambiguous_everywhere_prefers_occurrence_after_previous_match():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w0", "w2", "w0", "w3"], d)
    assert propose(started, d, ["w1"]) == ["w0", "w2", "w0", "w3", "</s>"]  # matched at 1
    # "w9 w0" is ambiguous at every length: take the first w0 at or after the last match
    assert propose(started, d, ["w1", "w0", "w2", "w9", "w0"]) == ["w3", "</s>"]


def test_separate_dictionaries_map_by_string_and_skip_unknown():
    src = make_dictionary(20)
    src.add_symbol("src_only")
    tgt = make_dictionary(20)
    mapping = SourceVocabularyMap(src, tgt)
    ids = torch.tensor([src.index("w3"), src.index("src_only"), src.eos()])
    assert mapping(ids).tolist() == [tgt.index("w3"), -1, tgt.eos()]
    drafter = CopyDrafter(src, tgt)
    s = torch.tensor([src.index("w1"), src.index("w2"), src.index("src_only"), src.index("w3"), src.eos()])
    state = drafter.start(collate(src, [s], tgt_dict=tgt), None, tgt.eos())
    # the token the target lacks is left out; copying goes on after it
    assert propose((drafter, state), src, [], tgt=tgt)[:3] == ["w1", "w2", "w3"]


def test_adaptive_cap_follows_each_rows_acceptance():
    d = make_dictionary(20)
    started = drafter_for(["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"], d, block_size=6,
                          adaptive=True)
    drafter, state = started
    assert propose(started, d, []) == ["w1", "w2", "w3", "w4", "w5", "w6"]  # no history: the cap
    drafter.observe(state, DraftOutcome([0], [0]))  # first draft token rejected
    assert propose(started, d, ["w9"]) == []  # w9 is not in the source: no draft, no update
    drafter.observe(state, DraftOutcome([0], [0]))
    assert state.schedule.caps["copy"].mean[0] == 0
    assert propose(started, d, ["w9", "w2"]) == ["w3"]  # 2 * 0 + 1
    drafter.observe(state, DraftOutcome([0], [1]))  # accepted: mean 0.5 -> cap 2
    assert propose(started, d, ["w9", "w2", "w3"]) == ["w4", "w5"]
    drafter.observe(state, DraftOutcome([0], [2]))  # mean 1.25 -> cap 3
    assert propose(started, d, ["w9", "w2", "w3", "w4", "w5"]) == ["w6", "w7", "w8"]
    # a fixed --block-size is the user's: no adaptation
    fixed, fixed_state = drafter_for(["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"], d,
                                     block_size=6)
    fixed.observe(fixed_state, DraftOutcome([0], [0]))
    assert propose((fixed, fixed_state), d, ["w9", "w2"]) == ["w3", "w4", "w5", "w6", "w7", "w8"]


class FullBufferCopyDrafter(CopyDrafter):
    """The rule reading each row's whole output from the buffer every call (the reference)."""

    @staticmethod
    def _read_new_tokens(state, row_ids, tokens, n_out):
        for i, (row, n) in enumerate(zip(row_ids, n_out)):
            state.outputs[row] = tokens[i, : n + 1].tolist()


def test_incremental_reading_proposes_the_full_buffer_rules_drafts():
    """Random batches, random accepted prefixes (copies and rewrites), rows leaving the batch."""
    d = make_dictionary(12)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        bsz = 6
        sources = [torch.randint(4, len(d), (int(torch.randint(1, 15, (1,), generator=g)),),
                                 generator=g) for _ in range(bsz)]
        sample = collate(d, [torch.cat([s, torch.tensor([d.eos()])]) for s in sources])
        adaptive = trial % 2 == 0
        ours, ref = CopyDrafter(d, d, adaptive=adaptive), FullBufferCopyDrafter(d, d, adaptive=adaptive)
        states = {drafter: drafter.start(sample, None, d.eos()) for drafter in (ours, ref)}
        rows = list(range(bsz))
        tokens = torch.full((bsz, 40), d.pad())
        tokens[:, 0] = d.eos()
        n_out = [0] * bsz
        while rows and max(n_out) < 30:
            room = [30 - n for n in n_out]
            a = ours.propose(states[ours], DraftView(rows, n_out, room, tokens))
            b = ref.propose(states[ref], DraftView(rows, n_out, room, tokens))
            assert a == b
            # accept a random prefix of each draft, then one token of the "verifier"
            acc = [int(torch.randint(0, len(draft) + 1, (1,), generator=g)[0]) for draft in a]
            for i in range(len(rows)):
                new = a[i][: acc[i]] + [int(torch.randint(4, len(d), (1,), generator=g))]
                tokens[i, n_out[i] + 1: n_out[i] + 1 + len(new)] = torch.tensor(new)
                n_out[i] += len(new)
            for drafter in (ours, ref):
                drafter.observe(states[drafter], DraftOutcome(rows, acc))
            alive = (torch.rand(len(rows), generator=g) > 0.15).tolist()
            rows = [r for r, keep in zip(rows, alive) if keep]
            n_out = [n for n, keep in zip(n_out, alive) if keep]
            tokens = tokens[torch.tensor(alive, dtype=torch.bool)]


def test_cpu_ceiling_shrinks_with_the_active_rows():
    d = make_dictionary(12)
    drafter, state = drafter_for(["w1", "w2"], d)
    assert [drafter._ceiling(state, b) for b in (1, 4, 8, 11, 32)] == [16, 16, 8, 6, 6]
    fixed, fixed_state = drafter_for(["w1"], d, block_size=3)
    assert fixed._ceiling(fixed_state, 32) == 3  # --block-size: fixed
    state.on_cpu = False
    # GPU: a longer block is about as cheap, but the log-probs it holds are not: a budget of
    # positions per iteration bounds the first block (no history yet) of a wide batch; each
    # ceiling is 2^k - 1 drafts, so that with the row's last token a block fills its bucket of
    # the CUDA step's graphs (16 drafts would run 17 columns on 32)
    assert [drafter._ceiling(state, b) for b in (1, 3, 64, 100, 1000)] == [2047, 511, 31, 15, 15]


def test_generate_time_refusals_name_the_generator():
    import argparse

    import pytest

    from fairseq_pardec.decoding.registry import GENERATORS

    from helpers import make_task, random_batch, tiny_transformer

    d = make_dictionary(20)
    task = make_task(d)
    model = tiny_transformer(task)
    args = argparse.Namespace(beam=1, max_len_a=1.0, max_len_b=5)
    generator = GENERATORS["iad"](task, [model], args)
    with pytest.raises(ValueError, match="--generator iad does not support --constraints"):
        generator.generate([model], random_batch(d, [3]), constraints=torch.zeros(1, 1))


def test_a_row_drafts_what_pays_and_probes_after_its_wait():
    """A row drafts the longest length whose last position is still accepted with the
    probability at which a position pays (here 0.5, then 0.9 of a token's value), from its
    estimated per-position rate; a row left at no draft probes with one token after PROBE_AFTER
    iterations, then after twice as long while its probes fail; where not even a certain token
    pays it rests and never probes."""
    schedule = DraftSchedule(1)
    schedule.plan_drafts(["copy"], {}, None, FixedPrices(1.0, 1.0), adaptive=True)

    def length_at(threshold):  # a position priced at ``threshold`` of a token (value 2)
        schedule.prices = FixedPrices(fixed=1.0, position=2.0 * threshold)
        plans = schedule.plan([0], [10 ** 6])
        return plans[0][0][2] if plans else 0

    def kept(drafted, accepted):
        schedule.chosen[0] = ("copy", drafted)
        schedule.verified([0], [accepted])

    caps = schedule.caps["copy"]
    rate = caps.acceptance_rate(0)
    assert rate == pytest.approx(0.95)  # the prior
    assert length_at(0.5) == int(math.log(0.5) / math.log(rate))
    kept(4, 1)  # one token accepted, then a rejection
    rate = caps.acceptance_rate(0)
    assert rate == pytest.approx(1.95 / 3.0)
    assert length_at(0.5) == 1  # log 0.5 / log 0.65 = 1.6 (mean 1: cap 3)
    assert length_at(0.9) == 0
    assert schedule.probes.quiet_for([0]) == AdaptiveCaps.PROBE_AFTER - 1  # no draft until...
    waits = [length_at(0.9) for _ in range(AdaptiveCaps.PROBE_AFTER)]
    assert waits == [0] * (AdaptiveCaps.PROBE_AFTER - 1) + [1]  # ...the probe
    # a failed probe doubles the wait for the next one; iterations not asked count towards it
    kept(1, 0)
    schedule.skipped = 2 * AdaptiveCaps.PROBE_AFTER - 1
    assert length_at(0.9) == 0 and length_at(0.9) == 1
    # where not even a certain token pays, the schedule rests for good: no probe ever comes
    assert [length_at(1.2) for _ in range(200)] == [0] * 200
    assert schedule.quiet.remaining == math.inf
    kept(1, 1)  # an accepted probe: the row drafts again
    # a row whose drafts (probes first) keep being accepted drafts longer and longer
    lengths = []
    for _ in range(60):
        length = length_at(0.9)
        lengths.append(length)
        if length:
            kept(length, length)
    drafts = [n for n in lengths if n > 0]
    assert drafts == sorted(drafts) and drafts[-1] > 4


def test_probe_waits_double_while_probes_fail_and_start_over_when_one_is_kept():
    """A row that drafts nothing probes after 8 iterations, then after 16, 32 and every 64 while
    its probes fail; a kept draft token starts the waits over; with a history a fresh row waits
    as long as the last probing row did."""
    history = AcceptanceHistory()
    probes = ProbeSchedule(2, history)

    def wait_for_probe(row):
        waited = 1
        while not probes.probes_now(row):
            waited += 1
        return waited

    waits = []
    for _ in range(5):
        waits.append(wait_for_probe(0))
        probes.verified(0, kept=0)
    assert waits == [9, 17, 33, 65, 65]  # the probe comes after the wait's last iteration
    assert history.probe_wait == ProbeSchedule.LONGEST_PROBE_WAIT
    assert ProbeSchedule(1, history).wait == [ProbeSchedule.LONGEST_PROBE_WAIT]
    # row 1 probes and keeps a token: its waits start over, and so do a fresh row's
    assert wait_for_probe(1) == 9
    probes.verified(1, kept=1)
    assert probes.wait[1] == ProbeSchedule.PROBE_AFTER
    assert ProbeSchedule(1, history).wait == [ProbeSchedule.PROBE_AFTER]
    # a row that drafts restarts its count; iterations not asked count towards the probe
    probes.drafted(1)
    assert probes.quiet_for([1]) == ProbeSchedule.PROBE_AFTER
    probes.skip(3)
    assert probes.quiet_for([1]) == ProbeSchedule.PROBE_AFTER - 3
    assert probes.quiet_for([0, 1], limits=[0, 0]) == math.inf  # rows that cannot draft


def test_cpu_price_of_a_position_grows_with_the_active_rows():
    """On the CPU an adaptive drafter drafts what pays at CPU_PRICES for R active rows: a fresh
    row drafts long at batch 1 (to where CPU_PRICES.threshold(1) is reached) and not at all from
    8 rows (not even a probe: no position pays there), and the schedule then rests while 8 rows
    or more are left; without prices the caps follow acceptance alone."""
    schedule = DraftSchedule(32)
    schedule.plan_drafts(["copy"], {}, None, CPU_PRICES, adaptive=True)
    rows, limits = list(range(32)), [100] * 32
    [[(_, kind, one)]] = schedule.plan(rows[:1], limits[:1])
    assert (kind, one) == ("copy", int(math.log(CPU_PRICES.threshold(1)) / math.log(0.95)))
    assert CPU_PRICES.threshold(8) >= 1.0 > CPU_PRICES.threshold(7)
    assert schedule.plan(rows, limits) is None  # nothing pays at 32 rows
    spell = schedule.quiet
    assert (spell.rows, spell.fewest, spell.remaining) == (32, 8, math.inf)
    # the engine need not ask while 8 rows or more are left, whatever the iteration
    for active in (32, 31, 20, 8):
        for iteration in range(3 * AdaptiveCaps.LONGEST_PROBE_WAIT):
            assert not schedule.drafts_now(active, iteration)
    assert schedule.drafts_now(7, 0) and schedule.quiet is None
    # the iterations not asked count towards the rows' probes
    assert schedule.skipped == 4 * 3 * AdaptiveCaps.LONGEST_PROBE_WAIT
    acceptance_alone = DraftSchedule(32)
    acceptance_alone.plan_drafts(["copy"], {}, None, None, adaptive=True)
    assert acceptance_alone.plan(rows, limits) == [[(0.0, "copy", 100)]] * 32


class OracleDrafter(Drafter):
    """Drafts fairseq greedy's own continuation, EOS included, and records what the engine
    reports kept."""

    def __init__(self, outputs):
        self.outputs, self.drafted, self.kept = outputs, {}, []

    def propose(self, state, view):
        drafts = [self.outputs[r][n: n + k] for r, n, k in zip(view.rows, view.n_out, view.room)]
        self.drafted = dict(zip(view.rows, drafts))
        return drafts

    def observe(self, state, outcome):
        self.kept += [(self.drafted[r], k) for r, k in zip(outcome.rows, outcome.accepted)]


@pytest.mark.trains
def test_a_draft_accepted_up_to_its_eos_is_observed_whole(copy_model):
    """The drafter is told every accepted draft token, also where the draft ends in EOS and
    the verifier adds none of its own (the count was one short, booked as a rejection)."""
    model, d, make_sample = copy_model
    sample = make_sample(6, seed=3)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=30)
    drafter = OracleDrafter([h[0]["tokens"].tolist() for h in expected])
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.0,
                                     max_len_b=30, backoff=False)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, expected)
    assert drafter.kept and all(k == len(draft) for draft, k in drafter.kept)
    assert any(draft and draft[-1] == d.eos() for draft, _ in drafter.kept)
