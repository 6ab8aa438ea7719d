"""Nothing lost, whatever ends a run, and the last bad inputs in one line.

SIGTERM ends a command line as Ctrl-C does; output files appear whole or not at all (a full disk
is /dev/full or an OSError(ENOSPC) raised where the file system would raise it); options and data
files that ended in a traceback, SIGFPE or silence are refused in one line naming the flag or
file. In-process where the boundary allows; a real process only where a real signal is needed.
"""

import argparse
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from fairseq_pardec import errors, output_files, results_file
from fairseq_pardec.cli_checks import check_sizes
from fairseq_pardec.errors import OutputError, Terminated, UsageError, one_line

from helpers import make_dictionary, make_task, tiny_transformer

EARLIER = "".join("H-%d\t-0.1\tan earlier run's hypothesis\n" % i for i in range(5))


@pytest.fixture
def no_exit_handlers(monkeypatch):
    """What the code under test registers for the end of the process stays in the test."""
    registered = []
    monkeypatch.setattr(errors, "_interrupt_reports", [])
    monkeypatch.setattr(errors, "_error_reports", [])
    monkeypatch.setattr("atexit.register", lambda f, *a, **k: registered.append(f) or f)
    return registered


# ---------------------------------------------------------------------- SIGTERM
def test_sigterm_ends_the_run_as_ctrl_c_does(no_exit_handlers, monkeypatch, capsys):
    handlers = {}
    monkeypatch.setattr(errors, "_sigterm_owner", os.getpid())
    monkeypatch.setattr(errors, "uncaught", [])
    monkeypatch.setattr(signal, "signal", lambda sig, handler: handlers.__setitem__(sig, handler))
    errors.on_interrupt(lambda: "7 of 9 sentences decoded")
    with pytest.raises(Terminated) as ended:
        errors._terminate(signal.SIGTERM, None)
    # a SystemExit: no `except Exception` on the way out swallows it; 143 = 128 + SIGTERM
    assert isinstance(ended.value, SystemExit) and not isinstance(ended.value, Exception)
    assert ended.value.code == 143
    assert errors.uncaught == [ended.value]  # exit handlers read it: no summary, partial kept
    assert handlers == {signal.SIGTERM: signal.SIG_IGN}  # the settling is not cut short
    (report,) = no_exit_handlers
    report()
    assert capsys.readouterr().err == (
        "fairseq_pardec: error: interrupted (SIGTERM): 7 of 9 sentences decoded\n")


def test_sigterm_handler_only_where_sigterm_has_its_default(monkeypatch):
    installed = {}
    monkeypatch.setattr(signal, "signal", lambda sig, handler: installed.__setitem__(sig, handler))
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    errors.handle_sigterm()
    assert installed == {signal.SIGTERM: errors._terminate}
    installed.clear()
    monkeypatch.setattr(signal, "getsignal", lambda sig: print)  # a program's own handler
    errors.handle_sigterm()
    assert installed == {}


# ---------------------------------------------------------------------- generate's results file
def test_results_file_takes_its_name_only_when_complete(tmp_path, no_exit_handlers):
    path = tmp_path / "generate-test.txt"
    path.write_text(EARLIER, encoding="utf-8")
    staged = results_file.ResultsFile(str(path))
    with staged.open(str(path), "w", buffering=1, encoding="utf-8") as h:  # as fairseq opens it
        print("H-0\t-0.2\tthis run", file=h)
        assert path.read_text(encoding="utf-8") == EARLIER  # untouched while the run writes
        assert os.path.exists(staged.temporary)  # the run's own name: ranks never share one
        assert os.path.dirname(staged.temporary) == str(tmp_path)
    assert path.read_text(encoding="utf-8") == "H-0\t-0.2\tthis run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generate-test.txt"]
    assert staged.settled


