"""The static step's memory on the CPU (cuda/static.py, cuda/slot_pool.py, cuda/cuda_graphs.py):
buffers sized once from the length limit, blocks that fill their bucket, a least-recently-used
budget of slots and graphs, and out of memory during a capture, with the capture stubbed (a
stub "graph" replays by running the call again into the outputs it recorded, the fixed
addresses a CUDA graph writes)."""

import contextlib
import logging

import pytest
import torch

from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.cuda import cuda_graphs
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.cuda.cuda_graphs import GraphSet, Recorded
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.cuda.slot_pool import SlotBudget
from fairseq_pardec.decoding.cuda.static import (StaticBlockDecoder, block_bucket, capacity_for,
                                                draft_cap_for_bucket)

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_engine_lossless import RandomDrafter


class _StubGraph:
    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs

    def replay(self):
        for recorded, fresh in zip(self.outputs, self.fn()):
            recorded.copy_(fresh)


class StubGraphSet(GraphSet):
    """A graph set that records on the CPU. ``failures``: errors the next captures raise, in
    order; ``captures``: how many captures succeeded (all sets)."""

    failures = []
    captures = 0
    graph_bytes = 0

    def _possible(self) -> bool:
        return True

    def _device_scope(self):
        return contextlib.nullcontext()

    def _capture(self, fn):
        fn()  # the warm-up
        if StubGraphSet.failures:
            raise StubGraphSet.failures.pop(0)
        outputs = fn()
        StubGraphSet.captures += 1
        return Recorded(_StubGraph(fn, outputs), outputs, StubGraphSet.graph_bytes)


class StubbedStep(StaticBlockDecoder):
    graph_set = StubGraphSet


@pytest.fixture(autouse=True)
def fresh_stub():
    StubGraphSet.failures, StubGraphSet.captures, StubGraphSet.graph_bytes = [], 0, 0
    yield


def _model(seed=70):
    d = make_dictionary(40)
    return d, tiny_transformer(make_task(d), seed=seed)


def _encoder_out(model, d, lengths, seed):
    sample = random_batch(d, lengths, seed=seed)
    return model.encoder.forward_torchscript(sample["net_input"])


def _blocks(step, enc, rows, widths, seed, state=None, keep_all=False):
    """Feed blocks of ``widths`` (ragged: each row keeps a random share, rolled back); the
    features of every block, padding zeroed."""
    g = torch.Generator().manual_seed(seed)
    state = step.new_state() if state is None else state
    start = torch.zeros(rows, dtype=torch.long)
    out = []
    with torch.no_grad():
        for width in widths:
            lens = torch.randint(1, width + 1, (rows,), generator=g)
            block = torch.randint(4, 40, (rows, width), generator=g)
            pad = torch.arange(width).unsqueeze(0) >= lens.unsqueeze(1)
            x = step.forward_block(block, start, pad, enc, state)
            out.append(x.masked_fill(pad.unsqueeze(-1), 0.0))
            keep = lens if keep_all else torch.stack(
                [torch.randint(1, int(n) + 1, (1,), generator=g)[0] for n in lens])
            step.rollback(state, width, keep, keep_range=(int(keep.min()), int(keep.max())))
            start = start + keep
    return out, state


def test_draft_cap_fills_the_block_bucket():
    assert [draft_cap_for_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 100)] == \
        [0, 1, 1, 3, 3, 7, 7, 15, 15, 31, 31, 63]
    for limit in range(1, 200):
        cap = draft_cap_for_bucket(limit)
        assert cap <= limit and block_bucket(cap + 1) == cap + 1  # the block fills its bucket
        # and no larger draft up to the limit fills one
        assert all(block_bucket(n + 1) != n + 1 for n in range(cap + 1, limit + 1))


def test_capacity_keeps_a_spare_entry():
    assert [capacity_for(n) for n in (0, 1, 62, 63, 64, 127, 128, 201)] == \
        [64, 64, 64, 64, 128, 128, 256, 256]


def test_new_state_reserves_the_length_limit():
    d, model = _model()
    enc = _encoder_out(model, d, [6, 3], seed=15)
    step = StaticBlockDecoder(model.decoder)
    state = step.new_state(max_len=200)  # BOS and 200 tokens: 201 entries
    with torch.no_grad():
        step.forward_block(torch.full((2, 1), d.eos()), torch.zeros(2, dtype=torch.long),
                           torch.zeros(2, 1, dtype=torch.bool), enc, state)
    assert state.slot.capacity == 256


def test_every_step_takes_the_batchs_length_limit_and_only_the_static_one_reserves():
    d, model = _model()
    static = StaticBlockDecoder(model.decoder)
    assert static.new_state(max_len=200).reserved == 201
    lean = LeanBlockDecoder(model.decoder)
    assert type(lean.new_state(max_len=200)) is type(lean.new_state())


