"""The fast step's count of a cache's holes, kept on the host, against the mask it counts.

Random blocks (ragged ones leave their padding masked), rollbacks that keep a random prefix of
each row's block, compactions, and rows leaving the batch: after each, every row's count must
equal the masked entries before the cache's end, the mask must be gone exactly when no row has
a hole, and a compaction must keep each row's entries in order.
"""

import torch

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder, FastCache


def _cache(rows: int, capacity: int) -> FastCache:
    cache = FastCache()
    # entry ids in the keys: what a compaction must move in order
    cache.keys = [torch.zeros(rows, 1, capacity, 1)]
    cache.values = [torch.zeros(rows, 1, capacity, 1)]
    cache.batch = rows
    return cache


def _check(cache: FastCache, dropped: bool = True):
    if cache.masked is None:
        assert cache.holes is None or not any(cache.holes)
        return
    counted = cache.masked[:, : cache.length].sum(1).tolist()
    if dropped:  # after a rollback or a compaction a mask without a hole is gone
        assert any(counted)
    if cache.holes is not None:
        assert cache.holes == counted


def test_holes_follow_the_mask_through_blocks_rollbacks_compactions_and_reorders():
    step = FastBlockDecoder.__new__(FastBlockDecoder)  # rollback and compact read no weights
    g = torch.Generator().manual_seed(0)
    next_id = 1
    for _ in range(30):
        rows = 5
        cache = _cache(rows, 512)
        # per row, the ids of its valid entries, in order
        valid = [[] for _ in range(rows)]
        for _ in range(40):
            rows = cache.batch
            lengths = torch.randint(0, 5, (rows,), generator=g)  # draft tokens per row
            width = int(lengths.max()) + 1
            pad = torch.arange(width).unsqueeze(0) > lengths.unsqueeze(1)
            layout = BlockLayout(pad, dense=not bool(pad.any()))
            first = cache.length
            step._mark_block(cache, layout, width)
            ids = torch.arange(next_id, next_id + rows * width, dtype=torch.float).view(rows, width)
            next_id += rows * width
            cache.keys[0][:, 0, first: first + width, 0] = ids
            cache.length = first + width
            keep = torch.stack([torch.randint(1, int(n) + 2, (1,), generator=g)[0]
                                for n in lengths])
            step.rollback(cache, width, keep)
            for r in range(rows):
                valid[r].extend(ids[r, : int(keep[r])].tolist())
            _check(cache)
            step.compact(cache, min_holes=0.3)
            _check(cache)
            alive = torch.nonzero(torch.rand(rows, generator=g) > 0.1).view(-1)
            if 0 < alive.numel() < rows:  # rows leave (the engine keeps at least one)
                step.reorder(cache, alive)
                valid = [valid[i] for i in alive.tolist()]
                _check(cache, dropped=False)
            # what each row attends to: its valid entries, in order
            for r in range(cache.batch):
                entries = cache.keys[0][r, 0, : cache.length, 0]
                if cache.masked is not None:
                    entries = entries[~cache.masked[r, : cache.length]]
                assert entries.tolist() == valid[r]
