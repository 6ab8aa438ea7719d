"""Sharded decoding (issue #16): fairseq-generate's --distributed-world-size/--distributed-rank
with every generator, what not to use, and examples/decode-sharded.sh."""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from test_cli import N_TEST, PLUGIN, ROOT  # the CLI fixtures come from conftest.py

RECIPE = os.path.join(ROOT, "examples", "decode-sharded.sh")
BATCH = ["--batch-size", "8"]  # 37 sentences -> batches 8 8 8 8 5: shard 1 of 2 gets a fill slot
MAX_LEN_B = "12"  # the tiny models rarely stop early: the length limit sets the decoding time

# Importing fairseq costs ~6 s of the ~8 s a fairseq-generate takes here; the driver imports it
# once and forks one child per run, each child being exactly `fairseq-generate ARGV` from then on
# (its own seed, task, model and generator). test_docs_commands_in_separate_processes checks that
# real, separate processes give the same output.
DRIVER = r"""
import json, os, sys, traceback
from argparse import Namespace
from fairseq import utils
import fairseq_cli.generate as generate

runs, user_dir, parallel = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
utils.import_user_module(Namespace(user_dir=user_dir))

def child(run):
    for fd, path in ((1, run["out"]), (2, run["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = ["fairseq-generate"] + run["argv"]
    code = 0
    try:
        generate.cli_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code)

codes, pending, alive = {}, list(enumerate(runs)), {}
while pending or alive:
    while pending and len(alive) < parallel:
        i, run = pending.pop(0)
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(run)
        alive[pid] = i
    pid, status = os.wait()
    codes[alive.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(runs))]))
"""


def env(threads=1):
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    # one product kernel in every process: each would otherwise measure its own choice, and
    # the kernels round the printed scores differently (products.KERNEL_VARIABLE)
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", PATH=path,
                FAIRSEQ_PARDEC_KERNEL="native")


def h_lines(stdout):
    """Every H- line as (id, whole line): a dict would hide a sentence decoded twice."""
    return [(int(m.group(1)), m.group(0)) for m in re.finditer(r"^H-(\d+)\t.*$", stdout, re.M)]


# --------------------------------------------------------------- all generate runs, one driver
def generator_flags(name, ckpts):
    stock = ckpts["stock"]
    return {
        "beam": [stock, "--generator", "beam", "--beam", 3],
        "greedy": [stock, "--generator", "greedy"],
        "lean_greedy": [stock, "--generator", "lean_greedy"],
        "iad": [stock, "--generator", "iad"],
        "lookup": [stock, "--generator", "lookup", "--draft-corpus", ckpts["corpus"]],
        "blockwise": [ckpts["blockwise"], "--generator", "blockwise"],
        "gad": [stock, "--generator", "gad", "--drafter-path", ckpts["drafter"], "--block-size", 4],
        "interleaved": [ckpts["ibdecoder"], "--generator", "interleaved", "--beam", 4],
        "auto": [stock, "--generator", "auto", "--draft-corpus", ckpts["corpus"],
                 "--drafter-path", ckpts["drafter"]],
    }[name]


GENERATOR_NAMES = ["beam", "greedy", "lean_greedy", "iad", "lookup", "blockwise", "gad",
                   "interleaved", "auto"]
# fairseq's own search: a shard runs the very products the unsharded run ran on those batches
SAME_COMPUTATION = ("beam", "greedy")
# The H- score is the length-normalised sum of the token log-probabilities (over ln 2). A
# drafting generator may verify other blocks in another process (its drafts are priced from
# timings), so its products have other shapes and round otherwise: each token's log-probability
# stays within the margin guard's bound of fairseq's (cpu/fast.py, DEFAULT_MARGIN = 5e-4) in
# both runs, so the averages differ by at most twice that, / ln 2.
SCORE_TOLERANCE = 2 * 5e-4 / math.log(2)


def shards(world, *flags):
    return [list(flags) + ["--distributed-world-size", world, "--distributed-rank", r]
            for r in range(world)]


