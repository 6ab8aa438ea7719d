"""Bad input, as a new user types it: one line naming the problem and the flag, no traceback,
nothing half-written; and the error boundary: only our error class (and a few known fairseq
failures) become one line, a bug keeps its traceback."""

import os
import re
import subprocess
import sys

import pytest

from fairseq_pardec.errors import UsageError, one_line, running_a_cli

from test_cli import (  # noqa: F401  (the CLI fixtures come from conftest.py)
    N_TEST, PLUGIN, assert_clean_error, generate, hypotheses, run,
)


def test_missing_checkpoint_file(cli_data, tmp_path):
    _, data = cli_data
    proc = generate(data, tmp_path / "nope.pt", "--generator", "iad", check=False)
    assert_clean_error(proc, "fairseq_pardec: error: --path", "nope.pt", "no such checkpoint")


def test_truncated_checkpoint(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    whole = (stock_checkpoint / "checkpoint_last.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    proc = generate(data, cut, "--generator", "greedy", check=False)
    assert_clean_error(proc, "fairseq_pardec: error: --path", "truncated")


@pytest.mark.parametrize("generator", ["greedy", "iad", "beam"])
def test_no_room_for_output(cli_data, stock_checkpoint, generator):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", generator,
                    "--max-len-b", 0, check=False)
    assert_clean_error(proc, "--max-len-b 0", "raise --max-len-b")


def test_sampling_without_beam_one(cli_data, stock_checkpoint):
    """fairseq's own search samples --beam sequences and prints --nbest: with its default beam 5
    fairseq refuses; a greedy-only generator samples one sequence (its beam is 1)."""
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--sampling", check=False)
    assert_clean_error(proc, "--sampling", "add --beam 1")
    sampled = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                       "--sampling", "--seed", 3)
    assert len(hypotheses(sampled.stdout)) == N_TEST
    # fairseq-generate itself refuses --sampling with --nbest 1 below --beam 5, before any
    # generator is built (the hub and library callers get the generator's own line)
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--sampling", "--beam", 5, check=False)
    # naming the generator already asks for beam 1: the typed beam is what to drop
    assert_clean_error(proc, "--sampling with --generator iad draws one sample per sentence "
                       "(beam 1): remove --beam 5")
    assert "add --beam 1" not in proc.stderr


@pytest.mark.parametrize("generator", ["greedy", "iad", "lean_greedy"])
def test_typed_beam_refused_by_greedy_generators(cli_data, stock_checkpoint, generator):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", generator,
                    "--beam", 5, check=False)
    assert_clean_error(proc, "--generator %s decodes greedily (beam 1), not with beam 5" % generator,
                       "--beam 1")


def test_greedy_generator_reports_beam_one(cli_data, stock_checkpoint):
    """fairseq's closing line names the beam: a greedy run must not claim fairseq's default 5."""
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--batch-size", 16)
    closing = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
               if re.search(r"Generate test with beam=", line)]
    assert closing and all("beam=1:" in line for line in closing), closing


def test_source_of_unknown_words_only(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
               "--path", stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
               "--source-lang", "src", "--target-lang", "tgt", "--max-len-b", 20,
               input_text="qqqzx vvvwk zzzyq\n\n")
    assert "Traceback" not in proc.stderr
    assert re.search(r"^H-0\t", proc.stdout, re.M), proc.stdout
    assert re.search(r"^H-1\t", proc.stdout, re.M), proc.stdout  # the empty line too


def test_blockwise_block_larger_than_heads(cli_data, blockwise_checkpoint):
    _, data = cli_data
    proc = generate(data, blockwise_checkpoint, "--generator", "blockwise",
                    "--block-size", 99, check=False)
    assert_clean_error(proc, "--block-size 99 is larger than the model's --proposal-heads")


# ---------------------------------------------------------------------- the boundary itself
def test_usage_error_is_an_ordinary_exception():
    assert issubclass(UsageError, ValueError) and not issubclass(UsageError, SystemExit)
    assert one_line(UsageError("--x is bad")) == "fairseq_pardec: error: --x is bad"