def test_results_file_of_a_failed_run_stays_partial(tmp_path, no_exit_handlers, capsys):
    path = tmp_path / "generate-test.txt"
    path.write_text(EARLIER, encoding="utf-8")
    staged = results_file.ResultsFile(str(path))
    with pytest.raises(KeyError):
        with staged.open(str(path), "w", encoding="utf-8") as h:
            print("H-0\t-0.2\tthis run", file=h)
            raise KeyError("a failure half-way")
    staged.at_exit()
    assert path.read_text(encoding="utf-8") == EARLIER
    partial = tmp_path / "generate-test.partial.txt"
    assert capsys.readouterr().err == (
        "fairseq_pardec: error: the 1 hypotheses written before the error are in %s; the "
        "earlier %s is kept\n" % (partial, path))


def test_results_file_on_a_full_disk(tmp_path, no_exit_handlers):
    path = tmp_path / "generate-test.txt"
    path.write_text(EARLIER, encoding="utf-8")
    staged = results_file.ResultsFile(str(path))
    with pytest.raises(OutputError) as failed:
        with staged.open(str(path), "w", buffering=1, encoding="utf-8") as h:
            h._stream.close()
            h._stream = open("/dev/full", "w", buffering=1, encoding="utf-8")  # ENOSPC, for real
            print("H-0\t-0.2\tthis run", file=h)
    assert failed.value.errno == errno.ENOSPC and isinstance(failed.value, OSError)
    line = one_line(failed.value)
    assert line.startswith("fairseq_pardec: error: --results-path: cannot write %s (No space "
                           "left on device); nothing was replaced" % path), line
    assert "\n" not in line
    assert path.read_text(encoding="utf-8") == EARLIER
    # the hook's line also says where the hypotheses went (none reached the disk here)
    assert errors.with_reports(line) == line
    assert not os.path.exists(staged.temporary)


def test_error_line_says_where_the_hypotheses_went(tmp_path, no_exit_handlers, capsys):
    path = tmp_path / "generate-test.txt"
    path.write_text(EARLIER, encoding="utf-8")
    staged = results_file.ResultsFile(str(path))
    with pytest.raises(UsageError) as failed:
        with staged.open(str(path), "w", buffering=1, encoding="utf-8") as h:
            print("H-0\t-0.2\tthis run", file=h)
            raise UsageError("sentence #1 has 5001 source tokens")  # a user error half-way
    line = errors.with_reports(one_line(failed.value))
    partial = tmp_path / "generate-test.partial.txt"
    assert line == ("fairseq_pardec: error: sentence #1 has 5001 source tokens; the 1 hypotheses "
                    "written before the error are in %s; the earlier %s is kept" % (partial, path))
    staged.at_exit()  # settled: no second line
    assert capsys.readouterr().err == ""
    assert path.read_text(encoding="utf-8") == EARLIER


def test_results_file_that_cannot_be_renamed(tmp_path, no_exit_handlers, monkeypatch):
    path = tmp_path / "generate-test.txt"
    path.write_text(EARLIER, encoding="utf-8")
    staged = results_file.ResultsFile(str(path))

    def refused(*args):
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(OutputError, match="--results-path: cannot write .* give --results-path "
                                          "a directory you can write"):
        with staged.open(str(path), "w", encoding="utf-8") as h:
            print("H-0\t-0.2\tthis run", file=h)
            monkeypatch.setattr(os, "replace", refused)
    assert path.read_text(encoding="utf-8") == EARLIER


def test_results_path_that_cannot_be_written(tmp_path, monkeypatch):
    """A read-only folder (or file system) that holds an earlier file: refused at the start,
    in one line, before fairseq opens anything. Root writes a chmod-ed folder, so the file
    system's refusal is raised where the check meets it."""
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "generate-test.txt").write_text(EARLIER, encoding="utf-8")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results_file.tempfile, "TemporaryFile", read_only)
    argv = ["/venv/bin/fairseq-generate", "data", "--results-path", str(folder)]
    with pytest.raises(UsageError, match=r"--results-path %s: %s cannot be written \(Read-only "
                       r"file system\); give a directory you can write" % (folder, folder)):
        results_file.guard(argv)
    assert (folder / "generate-test.txt").read_text(encoding="utf-8") == EARLIER