@pytest.fixture(scope="session")
def sharded_runs(cli_data, stock_checkpoint, blockwise_checkpoint, drafter_checkpoint,
                 ibdecoder_checkpoint, tmp_path_factory):
    """name -> [(exit status, stdout, stderr) of each run], unsharded first where there is one."""
    root, data = cli_data
    ckpts = {"stock": stock_checkpoint / "checkpoint_last.pt", "blockwise": blockwise_checkpoint,
             "drafter": drafter_checkpoint, "ibdecoder": ibdecoder_checkpoint,
             "corpus": root / "raw" / "train.tgt"}
    stock = ckpts["stock"]
    plan = {}
    for name in GENERATOR_NAMES:
        flags = generator_flags(name, ckpts) + BATCH
        plan[name] = [flags] + shards(2, *flags)
    greedy = generator_flags("greedy", ckpts) + BATCH
    plan["greedy-3"] = shards(3, *greedy)
    sampling = generator_flags("iad", ckpts) + BATCH + [
        "--sampling", "--beam", 1, "--sampling-topk", 5, "--seed", 3]
    plan["sampling"] = [sampling] + shards(2, *sampling)
    plan["stock-task"] = shards(2, stock, "--task", "translation", "--beam", 1, *BATCH)
    plan["num-shards"] = [greedy + ["--num-shards", 2, "--shard-id", 1]]
    plan["mismatched-batches"] = [greedy + ["--distributed-world-size", 2, "--distributed-rank", 1,
                                            "--batch-size", 16]]
    plan["empty-shard"] = [greedy + ["--distributed-world-size", 8, "--distributed-rank", 7]]

    out = tmp_path_factory.mktemp("sharded")
    runs, names = [], []
    for name, argvs in plan.items():
        for k, argv in enumerate(argvs):
            argv = [str(data), "--user-dir", PLUGIN, "--task", "translation_pardec",
                    "--gen-subset", "test", "--max-len-b", MAX_LEN_B, "--path", *map(str, argv)]
            runs.append({"argv": argv, "out": str(out / ("%s.%d.out" % (name, k))),
                         "err": str(out / ("%s.%d.err" % (name, k)))})
            names.append(name)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs), PLUGIN, "2"],
                          capture_output=True, text=True, env=env(), timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {}
    for name, run, code in zip(names, runs, codes):
        with open(run["out"], encoding="utf-8") as f, open(run["err"], encoding="utf-8") as e:
            result.setdefault(name, []).append((code, f.read(), e.read()))
    return result


def ok(runs):
    for code, _, err in runs:
        assert code == 0, err[-3000:]
    return [stdout for _, stdout, _ in runs]


def test_every_generator_is_covered():
    from fairseq_pardec.decoding.registry import GENERATORS

    assert sorted(GENERATOR_NAMES) == sorted(GENERATORS)


@pytest.mark.parametrize("name", GENERATOR_NAMES)
def test_shards_decode_every_sentence_once_as_unsharded(sharded_runs, name):
    full, *parts = ok(sharded_runs[name])
    want = h_lines(full)
    assert sorted(i for i, _ in want) == list(range(N_TEST))
    got = [line for part in parts for line in h_lines(part)]
    ids = [i for i, _ in got]
    assert len(ids) == len(set(ids)) == N_TEST  # exactly once: nothing twice, nothing dropped
    assert all(h_lines(part) for part in parts)  # both shards did work
    if name in SAME_COMPUTATION:  # whole lines, scores to the last digit
        assert sorted(got) == sorted(want)
    # the same hypotheses, and their scores within the rounding of other block shapes
    got, want = (dict((i, line.split("\t", 2)[1:]) for i, line in lines) for lines in (got, want))
    assert {i: text for i, (_, text) in got.items()} == {i: text for i, (_, text) in want.items()}
    for i, (score, _) in got.items():
        assert abs(float(score) - float(want[i][0])) <= SCORE_TOLERANCE, (i, score, want[i][0])


def test_three_shards_and_the_fill_slot(sharded_runs):
    """5 batches over 3 ranks: 2 + 2 + 1 and one padding slot, decoded as nothing."""
    parts = ok(sharded_runs["greedy-3"])
    counts = [len(h_lines(p)) for p in parts]
    assert counts == [16, 13, 8]  # batches (8, 8), (8, 5), (8): the tail batch is kept, last
    got = sorted(line for p in parts for line in h_lines(p))
    assert got == sorted(h_lines(ok(sharded_runs["greedy"])[0]))