def test_padding_past_the_capacity_spills_harmlessly():
    """Blocks whose bucket padding runs past the capacity (a block of 5 on 8 columns, 58 entries
    into a capacity of 64) do not grow the buffers, and give the features a roomy cache gives
    (and the module path's)."""
    d, model = _model(71)
    enc = _encoder_out(model, d, [5, 9, 2], seed=3)
    tight, roomy = StaticBlockDecoder(model.decoder), StaticBlockDecoder(model.decoder)
    module = BlockDecoder(model.decoder)
    widths = [8] * 7 + [2, 5, 1]  # 56 + 2 entries, then 5 (8 columns), then 1: 64 entries
    got, state = _blocks(tight, enc, 3, widths, seed=4, keep_all=True)
    roomy_state = roomy.new_state()
    roomy.reserve(roomy_state, 500)
    want, _ = _blocks(roomy, enc, 3, widths, seed=4, state=roomy_state, keep_all=True)
    modules, _ = _blocks(module, enc, 3, widths, seed=4, keep_all=True)
    assert state.slot.capacity == 64 and tight.slot_count() == 1
    assert roomy_state.slot.capacity == 512
    for x, y, z in zip(got, want, modules):
        assert torch.allclose(x, y, rtol=0, atol=1e-5)
        assert torch.allclose(x, z, rtol=0, atol=1e-5)


def test_engine_never_grows_a_reserved_cache():
    """The engine's batches on a step whose states reserve the length limit (BOS and max_len
    tokens) decode as fairseq greedy does, and every slot they use has the reserved capacity:
    nothing was reallocated on the way."""
    d, model = _model(72)
    sample = random_batch(d, [4, 9, 1, 15, 6, 3, 22, 2, 11, 7], seed=12)
    src_len = sample["net_input"]["src_tokens"].size(1)
    max_len = min(int(1.2 * src_len + 10), model.max_decoder_positions() - 1)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
    for drafter in (CopyDrafter(d, d), RandomDrafter(len(d), d.pad())):
        step = StaticBlockDecoder(model.decoder)
        generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.2,
                                         max_len_b=10)
        generator.block_decoder = step
        generator.encode = model.encoder.forward_torchscript
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
        capacities = {slot.capacity for slot in step._pool}
        assert capacities == {capacity_for(max_len + 1)}


def test_stubbed_graphs_replay_what_eager_computes():
    """The step's calls recorded (stub) and replayed give the eager features, with the outputs
    rewritten in place by every replay: nothing reads an output after the next call."""
    d, model = _model(73)
    enc = _encoder_out(model, d, [5, 11, 2, 8, 14], seed=9)
    graphed, eager = StubbedStep(model.decoder), StaticBlockDecoder(model.decoder, graphs=False)
    for seed in (1, 2):  # the second pass replays what the first recorded
        got, _ = _blocks(graphed, enc, 5, [1, 3, 4, 2, 4, 1], seed=seed)
        want, _ = _blocks(eager, enc, 5, [1, 3, 4, 2, 4, 1], seed=seed)
        for x, y in zip(got, want):
            assert torch.equal(x, y)
    assert graphed.graph_count() == StubGraphSet.captures > 0 and eager.graph_count() == 0


def test_slots_beyond_the_count_are_evicted_least_recently_used_first():
    d, model = _model(74)
    step = StubbedStep(model.decoder, budget=SlotBudget(slots=3, graphs=100))
    sources = {16: [5, 9], 32: [20, 30], 64: [40, 50], 128: [100, 90]}
    for i, (bucket, lengths) in enumerate(sources.items()):
        enc = _encoder_out(model, d, lengths, seed=i)
        _blocks(step, enc, 2, [2, 1], seed=i)  # its state is dropped: the slot is unused
        assert step.slot_count() == min(i + 1, 3)
    kept = sorted(slot.source for slot in step._pool)
    assert kept == [32, 64, 128]  # the least recently used (16) went
    assert step._pool.evictions == 1
    # reusing the 32 bucket makes 64 the oldest
    _blocks(step, _encoder_out(model, d, sources[32], seed=1), 2, [1], seed=5)
    _blocks(step, _encoder_out(model, d, sources[16], seed=0), 2, [1], seed=6)
    assert sorted(slot.source for slot in step._pool) == [16, 32, 128]


