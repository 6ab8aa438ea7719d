"""Rows join a running batch between iterations and leave it when finished or cancelled
(``DraftVerifyGenerator.open / join / iterate / leave``): each row's output is the one
``fairseq-generate --beam 1 --batch-size 1`` gives its sentence, whoever shares its iterations.

Schedules are random (seeded): at each iteration a few sentences may join, a running row may be
cancelled (and its sentence sent again later), and the rows that finish are compared with stock
fairseq greedy on that sentence alone."""

import random

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import (AutoDrafter, CopyDrafter, FixedPrices,
                                                          LookupDrafter, NoDrafter)
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.errors import UsageError

from helpers import collate, fairseq_greedy, make_dictionary, make_task, tiny_transformer

LIMITS = dict(max_len_a=1.2, max_len_b=10)


def drafter_named(name, d):
    return {"lean_greedy": lambda: NoDrafter(),
            "iad": lambda: CopyDrafter(d, d),
            "lookup": lambda: LookupDrafter(d, d, adaptive=True),
            "auto": lambda: AutoDrafter(d, d, prices=FixedPrices(fixed=2.0, drafting_row=0.5)),
            }[name]()


def generator_for(model, d, name, **kwargs):
    drafter = drafter_named(name, d)
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), **LIMITS, **kwargs)
    if isinstance(drafter, AutoDrafter):
        drafter.stats = generator.stats
    return generator


def random_model(words, seed):
    """A dictionary of ``words`` words and a tiny random transformer on it."""
    d = make_dictionary(words)
    return d, tiny_transformer(make_task(d), seed=seed)


def alone(model, d, sources):
    """Each sentence decoded alone by fairseq's SequenceGenerator (beam 1)."""
    return [fairseq_greedy(model, d, collate(d, [s]), **LIMITS)[0][0] for s in sources]


def run_schedule(generator, d, sources, seed, cancel_rate=0.05, most_joining=3, ahead=False):
    """Decode ``sources`` through one running batch on a random schedule; returns
    {sentence index: hypothesis} and the most rows that ran together. ``ahead``: the joiners
    are taken, in a random order, from one encoder call over them and up to five sentences
    more (a server's prepared rows: their padding and their neighbours differ)."""
    rng = random.Random(seed)
    waiting = list(range(len(sources)))
    done, running, widest = {}, {}, 0  # running: row id -> sentence index
    joined_running = 0  # joins into a batch that had run
    batch = None
    while waiting or running:
        if waiting and (not running or rng.random() < 0.6):
            joining = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(1, most_joining)))]
            sample, encoder_out, projected = collate(d, [sources[i] for i in joining]), None, None
            # the collater orders by length: its ids say which sentence each row is
            order = sample["id"].tolist()
            if ahead:
                group = joining + rng.sample(range(len(sources)), min(5, len(sources)))
                encoded = generator.encode_rows(collate(d, [sources[i] for i in group]))
                place = {index: position for position, index in
                         enumerate(encoded.sample["id"].tolist())}
                order = list(range(len(joining)))
                rng.shuffle(order)
                sample, encoder_out, projected = encoded.take([place[i] for i in order])
                # the fast step projects their sources ahead, the lean step at the join
                assert (projected is not None) == generator.block_decoder.fast
            if batch is None or not batch.rows_host:
                batch = generator.open(sample, encoder_out)
                ids = list(range(len(order)))
            else:
                ids = generator.join(batch, sample, encoder_out, projected)
            for row, position in zip(ids, order):
                running[row] = joining[position]
            joined_running += bool(running) and len(batch.rows_host) > len(ids)
        if running and rng.random() < cancel_rate:
            row = rng.choice(sorted(running))
            generator.leave(batch, [row])
            waiting.append(running.pop(row))  # sent again later, from its start
        if not running:
            continue
        widest = max(widest, len(batch.rows_host))
        for row in generator.iterate(batch):
            done[running.pop(row)] = batch.finalized[row][0]
    assert joined_running > 0
    return done, widest


def check_identical(done, expected):
    assert sorted(done) == list(range(len(expected)))
    for i, hypo in done.items():
        assert hypo["tokens"].tolist() == expected[i]["tokens"].tolist(), "sentence %d" % i
        assert torch.allclose(hypo["positional_scores"], expected[i]["positional_scores"],
                              atol=1e-4)


def random_sources(d, count, seed, lo=2, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(d.nspecial, len(d), (int(n),), generator=g),
                       torch.tensor([d.eos()])])
            for n in torch.randint(lo, hi, (count,), generator=g)]


@pytest.mark.parametrize("name", ["lean_greedy", "iad", "lookup", "auto"])
@pytest.mark.parametrize("seed, step, ahead", [(0, "fast", False), (1, "fast", False),
                                               (2, "lean", False), (3, "fast", True),
                                               (4, "lean", True)])