# ---------------------------------------------------------------------- the benchmark's files
def test_benchmark_results_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    from fairseq_pardec.benchmark import runner

    rows = [{"generator": "greedy", "batch_size": 1, "sentences_per_s": 3.0, "bleu": 1.0}]
    monkeypatch.setattr(runner, "plot", lambda rows, path: open(path, "wb").write(b"png"))
    runner.write_results(str(tmp_path), "| table |\n", {"run": 1}, rows)
    earlier = {n: (tmp_path / n).read_bytes() for n in runner.RESULT_FILES}
    assert json.loads(earlier["results.json"])["meta"] == {"run": 1}

    def full_disk(rows, path):
        with open(path, "wb") as f:
            f.write(b"half a pl")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "plot", full_disk)  # written last: the others are written by then
    with pytest.raises(OutputError) as failed:
        runner.write_results(str(tmp_path), "| other table |\n", {"run": 2}, rows)
    assert one_line(failed.value).startswith(
        "fairseq_pardec: error: --out-dir: cannot write %s (No space left on device); nothing "
        "was replaced" % (tmp_path / "quality_vs_speed.png"))
    assert {n: (tmp_path / n).read_bytes() for n in runner.RESULT_FILES} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(runner.RESULT_FILES)


def test_one_rename_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("{}", encoding="utf-8")

    def refused(*args):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OutputError, match="on a writable file system"):
        output_files.write_text(str(target), "[1, 2]", "--out-dir")
    assert target.read_text(encoding="utf-8") == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_benchmark_line_on_interruption(tmp_path):
    from fairseq_pardec.benchmark import runner

    assert runner.results_kept(str(tmp_path)) == "no results written"
    (tmp_path / "results.json").write_text("{}", encoding="utf-8")
    assert runner.results_kept(str(tmp_path)) == (
        "no results written; the earlier results.json in %s are kept" % tmp_path)


def test_benchmark_installs_the_boundary_under_python_m(monkeypatch, tmp_path):
    """``python -m`` imports the package while sys.argv[0] is "-m": the boundary (one line on
    Ctrl-C and SIGTERM) is installed by the command line itself."""
    from fairseq_pardec.benchmark import runner

    installed = []
    monkeypatch.setattr(runner, "install_cli_boundary", lambda: installed.append(True))
    monkeypatch.setattr(sys, "argv", [runner.__file__.replace("runner.py", "__main__.py")])
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        runner.cli_main([str(tmp_path), "--path", "x.pt", "--repeats", "0"])
    assert installed == [True]


@pytest.mark.parametrize("flags,needle", [
    (["--generators", "iad:beam=5"], "--generators iad:beam=5: iad decodes greedily (beam 1); "
                                     "drop beam=5, or use beam:beam=5"),
    (["--generators", "greedy:beam=4"], "greedy decodes greedily (beam 1); drop beam=4"),
    (["--generators", "lean_greedy:nbest=2"], "lean_greedy returns one hypothesis; drop nbest=2"),
    (["--generators", "beam:beam=0"], "--generators beam:beam=0: beam must be >= 1 (got 0)"),
    (["--generators", "beam:nbest=0"], "nbest must be >= 1 (got 0)"),
    (["--max-sentences", "0"], "--max-sentences must be >= 1 (got 0)"),
    (["--max-sentences", "-5"], "--max-sentences must be >= 1 (got -5)"),
    (["--warmup-sentences", "-1"], "--warmup-sentences must be >= 0 (got -1)"),
    (["--max-len-a", "-1"], "--max-len-a must be >= 0"),
    (["--max-len-b", "-3"], "--max-len-b must be >= 0"),
    (["--batch-sizes", "1", "0"], "--batch-sizes must be >= 1 (got 0)"),
    (["--threads", "0"], "--threads must be >= 1 (got 0)"),
    (["--generators", "ct2:beam=0"], "--generators ct2:beam=0: ct2 beam=0: the beam must be an "
                                     "integer >= 1"),
])
def test_benchmark_options_refused_before_loading(tmp_path, flags, needle):
    from fairseq_pardec.benchmark import runner

    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"never loaded: refused first")
    args = runner.get_parser().parse_args(
        [str(tmp_path), "--path", str(checkpoint), "--out-dir", str(tmp_path / "out"), *flags])
    with pytest.raises(UsageError) as refused:
        runner.main(args)
    assert needle in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_benchmark_still_takes_iad_at_beam_one():
    from fairseq_pardec.benchmark import runner

    assert runner.parse_spec("iad:beam=1")[1:] == ("iad", {"beam": 1})