def test_a_bug_is_not_a_user_error():
    assert one_line(ValueError("shape mismatch in a bug")) is None
    assert one_line(AssertionError("some other assertion")) is None
    assert one_line(RuntimeError("CUDA out of memory")) is None


def test_boundary_knows_fairseq_clis():
    assert running_a_cli("/venv/bin/fairseq-generate")
    assert running_a_cli("/x/site-packages/fairseq_cli/train.py")
    assert not running_a_cli("/home/me/my_script.py")
    # python -m fairseq_pardec.benchmark runs the package's __main__.py
    assert running_a_cli("/repo/fairseq_pardec/benchmark/__main__.py")
    assert not running_a_cli("/home/me/benchmark/__main__.py")


def test_build_generator_does_not_hide_bugs(cli_data, stock_checkpoint, monkeypatch):
    """A ValueError raised by a builder's bug reaches the caller as it is."""
    from argparse import Namespace

    from fairseq import checkpoint_utils
    from fairseq.dataclass.configs import GenerationConfig
    from dataclasses import asdict

    import fairseq_pardec.decoding.registry as generators
    from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig, TranslationPardecTask

    _, data = cli_data
    task = TranslationPardecTask.setup_task(TranslationPardecConfig(data=str(data), source_lang="src",
                                                    target_lang="tgt", generator="iad"))
    models, _ = checkpoint_utils.load_model_ensemble(
        [str(stock_checkpoint / "checkpoint_last.pt")], task=task)

    def broken(*args, **kwargs):
        raise ValueError("a bug, not a user error")

    monkeypatch.setitem(generators.GENERATORS, "iad", broken)
    args = Namespace(**dict(asdict(GenerationConfig()), beam=1))
    with pytest.raises(ValueError, match="a bug") as caught:
        task.build_generator(models, args)
    assert not isinstance(caught.value, UsageError)


# ---------------------------------------------------------------------- files that are not what they should be
@pytest.fixture(scope="module")
def not_checkpoints(tmp_path_factory):
    """Files a user may give to --path by mistake, by kind."""
    import random

    import torch

    folder = tmp_path_factory.mktemp("not-checkpoints")
    (folder / "empty.pt").write_bytes(b"")
    (folder / "random.pt").write_bytes(bytes(random.Random(0).getrandbits(8) for _ in range(4096)))
    (folder / "text.pt").write_text("epoch 3, best loss 2.1\n", encoding="utf-8")
    torch.save({"weights": torch.zeros(2)}, folder / "plain.pt")
    (folder / "dir").mkdir()
    return folder


@pytest.mark.parametrize("name,needle", [
    ("empty.pt", "is empty (0 bytes)"),
    ("random.pt", "truncated or not a torch checkpoint"),
    ("text.pt", "truncated or not a torch checkpoint"),
    ("plain.pt", "is a torch file but not a fairseq checkpoint"),
    ("dir", "is a directory, not a checkpoint file"),
])
def test_path_is_not_a_checkpoint(cli_data, not_checkpoints, name, needle):
    _, data = cli_data
    proc = generate(data, not_checkpoints / name, "--generator", "iad", check=False)
    assert_clean_error(proc, "fairseq_pardec: error: --path %s" % (not_checkpoints / name), needle)
    assert "weights_only" not in proc.stderr  # torch's advice would let a file run code


@pytest.fixture(scope="module")
def odd_data(cli_data, tmp_path_factory):
    """Data directories that do not fit the checkpoint or lack fairseq-preprocess's files."""
    import shutil

    _, data = cli_data
    root = tmp_path_factory.mktemp("odd-data")
    no_dicts = root / "no-dicts"
    no_dicts.mkdir()
    for f in data.iterdir():
        if f.name.startswith("test."):
            shutil.copy(f, no_dicts / f.name)
    small = root / "small-dicts"  # as if binarized with a dictionary of 100 types
    shutil.copytree(data, small)
    for side in ("src", "tgt"):
        lines = (data / ("dict.%s.txt" % side)).read_text(encoding="utf-8").splitlines()
        (small / ("dict.%s.txt" % side)).write_text("\n".join(lines[:96]) + "\n", encoding="utf-8")
    empty = root / "empty-split"  # binarized as fairseq-preprocess does an empty file
    empty.mkdir()
    from fairseq.data import indexed_dataset

    for side in ("src", "tgt"):
        shutil.copy(data / ("dict.%s.txt" % side), empty)
        prefix = str(empty / ("test.src-tgt.%s" % side))
        indexed_dataset.make_builder(prefix + ".bin", "mmap", 600).finalize(prefix + ".idx")
    return {"no-dicts": no_dicts, "small-dicts": small, "data": data, "empty-split": empty}