def test_random_model_random_schedule_equals_greedy_alone(name, seed, step, ahead):
    d, model = random_model(40, seed=seed)
    sources = random_sources(d, 24, seed)
    generator = generator_for(model, d, name, fast=step == "fast")
    assert type(generator.block_decoder).__name__ == {"fast": "FastBlockDecoder",
                                                      "lean": "LeanBlockDecoder"}[step]
    done, widest = run_schedule(generator, d, sources, seed, ahead=ahead)
    check_identical(done, alone(model, d, sources))
    assert widest > 3  # rows did share iterations


@pytest.mark.trains
@pytest.mark.parametrize("name, ahead", [("lean_greedy", False), ("iad", False),
                                         ("lookup", False), ("auto", False), ("iad", True),
                                         ("auto", True)])
def test_trained_model_random_schedule_equals_greedy_alone(copy_model, name, ahead):
    model, d, make_sample = copy_model
    sample = make_sample(24, seed=321)
    tokens, pad = sample["net_input"]["src_tokens"], d.pad()
    sources = [row[row.ne(pad)] for row in tokens]
    generator = generator_for(model, d, name)
    done, _ = run_schedule(generator, d, sources, seed=7, most_joining=4, ahead=ahead)
    check_identical(done, alone(model, d, sources))
    stats = generator.stats
    if name != "lean_greedy":  # rows that joined draft too
        assert stats.positions_verified > stats.row_iterations
    if name == "iad":  # (the priced drafters draft little where many rows share an iteration)
        tokens = sum(len(hypo["tokens"]) for hypo in done.values())
        assert tokens > 1.3 * stats.row_iterations


@pytest.mark.trains
@pytest.mark.parametrize("name, ahead", [("lean_greedy", False), ("lookup", False),
                                         ("lookup", True)])
def test_every_decision_replayed_on_the_rows_own_sentence(copy_model, name, ahead):
    """A margin that makes every choice a close call hands each one to fairseq's arithmetic on
    the row's own sentence alone: a row that joined must replay its own source."""
    model, d, make_sample = copy_model
    sample = make_sample(10, seed=99)
    tokens, pad = sample["net_input"]["src_tokens"], d.pad()
    sources = [row[row.ne(pad)] for row in tokens]
    generator = generator_for(model, d, name, margin=1e9)
    done, _ = run_schedule(generator, d, sources, seed=3, ahead=ahead)
    check_identical(done, alone(model, d, sources))
    assert generator.stats.close_calls > 0


def test_row_ids_are_taken_again_once_released():
    d, model = random_model(30, seed=5)
    generator = generator_for(model, d, "lean_greedy")
    sources = random_sources(d, 6, seed=5, lo=2, hi=6)
    batch = generator.open(collate(d, sources[:2]))
    finished = []
    while batch.rows_host:
        finished += generator.iterate(batch)
    batch.release(finished)
    ids = generator.join(batch, collate(d, sources[2:5]))
    assert sorted(ids[:2]) == [0, 1] and ids[2] == 2


def test_module_step_refuses_joining_in_one_line():
    d, model = random_model(30, seed=5)
    generator = generator_for(model, d, "lean_greedy", lean=False, fast=False)
    with pytest.raises(UsageError, match="running batch"):
        generator.open(collate(d, random_sources(d, 2, seed=1)))


class _Served:
    """What the server's running batch reads of its LoadedModel: the generator and batching."""

    def __init__(self, generator, d):
        self.generator, self.d = generator, d

    def batch(self, sources):
        return collate(self.d, sources)


def test_the_servers_batch_takes_rows_at_every_iteration():
    from fairseq_pardec.serve.running_batch import IterationBatch, Row, running_batch_for

    d, model = random_model(40, seed=11)
    sources = random_sources(d, 9, seed=11, lo=8, hi=20)
    served = _Served(generator_for(model, d, "iad"), d)
    batch = running_batch_for(served, capacity=4, batching="join")
    assert isinstance(batch, IterationBatch)
    rows = [Row(source=s, job=None, index=i) for i, s in enumerate(sources)]
    waiting, finished, steps = list(rows), [], 0
    while waiting or batch.running():
        free = batch.capacity - batch.running()
        if waiting and free:  # one row at a time: each joins a batch that is running
            batch.admit([waiting.pop(0)])
        report = batch.step()
        steps += 1
        finished += report.finished
        assert batch.running() <= batch.capacity
    assert sorted(r.index for r in finished) == list(range(9))
    expected = alone(model, d, sources)
    for row in finished:
        assert row.hypotheses[0]["tokens"].tolist() == expected[row.index]["tokens"].tolist()
    # rows joined while others ran: fewer steps than decoding them one after the other
    assert steps < sum(len(e["tokens"]) for e in expected)