# ---------------------------------------------------------------------- fairseq's flags
@pytest.mark.parametrize("flag,needle", [
    ("--required-batch-size-multiple", "each batch's size is a multiple of it"),  # was SIGFPE
    ("--beam", "the hypotheses kept per sentence"),
    ("--nbest", "the hypotheses printed per sentence"),
])
def test_counts_below_one(flag, needle):
    with pytest.raises(UsageError, match="%s must be >= 1 \\(got 0; %s\\)" % (flag, needle)):
        check_sizes(["/venv/bin/fairseq-generate", "data", flag, "0"])
    check_sizes(["/venv/bin/fairseq-generate", "data", flag, "2"])


@pytest.mark.parametrize("flag,value,needle", [
    ("--num-workers", "-1", "--num-workers must be >= 0 (got -1"),
    ("--seed", "-1", "--seed must be between 0 and 2**32 - 1 (got -1)"),
    ("--seed", str(2 ** 32), "--seed must be between 0 and 2**32 - 1"),
])
def test_numbers_fairseq_refuses_only_after_loading(flag, value, needle):
    with pytest.raises(UsageError) as refused:
        check_sizes(["/venv/bin/fairseq-generate", "data", flag, value])
    assert needle in str(refused.value)
    check_sizes(["/venv/bin/fairseq-generate", "data", flag, "0"])


def test_score_reference_with_a_generator_is_refused():
    """fairseq scores the references and decodes nothing: the generator would not be used."""
    d = make_dictionary(12)
    task = make_task(d, generator="iad")
    model = tiny_transformer(task, encoder_layers=1, decoder_layers=1)
    from dataclasses import asdict

    from fairseq.dataclass.configs import GenerationConfig

    args = argparse.Namespace(**dict(asdict(GenerationConfig()), beam=1, score_reference=True))
    with pytest.raises(UsageError, match="--score-reference scores the references and decodes "
                                         "nothing, so --generator iad would not be used"):
        task.build_generator([model], args)
    scorer = make_task(d).build_generator([model], args)  # the default generator: fairseq's scorer
    assert type(scorer).__name__ == "SequenceScorer"


# ---------------------------------------------------------------------- binarized files
@pytest.fixture
def binarized(tmp_path):
    """A binarized split as fairseq-preprocess writes it (mmap), without a subprocess."""
    from fairseq.data import indexed_dataset

    d = make_dictionary(20)
    for lang in ("src", "tgt"):
        d.save(str(tmp_path / ("dict.%s.txt" % lang)))
        prefix = str(tmp_path / ("test.src-tgt.%s" % lang))
        builder = indexed_dataset.make_builder(prefix + ".bin", "mmap", vocab_size=len(d))
        for n in range(3, 9):
            builder.add_item(torch.arange(d.nspecial, d.nspecial + n, dtype=torch.int32))
        builder.finalize(prefix + ".idx")
    return tmp_path


def load_test_split(folder):
    from fairseq_pardec.tasks.translation_pardec import (TranslationPardecConfig,
                                                         TranslationPardecTask)

    task = TranslationPardecTask.setup_task(TranslationPardecConfig(
        data=str(folder), source_lang="src", target_lang="tgt", dataset_impl="mmap"))
    task.load_dataset("test")
    return task


def test_intact_binarized_split_loads(binarized):
    assert len(load_test_split(binarized).dataset("test")) == 6