def test_stock_task_loses_the_tail_batch_in_a_shard(sharded_runs):
    """The stock task drops the 5-sentence tail batch (--required-batch-size-multiple 8), sharded or
    not (test_cli); ours appends it, so its shards are uneven (21 + 16) but complete."""
    parts = ok(sharded_runs["stock-task"])
    assert [len(h_lines(p)) for p in parts] == [16, 16]
    ours = ok(sharded_runs["greedy"])
    assert [len(h_lines(p)) for p in ours[1:]] == [21, 16]


def test_sampling_shards_draw_other_samples_than_unsharded(sharded_runs):
    full, *parts = ok(sharded_runs["sampling"])
    sharded = [line for p in parts for line in h_lines(p)]
    assert sorted(i for i, _ in sharded) == list(range(N_TEST))
    sharded = dict(sharded)
    # each shard re-seeds and draws for its own batches only: other samples than unsharded
    assert sharded != dict(h_lines(full))


def test_num_shards_is_ignored_by_generate(sharded_runs):
    """--num-shards/--shard-id do not shard fairseq-generate: each 'shard' decodes everything."""
    for stdout in ok(sharded_runs["num-shards"]):
        assert sorted(i for i, _ in h_lines(stdout)) == list(range(N_TEST))


def test_shards_must_batch_alike(sharded_runs):
    """Rank 1 with another --batch-size picks other sentences: duplicates and gaps."""
    rank0 = {i for i, _ in h_lines(ok(sharded_runs["greedy"])[1])}
    rank1 = {i for i, _ in h_lines(ok(sharded_runs["mismatched-batches"])[0])}
    assert rank0 & rank1
    assert rank0 | rank1 != set(range(N_TEST))


def test_more_ranks_than_batches_crash_the_empty_rank(sharded_runs):
    """fairseq-generate divides by the time spent decoding: a rank with no batch exits 1."""
    [(code, stdout, err)] = sharded_runs["empty-shard"]
    assert code == 1
    assert "ZeroDivisionError" in err
    assert h_lines(stdout) == []