def test_slots_in_use_are_never_evicted():
    d, model = _model(75)
    step = StubbedStep(model.decoder, budget=SlotBudget(slots=1, graphs=100))
    eager = StaticBlockDecoder(model.decoder, graphs=False)
    encs = [_encoder_out(model, d, lengths, seed=i)
            for i, lengths in enumerate(([5, 9], [20, 30], [40, 50]))]
    states = [_blocks(step, enc, 2, [2], seed=i)[1] for i, enc in enumerate(encs)]
    assert step.slot_count() == 3  # over the count: all in use
    for i, (enc, state) in enumerate(zip(encs, states)):
        assert state.slot.keys  # buffers still there
        got, _ = _blocks(step, enc, 2, [3], seed=10 + i, state=state)
        eager_state = _blocks(eager, enc, 2, [2], seed=i)[1]
        want, _ = _blocks(eager, enc, 2, [3], seed=10 + i, state=eager_state)
        assert torch.equal(got[0], want[0])
    del states, state
    _blocks(step, _encoder_out(model, d, [100, 90], seed=5), 2, [1], seed=20)
    assert step.slot_count() == 1  # the unused ones went as soon as a new slot was wanted


def test_memory_share_evicts_unused_slots():
    """With a free-memory probe that leaves room for two slots' buffers within the share, a
    third evicts the oldest unused one; evicted slots free their buffers and graphs."""
    d, model = _model(76)
    step = StubbedStep(model.decoder, budget=SlotBudget(slots=100, graphs=100, memory_share=0.5))
    enc = _encoder_out(model, d, [5, 9], seed=0)
    _, state = _blocks(step, enc, 2, [2], seed=0)
    one_slot = state.slot.nbytes
    evicted_slot = state.slot
    del state
    step._pool.free_memory = lambda device: 3 * one_slot - step._pool.nbytes()
    for i, lengths in enumerate(([20, 30], [40, 50])):
        _blocks(step, _encoder_out(model, d, lengths, seed=i + 1), 2, [2], seed=i + 1)
    # total memory 3 slots, share 1/2: 1 slot fits beside a new one, not 2
    assert step.slot_count() == 1 and step._pool.evictions == 2
    assert evicted_slot.keys == [] and len(evicted_slot.graphs) == 0


def test_graph_budget_drops_the_oldest_graphs():
    d, model = _model(77)
    step = StubbedStep(model.decoder, budget=SlotBudget(slots=10, graphs=3))
    eager = StaticBlockDecoder(model.decoder, graphs=False)
    enc = _encoder_out(model, d, [5, 9, 3], seed=2)
    widths = [1, 2, 4, 8, 1, 2, 8, 4]
    got, _ = _blocks(step, enc, 3, widths, seed=3)
    want, _ = _blocks(eager, enc, 3, widths, seed=3)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert step.graph_count() == 3
    assert StubGraphSet.captures > 3  # dropped graphs were recorded again when needed


def test_out_of_memory_during_capture_evicts_and_retries_once(caplog, monkeypatch):
    d, model = _model(78)
    monkeypatch.setattr(cuda_graphs, "_failures_logged", set())
    step = StubbedStep(model.decoder)
    enc = _encoder_out(model, d, [5, 9], seed=0)
    _blocks(step, enc, 2, [2], seed=0)  # an unused slot
    unused = next(iter(step._pool))
    StubGraphSet.failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")]
    other = _encoder_out(model, d, [20, 30], seed=1)
    _, state = _blocks(step, other, 2, [2], seed=1)
    assert unused.keys == [] and step.slot_count() == 1  # evicted, then the retry recorded
    assert state.slot.graphs.enabled and len(state.slot.graphs) == 1
    assert not caplog.records

    # out of memory twice: that slot runs eagerly, and says so once for the whole process
    with caplog.at_level(logging.WARNING):
        for seed in (2, 3):
            StubGraphSet.failures = [torch.OutOfMemoryError("out of memory (%d)" % i)
                                     for i in range(2)]
            enc = _encoder_out(model, d, [40 + seed * 20, 3], seed=seed)
            got, state = _blocks(step, enc, 2, [2, 3], seed=seed)
            assert not state.slot.graphs.enabled and len(state.slot.graphs) == 0
            eager = StaticBlockDecoder(model.decoder, graphs=False)
            want, _ = _blocks(eager, enc, 2, [2, 3], seed=seed)
            assert all(torch.equal(x, y) for x, y in zip(got, want))
    warnings = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0].getMessage()


def test_a_call_that_cannot_be_recorded_runs_eagerly(monkeypatch):
    d, model = _model(79)
    monkeypatch.setattr(cuda_graphs, "_failures_logged", set())
    step = StubbedStep(model.decoder)
    StubGraphSet.failures = [RuntimeError("operation not permitted when stream is capturing")]
    enc = _encoder_out(model, d, [5, 9], seed=0)
    got, state = _blocks(step, enc, 2, [2, 1], seed=0)
    assert not state.slot.graphs.enabled and StubGraphSet.failures == []  # no retry
    want, _ = _blocks(StaticBlockDecoder(model.decoder, graphs=False), enc, 2, [2, 1], seed=0)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
