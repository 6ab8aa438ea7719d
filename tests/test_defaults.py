"""fairseq's defaults stay fairseq's: without --generator the task decodes as --task translation
(fairseq's SequenceGenerator with fairseq's --beam, 5 by default), and a greedy-only generator
takes beam 1 and refuses any other beam, wherever it is asked for (the command line, the hub's
``beam=``, ``--eval-bleu-args``, a library call), in one line: never greedy without a word."""

import contextlib
import json
from argparse import Namespace

import pytest
import torch

from cli_setup import assert_clean_error, generate, hypotheses, run, PLUGIN, N_TEST
from helpers import make_dictionary, make_task, tiny_args, tiny_transformer
from fairseq_pardec.errors import UsageError


def _h_lines(stdout):
    """fairseq-generate's hypothesis lines (tokens and scores), by sentence id."""
    return sorted(line for line in stdout.splitlines() if line.startswith(("H-", "P-")))


def test_no_generator_is_stock_beam_search(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    every = ("--required-batch-size-multiple", 1)  # the stock task keeps the tail batch too
    stock = generate(data, ckpt, *every, task="translation")
    ours = generate(data, ckpt, *every)
    assert len(hypotheses(stock.stdout)) == N_TEST
    assert _h_lines(ours.stdout) == _h_lines(stock.stdout)  # scores too: the same search
    assert "beam=5" in ours.stdout.splitlines()[-1]
    typed = generate(data, ckpt, "--beam", 5, *every)
    assert _h_lines(typed.stdout) == _h_lines(stock.stdout)
    # an option that only fairseq's search has changes nothing about which search decodes
    stock_nbest = generate(data, ckpt, "--nbest", 2, "--print-alignment", *every, task="translation")
    ours_nbest = generate(data, ckpt, "--nbest", 2, "--print-alignment", *every)
    assert _h_lines(ours_nbest.stdout) == _h_lines(stock_nbest.stdout)
    assert len(_h_lines(ours_nbest.stdout)) == 2 * 2 * N_TEST


def test_no_generator_is_fairseq_beam_search_on_a_model_whose_beam_differs():
    """In process, on a random model whose beam-5 and greedy outputs differ: the task's default
    generator gives fairseq's beam-5 hypotheses, all five of them, scores included."""
    from fairseq.sequence_generator import SequenceGenerator
    from fairseq.dataclass.configs import GenerationConfig
    from dataclasses import asdict
    from helpers import random_batch

    d = make_dictionary()
    task = make_task(d)
    model = tiny_transformer(task)
    sample = random_batch(d, [5, 9, 12, 7, 3, 11, 8, 6], seed=3)
    args = Namespace(**dict(asdict(GenerationConfig()), max_len_b=12))
    ours = task.build_generator([model], args).generate([model], sample)
    stock = SequenceGenerator([model], d, beam_size=5, max_len_b=12).generate([model], sample)
    greedy = SequenceGenerator([model], d, beam_size=1, max_len_b=12).generate([model], sample)
    assert [len(h) for h in ours] == [5] * 8

    def flat(hypos):
        return [[(x["tokens"].tolist(), float(x["score"])) for x in h] for h in hypos]

    assert flat(ours) == flat(stock)
    # the comparison means something: beam 5 and greedy disagree somewhere on this model
    assert [h[0]["tokens"].tolist() for h in stock] != [h[0]["tokens"].tolist() for h in greedy]


def test_auto_is_greedy_and_refuses_any_other_beam(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    greedy = hypotheses(generate(data, ckpt, "--beam", 1, "--required-batch-size-multiple", 1,
                                 task="translation").stdout)
    auto = generate(data, ckpt, "--generator", "auto")
    assert hypotheses(auto.stdout) == greedy
    assert "beam=1" in auto.stdout.splitlines()[-1]
    for order in (("--generator", "auto", "--beam", "5"), ("--beam", "5", "--generator", "auto")):
        proc = generate(data, ckpt, *order, check=False)
        assert_clean_error(proc, "--generator auto decodes greedily (beam 1), not with beam 5",
                           "--beam 1")
    assert hypotheses(generate(data, ckpt, "--beam", 1, "--generator", "iad").stdout) == greedy
    proc = generate(data, ckpt, "--generator", "iad", "--print-alignment", check=False)
    assert_clean_error(proc, "--generator iad does not support --print-alignment")


def test_interactive_without_generator_is_stock(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    with open(cli_data[0] / "raw" / "test.src", encoding="utf-8") as f:
        text = "".join(f.readlines()[:6])

    def interactive(task, *extra):
        proc = run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--path", ckpt,
                   "--task", task, "--max-len-b", 30, *extra, input_text=text)
        return [line for line in proc.stdout.splitlines() if line.startswith(("H-", "P-"))]

    assert interactive("translation_pardec") == interactive("translation")
    greedy = [l.split("\t")[2] for l in interactive("translation", "--beam", "1") if l[0] == "H"]
    auto = [l.split("\t")[2] for l in interactive("translation_pardec", "--generator", "auto")
            if l[0] == "H"]
    assert auto == greedy


@pytest.fixture(scope="module")
def pardec_checkpoint(stock_checkpoint, tmp_path_factory):
    """The stock checkpoint as ``fairseq-train --task translation_pardec`` saves it (the README's
    training command): its config names our task with every option at its default, so the hub's
    ``from_pretrained(..., generator=NAME)`` can set one (fairseq overrides only the keys a
    checkpoint's config has)."""
    from dataclasses import asdict
    from omegaconf import OmegaConf, open_dict

    from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig

    state = torch.load(stock_checkpoint / "checkpoint_last.pt", weights_only=False)
    task = state["cfg"]["task"]
    with open_dict(task) if OmegaConf.is_config(task) else contextlib.nullcontext():
        for key, value in asdict(TranslationPardecConfig()).items():
            if key not in task:
                task[key] = value
        task["_name"] = "translation_pardec"
    folder = tmp_path_factory.mktemp("pardec-ckpt")
    torch.save(state, folder / "checkpoint_last.pt")
    return folder


@pytest.fixture(scope="module")
def hub(cli_data, stock_checkpoint, pardec_checkpoint):
    """Hub interfaces: ``load("translation")`` the stock checkpoint under the stock task,
    ``load("translation_pardec", generator=...)`` the same weights under our task."""
    from fairseq.models.transformer import TransformerModel

    from fairseq_pardec.tasks.translation_pardec import TranslationPardecTask

    _, data = cli_data
    loaded = {}

    def load(task, **overrides):
        key = (task, tuple(sorted(overrides.items())))
        if key not in loaded:
            folder = stock_checkpoint if task == "translation" else pardec_checkpoint
            loaded[key] = TransformerModel.from_pretrained(
                str(folder), checkpoint_file="checkpoint_last.pt", data_name_or_path=str(data),
                max_len_b=30, **overrides)
            assert isinstance(loaded[key].task, TranslationPardecTask) == (task != "translation")
        return loaded[key]

    with open(cli_data[0] / "raw" / "test.src", encoding="utf-8") as f:
        sentences = [line.strip() for line in f.readlines()[:8]]
    return load, sentences


@pytest.mark.parametrize("beam", [1, 4, 5])
def test_hub_without_generator_is_stock(hub, beam):
    load, sentences = hub
    stock, ours = load("translation"), load("translation_pardec")
    assert ours.translate(sentences, beam=beam) == stock.translate(sentences, beam=beam)
    tokens = [ours.encode(s) for s in sentences[:3]]
    ours_hypos = ours.generate(tokens, beam=beam)
    stock_hypos = stock.generate(tokens, beam=beam)
    assert [len(h) for h in ours_hypos] == [beam] * 3  # one hypothesis per beam, as fairseq's
    assert [[x["tokens"].tolist() for x in h] for h in ours_hypos] == \
        [[x["tokens"].tolist() for x in h] for h in stock_hypos]
    if beam > 1:  # sampling draws one sample per beam, as fairseq does
        sampled = ours.generate(tokens, beam=beam, sampling=True, sampling_topk=3)
        assert [len(h) for h in sampled] == [beam] * 3


@pytest.mark.parametrize("name", ["auto", "iad", "lean_greedy", "greedy"])
def test_hub_greedy_generators_take_beam_one_only(hub, name):
    load, sentences = hub
    stock, ours = load("translation"), load("translation_pardec", generator=name)
    assert ours.translate(sentences, beam=1) == stock.translate(sentences, beam=1)
    for beam in (4, 5):
        with pytest.raises(UsageError, match=r"--generator %s decodes greedily \(beam 1\), not "
                           r"with beam %d.*beam=1" % (name, beam)):
            ours.translate(sentences, beam=beam)
    with pytest.raises(UsageError, match="draws one sample per sentence, not 5"):
        ours.generate([ours.encode(sentences[0])], beam=5, sampling=True)
    with pytest.raises(UsageError):
        ours.translate(sentences)  # the hub's own default beam is 5


def test_hub_generator_on_a_checkpoint_of_the_stock_task(cli_data, stock_checkpoint, hub, caplog):
    """``task='translation_pardec', generator=...`` on a checkpoint that fairseq-train saved with
    the stock task: fairseq sets only the keys its config has, and both were dropped in silence
    (beam 5). Our task is adopted, and the generator decodes; ``generator=`` alone is said to
    be ignored, in one warning that names the fix."""
    import logging

    from fairseq.models.transformer import TransformerModel
    from fairseq.tasks.translation import TranslationTask

    from fairseq_pardec.tasks.translation_pardec import TranslationPardecTask

    load, sentences = hub
    stock = load("translation")

    def from_pretrained(**overrides):
        return TransformerModel.from_pretrained(
            str(stock_checkpoint), checkpoint_file="checkpoint_last.pt",
            data_name_or_path=str(cli_data[1]), max_len_b=30, **overrides)

    with caplog.at_level(logging.WARNING):
        ours = from_pretrained(task="translation_pardec", generator="iad")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert isinstance(ours.task, TranslationPardecTask) and ours.task.cfg.generator == "iad"
    assert ours.translate(sentences, beam=1) == stock.translate(sentences, beam=1)
    with pytest.raises(UsageError, match="--generator iad decodes greedily"):
        ours.translate(sentences, beam=5)  # iad's own refusal: the generator is the one built
    plain = from_pretrained(task="translation_pardec")  # fairseq's beam search, as stock
    assert isinstance(plain.task, TranslationPardecTask) and plain.task.cfg.generator == "beam"
    assert plain.translate(sentences, beam=5) == stock.translate(sentences, beam=5)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ignored = from_pretrained(generator="auto")
    assert type(ignored.task) is TranslationTask
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["generator='auto' is an option of task 'translation_pardec', which the "
                    "checkpoint's task 'translation' ignores (it decodes with fairseq's own "
                    "search): add task='translation_pardec' (it decodes checkpoints of the stock "
                    "translation task too)"], said


def test_hub_task_override_on_a_task_ours_does_not_extend(caplog):
    """A checkpoint of a task that is not fairseq's translation task keeps its task, and the
    caller is told."""
    import logging

    from omegaconf import OmegaConf

    from fairseq_pardec.tasks.hub_overrides import adopt_task

    cfg = OmegaConf.create({"task": {"_name": "language_modeling", "data": "x"}})
    with caplog.at_level(logging.WARNING):
        adopt_task(cfg, {"task": "translation_pardec", "generator": "iad"})
    assert cfg.task._name == "language_modeling" and "generator" not in cfg.task
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["task='translation_pardec' cannot decode a checkpoint of task "
                    "'language_modeling' (it extends fairseq's translation task only): the "
                    "checkpoint decodes with its own task, which ignores generator"], said


def _eval_bleu_task(generator, eval_bleu_args):
    d = make_dictionary()
    options = dict(eval_bleu=True, eval_bleu_args=eval_bleu_args)
    if generator is not None:
        options["generator"] = generator
    return make_task(d, **options), d


@pytest.mark.parametrize("generator", [None, "auto", "iad"])
@pytest.mark.parametrize("beam", [None, 1, 5])
def test_eval_bleu_args_beam(generator, beam):
    """--eval-bleu builds its generator in build_model (fairseq's translation task) from
    --eval-bleu-args: beam 5 is fairseq's beam search, or refused by a greedy-only generator;
    no beam at all is each generator's own (fairseq: 5)."""
    from fairseq.sequence_generator import SequenceGenerator

    args = {} if beam is None else {"beam": beam}
    task, d = _eval_bleu_task(generator, json.dumps(args))
    model_cfg = tiny_args(arch="transformer")
    greedy_only = generator is not None
    if greedy_only and beam == 5:
        with pytest.raises(UsageError, match="--eval-bleu-args"):
            task.build_model(model_cfg)
        return
    task.build_model(model_cfg)
    built = task.sequence_generator
    if greedy_only:
        assert not isinstance(built, SequenceGenerator)
        assert built.name == generator
    else:
        assert isinstance(built, SequenceGenerator)
        assert built.beam_size == (5 if beam is None else beam)


def test_library_call_with_beam_five_is_refused_by_greedy_generators():
    from fairseq.dataclass.configs import GenerationConfig
    from dataclasses import asdict

    d = make_dictionary()
    for name in ("auto", "iad", "lookup", "lean_greedy", "greedy"):
        task = make_task(d, generator=name)
        model = tiny_transformer(task)
        args = Namespace(**asdict(GenerationConfig()))  # fairseq's defaults: beam 5
        with pytest.raises(UsageError, match="not with beam 5"):
            task.build_generator([model], args)
        args.beam = 1
        task.build_generator([model], args)
    beam = make_task(d)
    built = beam.build_generator([tiny_transformer(beam)], Namespace(**asdict(GenerationConfig())))
    assert built.beam_size == 5
