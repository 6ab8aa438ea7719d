"""The plugin used as a library: training batches, generator arguments, memory, process state."""

import torch
from fairseq.data import LanguagePairDataset
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from helpers import make_dictionary, make_task

N_SENTENCES = 37  # 37 = 4 x 8 + 5: with --required-batch-size-multiple 8 a 5-sentence tail


def _dataset(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (3 + i % 7,), generator=g),
                          torch.tensor([d.eos()])]) for i in range(N_SENTENCES)]
    return LanguagePairDataset(sources, [len(s) for s in sources], d, tgt=sources,
                               tgt_sizes=[len(s) for s in sources], tgt_dict=d)


def _batches(task, dataset, **kwargs):
    itr = task.get_batch_iterator(dataset, max_sentences=8, required_batch_size_multiple=8,
                                  seed=1, **kwargs)
    return [list(map(int, b)) for b in itr.frozen_batches]


def test_training_batches_are_fairseqs():
    """fairseq's Trainer (train and valid iterators pass skip_remainder_batch) gets the stock
    task's batches; decoding keeps the tail batch the stock task drops."""
    d = make_dictionary(20)
    stock = TranslationTask(TranslationConfig(), d, d)
    trainer_kwargs = dict(epoch=1, disable_iterator_cache=True, skip_remainder_batch=False)
    want = _batches(stock, _dataset(d), **trainer_kwargs)
    assert sum(map(len, want)) < N_SENTENCES  # fairseq drops the tail
    ours = make_task(d)
    dataset = _dataset(d)
    decoded = _batches(ours, dataset)  # as fairseq-generate asks
    assert sorted(i for b in decoded for i in b) == list(range(N_SENTENCES))
    # the same dataset, then a fresh one, as the Trainer asks (keyword and positional)
    assert _batches(ours, dataset, **trainer_kwargs) == want
    assert _batches(ours, _dataset(d), **trainer_kwargs) == want
    positional = ours.get_batch_iterator(_dataset(d), None, 8, None, False, 8, 1, 1, 0, 0, 1, 0,
                                         True, False)
    assert [list(map(int, b)) for b in positional.frozen_batches] == want