def test_truncated_bin(binarized):
    data = binarized / "test.src-tgt.tgt.bin"
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UsageError, match="split test: %s is truncated \\(%d bytes; its index "
                       "%s.idx needs %d\\): copy it again, or binarize" % (
                           data, len(whole) // 2, str(data)[:-4], len(whole))):
        load_test_split(binarized)


@pytest.mark.parametrize("damage", ["random", "cut"])
def test_index_that_is_not_an_index(binarized, damage):
    import random

    index = binarized / "test.src-tgt.src.idx"
    whole = index.read_bytes()
    index.write_bytes(bytes(random.Random(0).getrandbits(8) for _ in whole)
                      if damage == "random" else whole[:30])
    with pytest.raises(Exception) as failed:
        load_test_split(binarized)
    line = one_line(failed.value)
    assert line and line.startswith(
        "fairseq_pardec: error: %s is not a file of a binarized split that fairseq can read, or "
        "it is cut short" % index), line


def test_missing_index_is_named(binarized):
    (binarized / "test.src-tgt.src.idx").unlink()
    with pytest.raises(FileNotFoundError) as failed:
        load_test_split(binarized)
    line = one_line(failed.value)
    assert line == (
        "fairseq_pardec: error: --gen-subset test: data directory %s has test.src-tgt.src.bin "
        "but not test.src-tgt.src.idx (fairseq-preprocess writes both): copy the missing file, "
        "or binarize the split again" % binarized)


def test_truncated_bin_met_by_a_dataloader_worker():
    """With the stock translation task the worker's error arrives as text."""
    error = ValueError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback:\n"
                       "ValueError: offset must be non-negative and no greater than buffer "
                       "length (469)")
    assert "shorter than its .idx says (truncated)" in one_line(error)


def test_full_disk_anywhere_is_one_line():
    line = one_line(OSError(errno.ENOSPC, "No space left on device", "ckpt/checkpoint_last.pt"))
    assert line == ("fairseq_pardec: error: No space left on device writing "
                    "ckpt/checkpoint_last.pt: free some space, or write to another disk "
                    "(--save-dir, --results-path, --out-dir)")
    assert one_line(OSError(errno.EIO, "Input/output error")) is None  # not known: a traceback