def test_rows_admitted_past_the_places_are_encoded_together_and_join_as_places_free():
    from fairseq_pardec.serve.running_batch import Row, running_batch_for

    d, model = random_model(40, seed=11)
    sources = random_sources(d, 11, seed=12, lo=3, hi=20)
    generator = generator_for(model, d, "iad")
    # what the engine is handed: rows encoded together, and whether a join brings its encoding
    encode_rows, join, encoded, brought = generator.encode_rows, generator.join, [], []

    def counted(sample):
        encoded.append(sample["net_input"]["src_tokens"].size(0))
        return encode_rows(sample)

    def joined(running, sample, encoder_out=None, sources=None):
        brought.append((encoder_out is not None, sample["net_input"]["src_tokens"].size(0)))
        assert (sources is not None) == (encoder_out is not None)  # the fast step's, ahead
        return join(running, sample, encoder_out, sources)

    generator.encode_rows, generator.join = counted, joined
    batch = running_batch_for(_Served(generator, d), capacity=3, batching="join")
    assert batch.room() == 3 + batch.prepare == 6
    rows = [Row(source=s, job=None, index=i) for i, s in enumerate(sources)]
    batch.admit(rows[:6])  # three join, three are prepared: one encoder call for six
    assert encoded == [6] and batch.prepared() == 3 and batch.room() == 0
    batch.cancel(rows[4])  # a prepared row's request went away: it never joins
    waiting, finished = rows[6:], []
    while waiting or batch.running():
        room = batch.room()
        if waiting and room:
            batch.admit([waiting.pop(0) for _ in range(min(room, len(waiting)))])
        finished += batch.step().finished
        assert batch.running() - batch.prepared() <= batch.capacity
    assert sorted(r.index for r in finished) == [i for i in range(11) if i != 4]
    # every prepared row joined with the encoding made for it (the first three opened the
    # batch, one was cancelled), and the rows admitted into free places were encoded as they
    # joined
    ahead = sum(rows for given, rows in brought if given)
    assert ahead == sum(encoded) - 3 - 1
    assert sum(rows for given, rows in brought if not given) == 11 - sum(encoded)
    expected = alone(model, d, sources)
    for row in finished:
        assert row.hypotheses[0]["tokens"].tolist() == expected[row.index]["tokens"].tolist()


def test_the_server_decodes_in_rounds_where_rows_cannot_join(caplog):
    from fairseq_pardec.serve.running_batch import RoundBatch, running_batch_for

    d, model = random_model(30, seed=5)
    served = _Served(generator_for(model, d, "lean_greedy", lean=False, fast=False), d)
    with caplog.at_level("INFO", logger="fairseq_pardec.serve"):
        assert isinstance(running_batch_for(served, 4, "join"), RoundBatch)
    assert "rows join between rounds" in caplog.text
    served = _Served(generator_for(model, d, "lean_greedy"), d)
    assert isinstance(running_batch_for(served, 4, "buffer"), RoundBatch)


def test_every_step_is_what_the_protocols_declare():
    from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
    from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
    from fairseq_pardec.decoding.step.interface import DecoderStep, DrafterStep
    from fairseq_pardec.decoding.step.lean import LeanBlockDecoder

    d = make_dictionary(20)
    decoder = tiny_transformer(make_task(d), seed=1).decoder
    for step in (BlockDecoder(decoder), LeanBlockDecoder(decoder), FastBlockDecoder(decoder)):
        assert isinstance(step, DecoderStep)
    assert not BlockDecoder(decoder).joins_rows
    for step in (LeanBlockDecoder(decoder), FastBlockDecoder(decoder)):
        assert isinstance(step, DrafterStep) and step.joins_rows


@pytest.mark.parametrize("step", ["fast", "lean"])
def test_rows_join_before_the_first_iteration_and_after_rows_left(step):
    """Joins before the batch's first call (its cache then projects every row's encoder output
    at once) and after rows left (their places taken by the last rows)."""
    d, model = random_model(40, seed=4)
    sources = random_sources(d, 12, seed=4, lo=2, hi=25)
    generator = generator_for(model, d, "iad", fast=step == "fast")
    first = collate(d, sources[:4])
    batch = generator.open(first)
    running = dict(zip(range(4), first["id"].tolist()))
    second = collate(d, sources[4:7])
    for row, position in zip(generator.join(batch, second), second["id"].tolist()):
        running[row] = 4 + position
    done, rest = {}, list(range(7, 12))
    while running:
        for row in generator.iterate(batch):
            done[running.pop(row)] = batch.finalized[row][0]
            batch.release([row])
        if rest and len(running) < 6:
            joining = [rest.pop(0), rest.pop(0)] if len(rest) > 1 else [rest.pop(0)]
            sample = collate(d, [sources[i] for i in joining])
            for row, position in zip(generator.join(batch, sample), sample["id"].tolist()):
                running[row] = joining[position]
    check_identical(done, alone(model, d, sources))


def test_a_running_batch_keeps_no_encoder_output_of_the_rows_it_served():
    d, model = random_model(30, seed=6)
    generator = generator_for(model, d, "lean_greedy")
    sources = random_sources(d, 8, seed=6, lo=4, hi=10)
    batch = generator.open(collate(d, sources[:2]))
    generator.iterate(batch)
    for source in sources[2:]:
        generator.join(batch, collate(d, [source]))
        generator.iterate(batch)
    assert batch._encoder_out_all is None
    with pytest.raises(RuntimeError, match="keeps none"):
        batch.encoder_out
