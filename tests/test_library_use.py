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

    return Namespace(**dict(asdict(GenerationConfig()), **dict(dict(beam=1), **overrides)))


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


def test_benchmark_names_only_size_mismatches_another_vocabulary(tmp_path, monkeypatch):
    from argparse import Namespace

    from fairseq import checkpoint_utils

    from fairseq_pardec.benchmark.runner import load_model
    from fairseq_pardec.errors import UsageError

    path = tmp_path / "model.pt"
    path.write_bytes(b"")
    args = Namespace(data="DATA", fp16=False, bf16=False)

    def failing(message):
        def load(*a, **k):
            raise RuntimeError(message)
        return load

    monkeypatch.setattr(checkpoint_utils, "load_model_ensemble", failing(
        "Error(s) in loading state_dict: size mismatch for decoder.embed_tokens.weight"))
    with pytest.raises(UsageError, match="dictionaries"):
        load_model(None, str(path), args, False)
    monkeypatch.setattr(checkpoint_utils, "load_model_ensemble", failing("CUDA out of memory"))
    with pytest.raises(RuntimeError, match="out of memory") as caught:
        load_model(None, str(path), args, False)
    assert not isinstance(caught.value, UsageError)


def test_generator_with_a_caller_generator_class_is_refused():
    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_pardec.errors import UsageError
    from helpers import tiny_transformer

    d = make_dictionary(20)
    task = make_task(d, generator="iad")
    with pytest.raises(UsageError, match="seq_gen_cls"):
        task.build_generator([tiny_transformer(task)], _generation_args(),
                             seq_gen_cls=SequenceGenerator)
    beam = make_task(d)  # --generator beam (the default): the caller's class, as fairseq does
    built = beam.build_generator([tiny_transformer(beam)], _generation_args(),
                                 seq_gen_cls=SequenceGenerator)
    assert type(built) is SequenceGenerator


def test_fallback_to_fairseqs_modules_is_logged_once(caplog):
    import logging

    from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
    from fairseq_pardec.decoding import step_factory as factory
    from helpers import tiny_transformer

    d = make_dictionary(20)
    model = tiny_transformer(make_task(d), scale_attn=True)  # NormFormer: not the lean step
    factory._fallbacks_logged.discard(type(model.decoder).__name__)
    with caplog.at_level(logging.INFO):
        for _ in range(2):  # the step is chosen for the model as it is when asked for
            DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance()).block_decoder
    said = [r for r in caplog.records if "fairseq's own modules" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno >= logging.INFO


def test_drafter_checkpoint_is_read_once(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    from fairseq_pardec.decoding.draft_verify.drafters.loading import load_drafter
    from helpers import tiny_transformer
    from test_gad import drafter_model

    d = make_dictionary(20)
    task = make_task(d)
    drafter = drafter_model(task)
    path = tmp_path / "drafter.pt"
    path.write_bytes(b"")
    reads = []

    def read(filename, arg_overrides=None):
        reads.append(filename)
        return {"cfg": {"model": {"arch": "glat_drafter_base"}}, "model": drafter.state_dict()}

    def ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                          num_shards=1, state=None):  # fairseq's contract: reads unless given
        if state is None:
            state = checkpoint_utils.load_checkpoint_to_cpu(filenames[0], arg_overrides)
        return [drafter], None, task

    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", read)
    monkeypatch.setattr(checkpoint_utils, "load_model_ensemble_and_task", ensemble_and_task)
    assert load_drafter(task, str(path), tiny_transformer(task)) is drafter
    assert reads == [str(path)]


def test_unmappable_source_token_is_skipped_not_the_end_of_copying():
    from fairseq_pardec.decoding.registry import CopyDrafter

    src = make_dictionary(10)
    src.add_symbol("only_in_source")
    tgt = make_dictionary(10)
    lacking = src.index("only_in_source")
    w = [src.index("w%d" % i) for i in (1, 2, 3, 4)]
    tokens = torch.tensor([[w[0], w[1], lacking, w[2], w[3], src.eos()]])
    drafter = CopyDrafter(src, tgt)
    state = drafter.start({"net_input": {"src_tokens": tokens}}, None, tgt.eos())
    t = [tgt.index("w%d" % i) for i in (1, 2, 3, 4)]
    assert state.source(0) == [tgt.eos()] + t + [tgt.eos()]


def test_building_and_dropping_generators_frees_their_models(monkeypatch):
    """Neither the summary reporter (also on a command line) nor a cache keeps a model."""
    import gc
    import weakref

    from fairseq_pardec.tasks import translation_pardec

    from helpers import tiny_transformer

    monkeypatch.setattr(translation_pardec, "running_a_cli", lambda: True)
    d = make_dictionary(20)
    refs = []
    for i in range(20):
        task = make_task(d, generator=("iad", "greedy", "lookup", "lean_greedy")[i % 4])
        model = tiny_transformer(task, seed=i)
        generator = task.build_generator([model], _generation_args())
        refs.append(weakref.ref(model))
        del model, generator, task
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_interleave_tables_are_not_cached_on_a_device():
    from fairseq_pardec.models import interleaving as ordering

    ordering.interleave(torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 3]), 2, 1, 2, 1)
    assert all(p.device.type == "cpu" for p in [ordering._index_table(5, 2, 1)])
    assert "device" not in ordering._index_table.__wrapped__.__code__.co_varnames


LIBRARY_PROCESS = """
import logging, sys
hook = sys.excepthook
logging.getLogger().setLevel(logging.DEBUG)
import fairseq_pardec
print(sys.excepthook is hook, logging.getLogger().level == logging.DEBUG)
"""


def _import_in(program, tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / program
    script.write_text(LIBRARY_PROCESS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         check=True)
    return out.stdout.split()[-2:]


def test_importing_the_plugin_leaves_a_library_process_alone(tmp_path):
    assert _import_in("my_program.py", tmp_path) == ["True", "True"]
    # a fairseq command line gets the one-line errors and INFO logging
    assert _import_in("fairseq-generate", tmp_path) == ["False", "False"]


@pytest.mark.parametrize("name", ["greedy", "iad"])
def test_greedy_generators_leave_the_callers_config_alone(name):
    from omegaconf import OmegaConf

    from fairseq.dataclass.configs import GenerationConfig
    from helpers import tiny_transformer

    from fairseq_pardec.errors import UsageError

    d = make_dictionary(20)
    task = make_task(d, generator=name)
    model = tiny_transformer(task)
    args = _generation_args()
    del args.beam  # no beam at all (--eval-bleu-args '{}'): the generator's own, beam 1
    task.build_generator([model], args)
    assert not hasattr(args, "beam")
    config = OmegaConf.structured(GenerationConfig(beam=1))
    OmegaConf.set_struct(config, True)
    OmegaConf.set_readonly(config, True)
    task.build_generator([model], config)
    assert config.beam == 1
    refused = OmegaConf.structured(GenerationConfig())  # fairseq's beam 5: never greedy silently
    OmegaConf.set_readonly(refused, True)
    with pytest.raises(UsageError, match="not with beam 5"):
        task.build_generator([model], refused)
    assert refused.beam == 5
