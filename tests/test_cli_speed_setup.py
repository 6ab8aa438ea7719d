"""What the task sets up so that fairseq-generate times decoding as the benchmark does: one
warm-up decode per draft-and-verify generator on the decoding command lines (tasks/warm_up.py),
invisible in the generator's statistics, its drafter and its output."""

from argparse import Namespace
from dataclasses import asdict

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig

from helpers import make_dictionary, make_task, random_batch, tiny_transformer

import fairseq_pardec.tasks.translation_pardec as translation_pardec
from fairseq_pardec.decoding.draft_verify.drafters import CopyDrafter
from fairseq_pardec.tasks.warm_up import decoding_cli


def generation_args(**options):
    args = asdict(GenerationConfig())
    args.update(beam=1, max_len_a=1.2, max_len_b=10)
    args.update(options)
    return Namespace(**args)


@pytest.fixture
def warm_ups(monkeypatch):
    """The generators the task warmed up, in order (the real warm-up still runs)."""
    warmed = []
    real = translation_pardec.warm_up

    def spy(generator, model, source_dictionary):
        warmed.append(generator)
        return real(generator, model, source_dictionary)

    monkeypatch.setattr(translation_pardec, "warm_up", spy)
    return warmed


@pytest.mark.parametrize("program, decoding", [
    ("/venv/bin/fairseq-generate", True),
    ("/venv/bin/fairseq-interactive", True),
    ("/site-packages/fairseq_cli/generate.py", True),
    ("/site-packages/fairseq_cli/interactive.py", True),
    # builds its --eval-bleu generator before the model is on its device
    ("/venv/bin/fairseq-train", False),
    ("/repo/fairseq_pardec/benchmark/__main__.py", False),  # warms up by itself
    ("/venv/bin/pytest", False),
    ("", False),
])
def test_decoding_command_lines(program, decoding):
    assert decoding_cli(program) is decoding


def test_no_warm_up_outside_the_decoding_command_lines(warm_ups):
    d = make_dictionary(30)
    task = make_task(d, generator="lean_greedy")
    assert task.warm_up_generators is None  # the default: by command line
    task.build_generator([tiny_transformer(task)], generation_args())
    assert warm_ups == []  # pytest is no decoding command line


@pytest.mark.parametrize("generator", ["lean_greedy", "iad", "lookup", "auto"])
def test_warm_up_once_per_generator_and_invisible(generator, warm_ups, monkeypatch):
    d = make_dictionary(30)
    task = make_task(d, generator=generator)
    model = tiny_transformer(task)
    cold = task.build_generator([model], generation_args())
    assert warm_ups == []
    task.warm_up_generators = True
    proposals = []
    real_propose = CopyDrafter.propose

    def counted(self, *args, **kwargs):
        proposals.append(self)
        return real_propose(self, *args, **kwargs)

    monkeypatch.setattr(CopyDrafter, "propose", counted)
    warm = task.build_generator([model], generation_args())
    assert warm_ups == [warm]  # once, for the generator built
    # the warm-up's sentence is counted nowhere and shown to no drafter
    assert warm.stats.sentences == 0 and warm.stats.decoder_calls == 0
    assert warm.stats.wall_time == 0.0
    assert proposals == []
    sample = random_batch(d, [7, 5, 9], seed=3)
    ours = warm.generate([model], sample)
    theirs = cold.generate([model], sample)
    assert warm.stats.sentences == 3
    for a, b in zip(ours, theirs):
        assert torch.equal(a[0]["tokens"], b[0]["tokens"])
    assert warm_ups == [warm]  # decoding does not warm up again


def test_fairseqs_own_generators_are_not_warmed_up(warm_ups):
    d = make_dictionary(30)
    task = make_task(d, generator="greedy")
    task.warm_up_generators = True
    task.build_generator([tiny_transformer(task)], generation_args())
    assert warm_ups == []


def test_warm_up_draws_no_random_number(warm_ups):
    """--sampling draws from a seeded generator: the warm-up must leave its draws as they
    were, so that a run with the warm-up samples what one without it samples."""
    d = make_dictionary(30)
    task = make_task(d, generator="lean_greedy")
    model = tiny_transformer(task)
    args = generation_args(sampling=True, sampling_topk=5)
    sample = random_batch(d, [6, 8], seed=4)
    outputs = []
    for warm in (False, True):
        task.warm_up_generators = warm
        torch.manual_seed(7)
        generator = task.build_generator([model], args)
        outputs.append([h[0]["tokens"] for h in generator.generate([model], sample)])
    assert len(warm_ups) == 1
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- DataLoader workers
def parsed_task_config(argv):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_pardec  # noqa: F401  (registers the task)

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, ["data-bin", "--task", "translation_pardec"] + argv)
    return args, convert_namespace_to_omegaconf(args).task


@pytest.mark.parametrize("argv, typed", [([], None), (["--num-workers", "1"], 1),
                                         (["--num-workers", "0"], 0), (["--num-workers=3"], 3)])
def test_typed_num_workers_is_recorded(argv, typed):
    args, task_cfg = parsed_task_config(argv)
    assert task_cfg.explicit_num_workers == typed
    assert args.num_workers == (1 if typed is None else typed)  # fairseq's own value unchanged


@pytest.mark.parametrize("program, typed, workers", [
    ("/venv/bin/fairseq-generate", None, 0),  # fairseq's default worker: none while decoding
    ("/venv/bin/fairseq-generate", 1, 1),  # typed: kept
    ("/venv/bin/fairseq-generate", 2, 2),
    ("/venv/bin/fairseq-train", None, 1),  # not a decoding command line: fairseq's
    ("/venv/bin/pytest", None, 1),
])
def test_decoding_batches_load_in_the_decoding_process(program, typed, workers, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "argv", [program])
    d = make_dictionary(30)
    task = make_task(d, explicit_num_workers=typed)
    dataset = task.build_dataset_for_inference([torch.tensor([5, 6, d.eos()])], [3])
    seen = []
    parent = translation_pardec.TranslationTask.get_batch_iterator

    def recorded(self, dataset, *args, **kwargs):
        seen.append(kwargs.get("num_workers"))
        return parent(self, dataset, *args, **kwargs)

    monkeypatch.setattr(translation_pardec.TranslationTask, "get_batch_iterator", recorded)
    task.get_batch_iterator(dataset=dataset, max_sentences=1, num_workers=typed or 1)
    assert seen == [workers]
