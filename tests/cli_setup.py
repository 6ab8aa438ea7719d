"""What the command-line tests share: the tiny data set, the checkpoints trained on it with the
stock fairseq-train (fixtures of the widest pytest scope, registered once in conftest.py so that every module gets
the same ones: a fixture imported into a test module would be built again for that module), and
how a command is run."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from forked_cli import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "fairseq_pardec")
MINI = os.path.join(ROOT, "data", "uagec-mini")
N_TEST = 37  # not a multiple of the batch sizes below: the tail batch must survive

TINY = (
    "--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
    "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
    "--encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings "
    "--optimizer adam --lr 0.003 --batch-size 32 --no-progress-bar --log-format simple "
    "--num-workers 0 --seed 1"
).split()


def with_arch(arch):
    args = list(TINY)
    args[args.index("--arch") + 1] = arch
    return args


def run(module, *args, input_text=None, check=True, fresh=False):
    """``python -m module *args``. By default a child forked from a process that has imported
    torch and fairseq already (forked_cli.py: a real process, without the seconds of start-up);
    ``fresh``: a new interpreter, as a user starts it (one test per command line keeps that)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    if fresh:
        proc = subprocess.run(
            [sys.executable, "-m", module, *map(str, args)],
            capture_output=True, text=True, env=env, input=input_text, timeout=600,
        )
    else:
        proc = run_module(module, args, env, input_text=input_text, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError("%s failed (%d):\n%s" % (module, proc.returncode, proc.stderr[-3000:]))
    return proc


def hypotheses(stdout):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", stdout, re.M)}


def generate(data, ckpt, *extra, task="translation_pardec", check=True, fresh=False):
    return run("fairseq_cli.generate", data, "--user-dir", PLUGIN, "--path", ckpt,
               "--task", task, "--gen-subset", "test", "--max-len-b", 30, *extra, check=check,
               fresh=fresh)


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]


def copy_checkpoints(save_dir, to):
    """A copy of a fixture's save directory, for a test that trains further in it (the fixture's own
    checkpoints stay as every other test expects them)."""
    shutil.copytree(save_dir, to)
    return to


@pytest.fixture(scope="session")
def cli_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    raw = root / "raw"
    raw.mkdir()
    for split, n in (("train", 300), ("valid", 30), ("test", N_TEST)):
        for side in ("src", "tgt"):
            with open(os.path.join(MINI, "%s.%s" % (split, side)), encoding="utf-8") as f:
                lines = f.read().split("\n")[:n]
            (raw / ("%s.%s" % (split, side))).write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = root / "bin"
    # fairseq-preprocess: run as a user starts it
    run("fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
        "--destdir", data, "--joined-dictionary", "--nwordssrc", 600, "--workers", 1, fresh=True)
    return root, data


@pytest.fixture(scope="session")
def stock_checkpoint(cli_data):
    """Trained with the *stock* translation task and --eval-bleu (numpy state in the checkpoint)."""
    root, data = cli_data
    save = root / "ckpt-stock"
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation", *TINY,
        "--max-update", 12, "--save-dir", save, "--eval-bleu", "--eval-bleu-args", '{"beam": 1}',
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric")
    return save


@pytest.fixture(scope="session")
def blockwise_checkpoint(cli_data, stock_checkpoint):
    """Proposal heads trained with the stock fairseq-train on top of the stock checkpoint."""
    root, data = cli_data
    save = root / "ckpt-blockwise"
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
        *with_arch("blockwise_transformer"), "--proposal-heads", 3, "--identity-first-head",
        "--freeze-base", "--init-from-transformer", stock_checkpoint / "checkpoint_last.pt",
        "--criterion", "blockwise_cross_entropy", "--max-update", 6, "--save-dir", save,
        "--no-epoch-checkpoints")
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def drafter_checkpoint(cli_data, stock_checkpoint):
    """A tiny GLAT drafter trained with the stock fairseq-train, encoder from the verifier."""
    root, data = cli_data
    save = root / "ckpt-drafter"
    tiny = with_arch("glat_drafter")
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec", *tiny,
        "--drafter-block-size", 4, "--criterion", "glat_loss", "--glat-anneal-updates", 10,
        "--init-from-verifier", stock_checkpoint / "checkpoint_last.pt",
        "--max-update", 6, "--save-dir", save, "--no-epoch-checkpoints")
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def ibdecoder_checkpoint(cli_data):
    """An IBDecoder (h = 2, c = 1) trained with the stock fairseq-train and the stock criterion."""
    root, data = cli_data
    save = root / "ckpt-ibdecoder"
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
        *with_arch("ibdecoder"), "--ib-directions", 2, "--ib-words-per-direction", 1,
        "--criterion", "label_smoothed_cross_entropy", "--max-update", 6, "--save-dir", save,
        "--no-epoch-checkpoints")
    return save / "checkpoint_last.pt"
