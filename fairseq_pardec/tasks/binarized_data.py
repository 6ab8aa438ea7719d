"""Whether a binarized split's ``.bin`` files hold what their ``.idx`` files say.

fairseq memory-maps a ``.bin`` file and reads each sentence at the offset its ``.idx`` gives,
when the sentence is first batched: a truncated ``.bin`` (a copy cut short, a full disk while
binarizing) ended a run half-way with numpy's "offset must be non-negative and no greater than
buffer length", raised in a DataLoader worker. Checked once, when the split is loaded.
"""

import os

from fairseq_pardec.errors import UsageError


def _indexed(dataset):
    """The memory-mapped datasets under fairseq's wrappers (truncation, EOS appending,
    concatenated shards)."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    if isinstance(dataset, MMapIndexedDataset):
        yield dataset
        return
    for inner in getattr(dataset, "datasets", None) or ():
        yield from _indexed(inner)
    inner = getattr(dataset, "dataset", None)
    if inner is not None:
        yield from _indexed(inner)


def check_binarized(pair_dataset, split):
    for side in (getattr(pair_dataset, "src", None), getattr(pair_dataset, "tgt", None)):
        for dataset in _indexed(side):
            index = dataset._index
            if not len(index):
                continue
            pointers, sizes = index._pointers, index.sizes
            needed = int(pointers[-1]) + int(sizes[-1]) * index.dtype().itemsize
            data = dataset._path + ".bin"
            have = os.path.getsize(data)
            if have < needed:
                raise UsageError(
                    "split %s: %s is truncated (%d bytes; its index %s.idx needs %d): copy it "
                    "again, or binarize the split again with fairseq-preprocess"
                    % (split, data, have, dataset._path, needed))