def test_docs_commands_in_separate_processes(cli_data, stock_checkpoint, sharded_runs, tmp_path):
    """The commands of docs/sharded-decoding.md, as separate fairseq-generate processes, then
    the merge one-liner: every D- line of the unsharded run, in sentence order."""
    _, data = cli_data
    script = r"""
set -euo pipefail
DATA=$1 CKPT=$2 OUT=$3 N=2
pids=()
for i in $(seq 0 $((N - 1))); do
  fairseq-generate "$DATA" --user-dir "$PLUGIN" --task translation_pardec --generator greedy \
    --path "$CKPT" --gen-subset test --max-len-b 12 --batch-size 8 \
    --distributed-world-size $N --distributed-rank $i > "$OUT/gen.$i.txt" 2> "$OUT/gen.$i.log" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
cat "$OUT"/gen.*.txt | grep '^D-' | sed 's/^D-//' | LC_ALL=C sort -s -n -k1,1 | cut -f3- > "$OUT/hyp.txt"
"""
    proc = subprocess.run(["bash", "-c", script, "docs", str(data),
                           str(stock_checkpoint / "checkpoint_last.pt"), str(tmp_path)],
                          capture_output=True, text=True, env=dict(env(), PLUGIN=PLUGIN),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = ok(sharded_runs["greedy"])[0]
    want = [m.group(2) for m in sorted(
        re.finditer(r"^D-(\d+)\t\S+\t(.*)$", full, re.M), key=lambda m: int(m.group(1)))]
    assert len(want) == N_TEST
    assert (tmp_path / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1] == want


# --------------------------------------------------------------- examples/decode-sharded.sh
def recipe(n, src, out, data, *flags, check=True, **extra_env):
    proc = subprocess.run(["bash", RECIPE, str(n), str(src), str(out), str(data), *map(str, flags)],
                          capture_output=True, text=True, env=dict(env(), **extra_env), timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def interactive_flags(stock_checkpoint):
    return ["--path", stock_checkpoint / "checkpoint_last.pt", "-s", "src", "-t", "tgt",
            "--generator", "iad", "--batch-size", 8, "--max-len-b", MAX_LEN_B]


def test_recipe_merged_equals_unsharded(cli_data, stock_checkpoint, tmp_path):
    root, data = cli_data
    src = root / "raw" / "test.src"
    flags = interactive_flags(stock_checkpoint)
    unsharded = subprocess.Popen(
        [sys.executable, "-m", "fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--task",
         "translation_pardec", "--buffer-size", "2000", "--input", src, *map(str, flags)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    out = tmp_path / "hyp.txt"
    proc = recipe(2, src, out, data, *flags)
    stdout, stderr = unsharded.communicate(timeout=600)
    assert unsharded.returncode == 0, stderr[-3000:]
    want = [m.group(2) for m in re.finditer(r"^D-(\d+)\t\S+\t(.*)$", stdout, re.M)]
    assert len(want) == N_TEST
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == want
    assert "37 lines in 2 shards of <= 19 lines" in proc.stderr
    assert proc.stderr.count("generator=iad | sentences") == 2
    assert [p.name for p in tmp_path.iterdir()] == ["hyp.txt"]  # work directory removed


def fake_interactive(tmp_path, body):
    """A stand-in for fairseq-interactive: the merge and failure paths without loading fairseq."""
    path = tmp_path / "fake-interactive"
    path.write_text("#!/usr/bin/env bash\nset -eu\nfor a; do input=$a; done  # --input is last\n"
                    + body, encoding="utf-8")
    path.chmod(0o755)
    return str(path)


def test_recipe_merges_by_line_id(tmp_path):
    """Hypotheses printed out of order, two per line (n-best), a last line without newline."""
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\nd\ne\nf\ng", encoding="utf-8")  # 7 lines, the last without \n
    fake = fake_interactive(tmp_path, r"""
awk '{ l[NR - 1] = $0 } END { for (i = NR - 1; i >= 0; i--) {
  print "S-" i "\t" l[i]; print "D-" i "\t-0.5\tbest " l[i]; print "D-" i "\t-0.9\tworse " l[i] } }' "$input"
""")
    (tmp_path / "bin").mkdir()
    out = tmp_path / "out.txt"
    proc = recipe(3, src, out, tmp_path / "bin", FAIRSEQ_INTERACTIVE=fake)
    assert "7 lines in 3 shards of <= 3 lines" in proc.stderr
    assert out.read_text(encoding="utf-8") == "".join("best %s\n" % c for c in "abcdefg")
    proc = recipe(8, src, out, tmp_path / "bin", FAIRSEQ_INTERACTIVE=fake)  # more shards than lines
    assert "7 lines in 7 shards of <= 1 lines" in proc.stderr
    assert out.read_text(encoding="utf-8") == "".join("best %s\n" % c for c in "abcdefg")
    src.write_text("", encoding="utf-8")
    recipe(2, src, out, tmp_path / "bin", FAIRSEQ_INTERACTIVE=fake)
    assert out.read_text(encoding="utf-8") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "fake-interactive", "in.txt", "out.txt"]


def test_recipe_one_process_per_gpu(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\nd\ne\n", encoding="utf-8")
    (tmp_path / "bin").mkdir()
    fake = fake_interactive(tmp_path, r"""
awk -v dev="${CUDA_VISIBLE_DEVICES-unset}" -v t="$OMP_NUM_THREADS" \
  '{ print "D-" NR - 1 "\t0\tgpu=" dev " threads=" t }' "$input"
""")
    out = tmp_path / "out.txt"
    recipe(3, src, out, tmp_path / "bin", FAIRSEQ_INTERACTIVE=fake, GPUS="3,5")
    # parts of 2, 2 and 1 lines; shard 2 goes back to the first GPU
    assert [l.split()[0] for l in out.read_text().splitlines()] == ["gpu=3"] * 2 + ["gpu=5"] * 2 + ["gpu=3"]
    recipe(2, src, out, tmp_path / "bin", FAIRSEQ_INTERACTIVE=fake, THREADS="3")
    assert set(out.read_text().splitlines()) == {"gpu= threads=3"}  # CPU: no GPU visible


@pytest.mark.parametrize("args,needle", [
    (["0", "IN", "OUT", "BIN"], "N must be >= 1"),
    (["-2", "IN", "OUT", "BIN"], "N must be a positive integer"),
    (["two", "IN", "OUT", "BIN"], "N must be a positive integer"),
    (["2", "NOFILE", "OUT", "BIN"], "no input file"),
    (["2", "IN", "OUT", "NODIR"], "no data directory"),
    (["2", "IN", "NODIROUT", "BIN"], "no directory"),
    (["2", "IN", "OUT", "BIN", "--input", "x"], "--input is set by this script"),
    (["2", "IN"], "usage: decode-sharded.sh N INPUT OUTPUT DATA_BIN"),
])
def test_recipe_bad_input_one_line(tmp_path, args, needle):
    (tmp_path / "in.txt").write_text("a\n", encoding="utf-8")
    (tmp_path / "bin").mkdir()
    out = tmp_path / "out.txt"
    swap = {"IN": tmp_path / "in.txt", "OUT": out, "BIN": tmp_path / "bin",
            "NOFILE": tmp_path / "missing.txt", "NODIR": tmp_path / "missing",
            "NODIROUT": tmp_path / "missing" / "out.txt"}
    args = [str(swap.get(a, a)) for a in args]
    proc = subprocess.run(["bash", RECIPE, *args], capture_output=True, text=True, env=env())
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decode-sharded.sh: error:"), proc.stderr
    assert needle in lines[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "in.txt"]


def test_recipe_failed_shard_stops_the_others_and_keeps_the_old_output(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("".join("line %d\n" % i for i in range(10)), encoding="utf-8")
    (tmp_path / "bin").mkdir()
    out = tmp_path / "out.txt"
    out.write_text("previous result\n", encoding="utf-8")
    # shard 0 would take a minute; shard 1 fails at once, as a bad flag or an OOM would
    fake = fake_interactive(tmp_path, r"""
case "$input" in
  *part.aaaaaa) echo $$ > "$(dirname "$input")/../sleeper.pid"; exec sleep 60 ;;
  *) echo "fake-interactive: error: argument --generator: invalid choice: 'nope'" >&2; exit 2 ;;
esac
""")
    start = time.time()
    proc = recipe(2, src, out, tmp_path / "bin", check=False, FAIRSEQ_INTERACTIVE=fake)
    assert time.time() - start < 20
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("decode-sharded.sh: error: shard 1 of 2 failed (exit 2): "
                                "fake-interactive: error: argument --generator: invalid choice")
    assert out.read_text(encoding="utf-8") == "previous result\n"
    work = [p for p in tmp_path.iterdir() if p.name.startswith("out.txt.shards.")]
    assert len(work) == 1 and "logs in %s" % work[0] in lines[-1]
    assert not (work[0] / "merged.tmp").exists()
    # the sleeping shard was stopped (a killed child may linger as a zombie: that counts as gone)
    pid_file = tmp_path / "sleeper.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        for _ in range(50):
            if not running(pid):
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            pytest.fail("shard 0 (pid %d) still ran after the recipe failed" % pid)


def running(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_recipe_missing_hypothesis_fails_and_writes_nothing(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\nd\n", encoding="utf-8")
    (tmp_path / "bin").mkdir()
    # a line too long for the model is skipped by --skip-invalid-size-inputs-valid-test
    fake = fake_interactive(tmp_path, r"""awk 'NR != 2 { print "D-" NR-1 "\t0\t" $0 }' "$input"
""")
    out = tmp_path / "out.txt"
    proc = recipe(2, src, out, tmp_path / "bin", check=False, FAIRSEQ_INTERACTIVE=fake)
    assert proc.returncode == 1
    assert "no hypothesis for input line 2 (shard 0" in proc.stderr
    assert "no hypothesis for input line 4 (shard 1" not in proc.stderr  # stops at the first
    assert not out.exists()