@pytest.mark.parametrize("folder,flags,needles", [
    ("no-dicts", [], ["has no dictionaries", "--destdir"]),
    ("data", ["-s", "de", "-t", "en"], ["-s/-t", "no dict.de.txt", "its languages are src, tgt"]),
    ("data", ["--gen-subset", "foo"], ["--gen-subset foo", "no such split", "test, train, valid"]),
    ("small-dicts", [], ["other dictionaries than this data's",
                         "its source dictionary has 600 types, this data's has 100"]),
    ("empty-split", [], ["split test has no sentences: ", "test.src-tgt.src.idx indexes none",
                         "(fairseq-preprocess was given an empty file)",
                         "or give another split than --gen-subset test"]),
])
def test_data_that_does_not_fit(odd_data, stock_checkpoint, folder, flags, needles):
    proc = generate(odd_data[folder], stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    *flags, check=False)
    assert_clean_error(proc, *needles)


def test_sampling_at_temperature_zero(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "beam",
                    "--sampling", "--beam", 1, "--temperature", 0, check=False)
    assert_clean_error(proc, "--temperature must be > 0")


def test_draft_corpus_that_is_not_text(cli_data, stock_checkpoint):
    _, data = cli_data
    binary = data / "test.src-tgt.tgt.bin"
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "lookup",
                    "--draft-corpus", binary, check=False)
    assert_clean_error(proc, "--draft-corpus %s is not UTF-8 text" % binary)


@pytest.mark.parametrize("flag,generator,what", [
    ("--draft-corpus", "lookup", "text file"),
    ("--drafter-path", "gad", "checkpoint file"),
])
def test_directory_given_for_a_file(cli_data, stock_checkpoint, flag, generator, what):
    """The folder of the corpus (or of the checkpoints) was told as "no such file"."""
    root, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", generator,
                    flag, root / "raw", check=False)
    assert_clean_error(proc, "fairseq_pardec: error: %s %s is a directory, not a %s; give the "
                       "file itself (the directory holds: " % (flag, root / "raw", what))
    if what == "text file":
        assert "test.tgt" in proc.stderr  # what it holds: the file that was meant


# ---------------------------------------------------------------------- flags fairseq accepts silently
@pytest.mark.parametrize("size", ["0", "-1"])
def test_batch_size_below_one(cli_data, stock_checkpoint, size):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--batch-size=" + size, check=False)
    assert_clean_error(proc, "--batch-size must be >= 1 (got %s" % size)