# ---------------------------------------------------------------------- a real SIGTERM
def test_benchmark_sigterm(tmp_path):
    """SIGTERM while the benchmark loads or decodes: one line, status 143, the earlier results
    kept."""
    from fairseq_pardec.benchmark import runner

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}', encoding="utf-8")
    checkpoint = tmp_path / "model.pt"
    data = tmp_path / "data"
    data.mkdir()
    checkpoint.write_bytes(b"")
    # hold the run after the warning line (the boundary is installed by then) until the signal
    held = ("import sys, time\n"
            "from fairseq_pardec.benchmark import runner\n"
            "runner.run = lambda args: time.sleep(120)\n"
            "sys.argv = [%r]\n"
            "runner.cli_main(%r)\n" % (
                runner.__file__.replace("runner.py", "__main__.py"),
                [str(data), "--path", str(checkpoint), "--out-dir", str(out), "--repeats", "1",
                 "--generators", "greedy"]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-c", held], stderr=subprocess.PIPE, text=True,
                            env=env)
    seen = ""
    began = time.time()
    while "--repeats 1" not in seen and time.time() - began < 120:
        seen += proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    stderr = seen + rest
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    lines = [l for l in stderr.splitlines() if l.startswith("fairseq_pardec: error:")]
    assert lines == ["fairseq_pardec: error: interrupted (SIGTERM): no results written; the "
                     "earlier results.json in %s are kept" % out], stderr[-2000:]
    assert (out / "results.json").read_text(encoding="utf-8") == '{"earlier": true}'


# ---------------------------------------------------------------------- fairseq-train's checkpoints
@pytest.fixture
def fairseq_checkpoint_writes(monkeypatch):
    """The whole-or-nothing checkpoint writes, put back as fairseq's after the test."""
    from fairseq import checkpoint_utils

    from fairseq_pardec import checkpoint_saving

    monkeypatch.setattr(checkpoint_utils, "torch_persistent_save",
                        checkpoint_utils.torch_persistent_save)
    monkeypatch.setattr(checkpoint_utils, "PathManager", checkpoint_utils.PathManager)
    checkpoint_saving.install()
    return checkpoint_utils


def test_checkpoint_on_a_full_disk(tmp_path, fairseq_checkpoint_writes, monkeypatch):
    """fairseq writes NAME.pt.tmp and renames it: a full disk (the .tmp name on /dev/full, so
    ENOSPC is the file system's own) leaves the earlier checkpoint and no .tmp, at once (no
    retries), and one line that names the file."""
    checkpoint_utils = fairseq_checkpoint_writes
    best = tmp_path / "checkpoint_best.pt"
    torch.save({"earlier": True}, best)
    os.symlink("/dev/full", str(best) + ".tmp")
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("a full disk is not retried"))
    with pytest.raises(OutputError) as failed:
        checkpoint_utils.torch_persistent_save({"w": torch.zeros(4096)}, str(best))
    assert failed.value.errno == errno.ENOSPC
    assert one_line(failed.value).startswith(
        "fairseq_pardec: error: --save-dir: cannot write %s (No space left on device); nothing "
        "was replaced" % best)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt"]
    assert torch.load(best) == {"earlier": True}
    checkpoint_utils.torch_persistent_save({"w": 1}, str(best))  # room again: written as before
    assert torch.load(best) == {"w": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt"]


def test_checkpoint_copy_on_a_full_disk(tmp_path, fairseq_checkpoint_writes):
    """checkpoint_last.pt is a copy of the step's first checkpoint: a full disk half-way
    through the copy keeps the earlier checkpoint_last.pt whole."""
    checkpoint_utils = fairseq_checkpoint_writes
    best, last = tmp_path / "checkpoint_best.pt", tmp_path / "checkpoint_last.pt"
    torch.save({"step": 2}, best)
    torch.save({"step": 1}, last)
    os.symlink("/dev/full", str(last) + ".tmp")
    with pytest.raises(OutputError, match="cannot write %s \\(No space left" % last):
        checkpoint_utils.PathManager.copy(str(best), str(last), overwrite=True)
    assert torch.load(last) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]
    assert checkpoint_utils.PathManager.copy(str(best), str(last), overwrite=True)
    assert torch.load(last) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]


def test_fairseq_train_on_a_full_disk(cli_data, stock_checkpoint, tmp_path):
    """fairseq-train itself: the step's checkpoint cannot be written (its .tmp name leads to
    /dev/full); one line naming it, no traceback, no .tmp, the earlier checkpoints unchanged."""
    from cli_setup import PLUGIN, TINY, copy_checkpoints, run

    _, data = cli_data
    save = copy_checkpoints(stock_checkpoint, tmp_path / "ckpt")
    earlier = {p.name: p.read_bytes() for p in save.iterdir()}
    full = [save / "checkpoint_best.pt.tmp", save / "checkpoint_last.pt.tmp"]
    for name in full:
        os.symlink("/dev/full", name)
    # resumed from checkpoint_last.pt: two more updates, then validation and the checkpoints
    proc = run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation", *TINY,
               "--max-update", 14, "--save-dir", save, "--no-epoch-checkpoints", "--eval-bleu",
               "--eval-bleu-args", '{"beam": 1}', "--best-checkpoint-metric", "bleu",
               "--maximize-best-checkpoint-metric", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("fairseq_pardec: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    written = re.match(r"fairseq_pardec: error: --save-dir: cannot write (\S+) \(No space left "
                       r"on device\); nothing was replaced", lines[0])
    assert written, lines[0]
    # the .tmp of the file it names is gone; the other one, never written to, is ours
    assert [str(p)[:-len(".tmp")] for p in full if not os.path.lexists(p)] == [written.group(1)]
    for p in full:
        if os.path.lexists(p):
            os.remove(p)
    assert {p.name: p.read_bytes() for p in save.iterdir()} == earlier
