"""The fast step's cache is slots, one row a slot: through random ragged blocks, rollbacks,
rows leaving and rows joining, each row's entries stay in its own slot, in place, and no
entry of another row is copied or moved.

After every operation: the rows own distinct slots and the free slots are the others; a row's
entries before the operation are where they were, with the same values; a rollback sets the
rows' lengths; a leave frees slots and copies nothing; a join that finds free slots takes them
in the same buffers. (The features the cache gives are compared with fairseq's in
tests/test_fast_step.py, and whole decodes with joins and leaves in tests/test_running_batch.py.)
"""

import pytest
import torch

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder

from helpers import make_dictionary, make_task, random_batch, tiny_transformer


def _entries(cache):
    """Each row's entries of every buffer, as they are now."""
    return [[t[s, :, :n].clone() for t in cache.keys + cache.values]
            for s, n in zip(cache.slot_of, cache.lengths)]


def _check_slots(cache):
    owned = cache.slot_of
    assert len(set(owned)) == len(owned)
    assert sorted(owned + cache.free) == list(range(cache.slots))


def _same(before, after):
    for mine, theirs in zip(before, after):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b[:, : a.size(1)])


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_rows_keep_their_slots_through_blocks_rollbacks_leaves_and_joins(attention):
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=8)
    step = FastBlockDecoder(model.decoder)
    step.native_attention = attention == "native"
    g = torch.Generator().manual_seed(2)
    sample = random_batch(d, [5, 9, 3, 12], seed=1)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    cache = step.new_state()
    steps = [0] * 4
    seen_free_join = False
    with torch.no_grad():
        for it in range(30):
            rows = cache.batch or 4
            counts = torch.randint(1, 5, (rows,), generator=g)
            width = int(counts.max())
            pad = torch.arange(width).unsqueeze(0) >= counts.unsqueeze(1)
            tokens = torch.randint(4, 40, (rows, width), generator=g)
            before = _entries(cache) if cache.keys else None
            start = torch.tensor(steps)
            step.forward_packed(tokens, start, BlockLayout(pad), encoder_out, cache)
            if before is not None:
                _same(before, _entries(cache))
            firsts = list(cache.block_first)
            assert cache.lengths == [f + int(n) for f, n in zip(firsts, counts)]
            keep = torch.stack([torch.randint(1, int(n) + 1, (1,), generator=g)[0]
                                for n in counts])
            step.rollback(cache, width, keep)
            assert cache.lengths == [f + int(k) for f, k in zip(firsts, keep)]
            steps = [s + int(k) for s, k in zip(steps, keep)]
            _check_slots(cache)

            alive = torch.nonzero(torch.rand(rows, generator=g) > 0.3).view(-1)
            if 0 < alive.numel() < rows:  # rows leave: nothing moves
                kept = alive.tolist()
                before, buffers = _entries(cache), [t.data_ptr() for t in cache.keys]
                step.reorder(cache, alive)
                assert [t.data_ptr() for t in cache.keys] == buffers
                _same([before[i] for i in kept], _entries(cache))
                steps = [steps[i] for i in kept]
                _check_slots(cache)
            if it % 3 == 2:  # rows join: the others stay where they were
                joining = int(torch.randint(1, 4, (1,), generator=g))
                joiners = random_batch(d, torch.randint(2, 20, (joining,), generator=g).tolist(),
                                       seed=it)
                their_out = model.encoder.forward_torchscript(joiners["net_input"])
                before, lists = _entries(cache), cache.keys
                fits = len(cache.free) >= joining
                step.join_rows(cache, their_out, joining)
                if fits:
                    seen_free_join = True
                    assert cache.keys is lists  # the same buffers, not a copy
                _same(before, _entries(cache)[: len(before)])
                assert cache.lengths[len(before):] == [0] * joining
                steps += [0] * joining
                _check_slots(cache)
    assert seen_free_join


def test_a_row_cannot_be_kept_twice():
    d = make_dictionary(20)
    model = tiny_transformer(make_task(d), seed=1)
    step = FastBlockDecoder(model.decoder)
    sample = random_batch(d, [3, 4], seed=1)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        cache = step.new_state()
        step.forward_packed(torch.full((2, 1), 5), torch.zeros(2, dtype=torch.long),
                            BlockLayout(torch.zeros(2, 1, dtype=torch.bool)), encoder_out, cache)
    with pytest.raises(ValueError, match="kept twice"):
        step.reorder(cache, torch.tensor([0, 0]))