def test_bf16_that_fairseq_generate_ignores(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--bf16", "--cpu", "--batch-size", 16)
    assert "fairseq_pardec: warning: --bf16 has no effect in fairseq-generate" in proc.stderr


def test_languages_swapped_on_a_shared_dictionary(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    swapped = generate(data, ckpt, "--generator", "iad", "-s", "tgt", "-t", "src", "--batch-size", 16)
    warnings = [l for l in swapped.stderr.splitlines() if l.startswith("fairseq_pardec: warning:")]
    assert len(warnings) == 1 and "-s tgt -t src, but the checkpoint translates src into tgt" \
        in warnings[0], swapped.stderr[-2000:]
    straight = generate(data, ckpt, "--generator", "iad", "-s", "src", "-t", "tgt", "--batch-size", 16)
    assert "fairseq_pardec: warning" not in straight.stderr


def test_drafter_given_as_the_model(cli_data, drafter_checkpoint):
    _, data = cli_data
    proc = generate(data, drafter_checkpoint, "--generator", "iad", check=False)
    assert_clean_error(proc, "--path is a glat_drafter checkpoint", "--drafter-path")


# ---------------------------------------------------------------------- fairseq-interactive's input
def interactive(data, ckpt, *extra, input_text=None):
    return run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
               "--path", ckpt, "--generator", "iad", "--source-lang", "src", "--target-lang", "tgt",
               "--max-len-b", 10, *extra, input_text=input_text, check=False)


LONG_LINE = " ".join(["слово"] * 1100)  # the model takes 1024 tokens
# the long line is the second: fairseq numbered it #0 of its buffer, and stopped there
WITH_A_LONG_LINE = "Це речення .\n%s\nЩе одне речення .\nІ ще одне .\n" % LONG_LINE


@pytest.mark.parametrize("buffer_size", [1, 3])
def test_interactive_line_longer_than_the_model_takes(cli_data, stock_checkpoint, buffer_size):
    """Refused in one line that gives its line number in the input, skipped, the rest decoded."""
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    proc = interactive(data, ckpt, "--buffer-size", buffer_size, input_text=WITH_A_LONG_LINE)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("fairseq_pardec:")]
    assert warnings == [
        "fairseq_pardec: warning: standard input line 2 has 1101 source tokens (EOS included), "
        "more than the 1024 the model takes (--max-source-positions): skipped, no H-1; cut long "
        "lines with --truncate-source"], proc.stderr[-2000:]
    assert sorted(hypotheses(proc.stdout)) == [0, 2, 3]
    cut = interactive(data, ckpt, "--truncate-source", input_text=WITH_A_LONG_LINE)
    assert cut.returncode == 0 and "fairseq_pardec:" not in cut.stderr, cut.stderr[-2000:]
    assert sorted(hypotheses(cut.stdout)) == [0, 1, 2, 3]


def test_long_lines_numbered_across_buffers(monkeypatch, capsys):
    """fairseq-interactive builds a dataset per buffer of lines, numbered from 0 in each: the
    lines counted before give the long line's number in the input."""
    from helpers import make_dictionary, make_task

    from fairseq_pardec.tasks.interactive_input import skip_long_lines

    argv = ["/venv/bin/fairseq-interactive", "data", "--input", "in.txt"]
    monkeypatch.setattr(sys, "argv", argv)  # warnings go to stderr, as on the command line
    d = make_dictionary(20)
    task = make_task(d)

    def buffer(*lengths):
        import torch

        tokens = [torch.full((n,), d.nspecial, dtype=torch.long) for n in lengths]
        return task.build_dataset_for_inference(tokens, list(lengths))

    first, second = buffer(3, 9, 4), buffer(9, 2)
    for dataset in (first, second):
        skip_long_lines(task, dataset, (8, 8))
    assert sorted(first.ordered_indices().tolist()) == [0, 2]
    assert second.ordered_indices().tolist() == [1]
    said = [l for l in capsys.readouterr().err.splitlines() if l.startswith("fairseq_pardec")]
    assert said == ["fairseq_pardec: warning: --input in.txt line %d has 9 source tokens (EOS "
                    "included), more than the 8 the model takes (--max-source-positions): "
                    "skipped, no H-%d; cut long lines with --truncate-source" % (n + 1, n)
                    for n in (1, 3)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fairseq-generate", "data"])
    other = buffer(9)  # another command line's datasets are fairseq's to refuse
    skip_long_lines(task, other, (8, 8))
    assert other.ordered_indices().tolist() == [0]


def test_interactive_long_line_with_the_stock_task(cli_data, stock_checkpoint, tmp_path):
    """fairseq's own task stops at the long line: the line says which one it is."""
    _, data = cli_data
    given = tmp_path / "input.txt"
    given.write_text(WITH_A_LONG_LINE, encoding="utf-8")
    proc = run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--task", "translation",
               "--path", stock_checkpoint / "checkpoint_last.pt", "--source-lang", "src",
               "--target-lang", "tgt", "--beam", 1, "--input", given, check=False)
    assert_clean_error(proc, "fairseq_pardec: error: --input %s line 2 has 1101 source tokens"
                       % given,
                       "add --task translation_pardec")
    assert "sentence #0" not in proc.stderr


