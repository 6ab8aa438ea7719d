"""The plugin used as a library: training batches, generator arguments, memory, process state."""

import pytest
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


def _generation_args(**overrides):
    from argparse import Namespace
    from dataclasses import asdict

    from fairseq.dataclass.configs import GenerationConfig

    return Namespace(**dict(asdict(GenerationConfig()), beam=1, **overrides))


@pytest.mark.parametrize("name", ["iad", "lean_greedy"])
def test_sequence_generator_arguments_are_honoured_or_refused_by_name(name):
    from fairseq_pardec.errors import UsageError

    from helpers import tiny_transformer

    d = make_dictionary(20)
    task = make_task(d, generator=name)
    model = tiny_transformer(task)
    # fairseq's SequenceGenerator arguments: the output symbols are set as it sets them ...
    generator = task.build_generator([model], _generation_args(), extra_gen_cls_kwargs=dict(
        eos=d.eos(), symbols_to_strip_from_output={d.unk()}))
    assert generator.eos == d.eos()
    assert generator.symbols_to_strip_from_output == {d.unk(), d.eos()}
    generator = task.build_generator([model], _generation_args(),
                                     extra_gen_cls_kwargs=dict(tokens_to_suppress=()))
    assert generator.symbols_to_strip_from_output == {d.eos()}
    # ... what the engine cannot do is refused in a ValueError that names it
    with pytest.raises(UsageError, match="tokens_to_suppress"):
        task.build_generator([model], _generation_args(),
                             extra_gen_cls_kwargs=dict(tokens_to_suppress=["w3"]))
    with pytest.raises(UsageError, match="no_such_argument"):
        task.build_generator([model], _generation_args(),
                             extra_gen_cls_kwargs=dict(no_such_argument=1))