def test_interactive_without_input(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    proc = interactive(data, ckpt, "--input", tmp_path / "nope.txt")
    assert_clean_error(proc, "--input %s does not exist (no such file)" % (tmp_path / "nope.txt"))
    folder = interactive(data, ckpt, "--input", tmp_path)
    assert_clean_error(folder, "--input %s is a directory, not a file; give the file itself"
                       % tmp_path)
    closed = subprocess.run(  # standard input closed, as a daemon or `<&-` leaves it
        [sys.executable, "-m", "fairseq_cli.interactive", str(data), "--user-dir", PLUGIN,
         "--task", "translation_pardec", "--path", str(ckpt), "-s", "src", "-t", "tgt"],
        stdin=None, capture_output=True, text=True, preexec_fn=lambda: os.close(0))
    assert_clean_error(closed, "standard input, which is closed", "--input FILE")


def test_interactive_input_that_is_not_utf8(cli_data, stock_checkpoint, tmp_path):
    """fairseq reads --input as UTF-8: the line names the file, the byte and its line."""
    _, data = cli_data
    given = tmp_path / "latin1.txt"
    given.write_bytes("Це речення .\n".encode("utf-8") + "café crème\n".encode("latin-1"))
    proc = interactive(data, stock_checkpoint / "checkpoint_last.pt", "--input", given)
    assert_clean_error(proc, "fairseq_pardec: error: --input %s is not UTF-8 text (byte 25, on "
                       "line 2, cannot be decoded): convert it to UTF-8" % given)
    assert "UnicodeDecodeError" not in proc.stderr


# ---------------------------------------------------------------------- output that was there stays
EARLIER = "".join("H-%d\t-0.1\tan earlier run's hypothesis\n" % i for i in range(61))


def test_results_file_of_an_earlier_run_survives_a_failed_run(cli_data, stock_checkpoint, tmp_path,
                                                              not_checkpoints):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    results = tmp_path / "results"
    results.mkdir()
    earlier = results / "generate-test.txt"
    earlier.write_text(EARLIER, encoding="utf-8")
    refused = generate(data, ckpt, "--generator", "iad", "--beam", 5, "--results-path", results,
                       check=False)
    assert_clean_error(refused, "not with beam 5")
    unreadable = generate(data, not_checkpoints / "empty.pt", "--generator", "iad",
                          "--results-path", results, check=False)
    assert_clean_error(unreadable, "is empty (0 bytes)")
    assert earlier.read_text(encoding="utf-8") == EARLIER
    assert sorted(p.name for p in results.iterdir()) == ["generate-test.txt"]
    generate(data, ckpt, "--generator", "iad", "--results-path", results)  # completes: replaces it
    assert len(hypotheses(earlier.read_text(encoding="utf-8"))) == N_TEST
    assert sorted(p.name for p in results.iterdir()) == ["generate-test.txt"]


def test_results_path_under_a_file(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--results-path", tmp_path / "a-file" / "out", check=False)
    assert_clean_error(proc, "--results-path", "%s is a file, not a directory" % (tmp_path / "a-file"))


@pytest.mark.parametrize("sent,said,status", [
    ("SIGINT", "interrupted (Ctrl-C)", None),  # Python dies of SIGINT: -2, 130 in a shell
    ("SIGTERM", "interrupted (SIGTERM)", 143),  # what timeout, kill, Slurm and docker stop send
])
def test_interrupted_run_says_so_and_keeps_the_earlier_file(cli_data, stock_checkpoint, tmp_path,
                                                            sent, said, status):
    import signal
    import time

    _, data = cli_data
    results = tmp_path / "results"
    results.mkdir()
    earlier = results / "generate-train.txt"
    earlier.write_text(EARLIER, encoding="utf-8")
    partial = results / "generate-train.partial.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # 300 sentences one at a time, each made to last 50 ms: far from done when the signal comes
    # however busy the machine is (a tiny model decodes all 300 in about a second)
    import fairseq_cli.generate

    argv = [fairseq_cli.generate.__file__, str(data), "--user-dir", PLUGIN, "--path",
            str(stock_checkpoint / "checkpoint_last.pt"), "--task", "translation_pardec",
            "--generator", "iad", "--gen-subset", "train", "--batch-size", "1", "--max-len-b",
            "100", "--results-path", str(results)]
    slowed = (
        "import signal, sys, time\n"
        # a shell's background job starts with SIGINT ignored, and Python keeps it so: give the
        # run the handler it has at a terminal, where a user presses Ctrl-C
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "sys.argv = %r\n"  # as fairseq-generate sees it, before the plugin is imported
        "from fairseq_pardec.decoding.draft_verify.engine import DraftVerifyGenerator as G\n"
        "generate = G.generate\n"
        "G.generate = lambda self, *a, **k: (time.sleep(0.05), generate(self, *a, **k))[1]\n"
        "from fairseq_cli.generate import cli_main\n"
        "cli_main()\n" % (argv,))
    proc = subprocess.Popen([sys.executable, "-c", slowed], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    began = time.time()
    while time.time() - began < 300 and proc.poll() is None:
        # this run writes under a temporary name; the earlier file is not touched meanwhile
        writing = list(results.glob(".generate-train.*.tmp.txt"))
        text = writing[0].read_text(encoding="utf-8", errors="replace") if writing else ""
        if len(hypotheses(text)) >= 2:
            break
        time.sleep(0.05)
    assert earlier.read_text(encoding="utf-8") == EARLIER
    proc.send_signal(getattr(signal, sent))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    if status is not None:
        assert proc.returncode == status
    assert "Traceback" not in stderr, stderr[-2000:]
    assert "pardec generator=" not in stderr  # no summary of a run that did not finish
    lines = [l for l in stderr.splitlines() if "fairseq_pardec: error:" in l]
    assert len(lines) == 1 and said in lines[0], stderr[-2000:]
    written = len(hypotheses(partial.read_text(encoding="utf-8")))
    assert 2 <= written < 300
    assert "%d hypotheses written to %s" % (written, partial) in lines[0]
    assert "of 300 sentences decoded" in lines[0]
    assert earlier.read_text(encoding="utf-8") == EARLIER
    assert sorted(p.name for p in results.iterdir()) == [partial.name, earlier.name]


# ---------------------------------------------------------------------- the benchmark
@pytest.mark.parametrize("flags,needles", [
    (["--generators", "greedy", "foo"], ["--generators foo: no generator 'foo'", "iad"]),
    (["--generators", "iad:block_size=abc"], ["iad:block_size=abc", "expected an integer"]),
    (["--generators", "iad:frobnicate=3"], ["iad:frobnicate=3: frobnicate is not an option"]),
    (["--generators", "iad:block_size=0"], ["block_size must be >= 1"]),
    (["--out-dir", "A-FILE/out"], ["--out-dir", "cannot be made"]),
    (["--path", "EMPTY"], ["--path", "is empty (0 bytes)"]),
    (["--path", "CKPT-DIR"], ["--path CKPT-DIR is a directory, not a checkpoint file; give the "
                              "file itself (the directory holds: checkpoint1.pt"]),
    (["--generators", "greedy:path=CKPT-DIR"], ["--generators greedy:path=CKPT-DIR: "
                                                "path=CKPT-DIR is a directory, not a checkpoint"]),
    (["--generators", "greedy:path=NOPE"], ["path=NOPE does not exist (no such checkpoint "
                                            "file)"]),
    (["--generators", "lookup:draft_corpus=CKPT-DIR"], ["draft_corpus=CKPT-DIR is a directory, "
                                                        "not a text file"]),
])
def test_benchmark_bad_input(cli_data, stock_checkpoint, not_checkpoints, tmp_path, flags, needles):
    """Refused before anything is decoded (results are written only at the end)."""
    _, data = cli_data
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    swap = {"A-FILE/out": tmp_path / "a-file" / "out", "EMPTY": not_checkpoints / "empty.pt",
            "CKPT-DIR": stock_checkpoint, "NOPE": tmp_path / "nope.pt"}

    def filled(text):  # the placeholders, also inside a spec (greedy:path=CKPT-DIR)
        for name, path in swap.items():
            text = text.replace(name, str(path))
        return text

    flags, needles = [filled(f) for f in flags], [filled(n) for n in needles]
    args = {"--path": stock_checkpoint / "checkpoint_last.pt", "--out-dir": tmp_path / "bench",
            "--generators": "greedy"}
    given = dict(args)
    i = 0
    while i < len(flags):  # a flag and its values up to the next flag
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        given[flags[i]] = flags[i + 1:j]
        i = j
    argv = [data, "--batch-sizes", 2, "--repeats", 3, "--max-sentences", 4, "--max-len-b", 8,
            "--threads", 1, "--no-progress"]
    for flag, value in given.items():
        argv += [flag, *(value if isinstance(value, list) else [value])]
    proc = run("fairseq_pardec.benchmark", *argv, check=False)
    assert_clean_error(proc, *needles)
    assert not (tmp_path / "bench" / "results.json").exists()


@pytest.mark.parametrize("module", ["fairseq_pardec.benchmark",
                                    "fairseq_pardec.benchmark.draft_ceiling"])
def test_benchmark_checkpoint_of_other_dictionaries(odd_data, stock_checkpoint, tmp_path, module):
    """The line names --path, the checkpoint and both sizes of each dictionary."""
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    argv = [odd_data["small-dicts"], "--path", ckpt, "--max-sentences", 4, "--max-len-b", 8]
    if module == "fairseq_pardec.benchmark":
        argv += ["--generators", "greedy", "--batch-sizes", 2, "--repeats", 1, "--threads", 1,
                 "--no-progress", "--out-dir", tmp_path / "bench"]
    proc = run(module, *argv, check=False)
    assert_clean_error(proc, "fairseq_pardec: error: --path %s was trained with other "
                       "dictionaries than those of the data %s (its source dictionary has 600 "
                       "types, this data's has 100; its target dictionary has 600 types, this "
                       "data's has 100)" % (ckpt, odd_data["small-dicts"]), "--srcdict/--tgtdict")
    assert "path= checkpoint" not in proc.stderr


def test_benchmark_on_an_empty_split(odd_data, stock_checkpoint, tmp_path):
    """One line, and no finalizer's traceback above it: the reader that the empty split left
    half-built fails in __del__ when Python lets go of the error, before it prints the line
    (a new interpreter: the forked runs never get that far)."""
    proc = run("fairseq_pardec.benchmark", odd_data["empty-split"], "--path",
               stock_checkpoint / "checkpoint_last.pt", "--generators", "greedy", "--batch-sizes",
               2, "--repeats", 3, "--max-len-b", 8, "--threads", 1, "--no-progress",
               "--out-dir", tmp_path / "bench", check=False, fresh=True)
    assert proc.returncode == 1
    assert_clean_error(proc, "fairseq_pardec: error: split test has no sentences")
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------- CTranslate2
def test_ct2_without_ctranslate2(monkeypatch):
    from fairseq_pardec.benchmark import ctranslate2_baseline

    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 fails
    with pytest.raises(UsageError) as refused:
        ctranslate2_baseline.import_ctranslate2()
    assert one_line(refused.value) == (
        "fairseq_pardec: error: CTranslate2 is not installed, and the ct2 generator needs it: "
        "pip install ctranslate2 (or pip install -e '.[ct2]' in the project's folder)")


def test_ct2_worker_without_ctranslate2(tmp_path, monkeypatch):
    """The worker's interpreter cannot import ctranslate2 (where the benchmark's own process
    can): said so, with the install command, not as an error of compute_type."""
    from helpers import make_dictionary

    from fairseq_pardec.benchmark import ctranslate2_baseline

    shadow = tmp_path / "shadow" / "ctranslate2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ctranslate2'\")\n", encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))  # read by the worker only
    monkeypatch.setattr(ctranslate2_baseline, "import_ctranslate2", lambda: None)
    d = make_dictionary(8)
    with pytest.raises(UsageError) as refused:
        ctranslate2_baseline.CTranslate2Generator(str(tmp_path), d, d)
    assert one_line(refused.value) == (
        "fairseq_pardec: error: ct2: CTranslate2 is not installed for %s, which runs the ct2 "
        "worker (import ctranslate2: No module named 'ctranslate2'): pip install ctranslate2 "
        "(or pip install -e '.[ct2]' in the project's folder)" % sys.executable)
