"""The stock fairseq CLIs with --user-dir fairseq_pardec: train, resume, generate, interactive."""

import os
import re
import subprocess
import sys

import pytest

from cli_setup import (  # noqa: F401  (names other test modules import from here)
    MINI, N_TEST, PLUGIN, ROOT, TINY, assert_clean_error, copy_checkpoints, generate, hypotheses, run,
    with_arch,
)


def test_resume_training_from_eval_bleu_checkpoint(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    save = copy_checkpoints(stock_checkpoint, tmp_path / "resumed")
    proc = run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation", *TINY,
               "--max-update", 16, "--save-dir", save, "--eval-bleu",
               "--eval-bleu-args", '{"beam": 1}', "--best-checkpoint-metric", "bleu",
               "--maximize-best-checkpoint-metric")
    assert "Loaded checkpoint" in proc.stderr + proc.stdout
    assert "num_updates 16" in proc.stderr + proc.stdout or "num_updates: 16" in proc.stderr


@pytest.mark.parametrize("batching", [
    ["--batch-size", 8, "--required-batch-size-multiple", 8],
    ["--batch-size", 5, "--required-batch-size-multiple", 3],
    ["--max-tokens", 60],
])
def test_every_sentence_is_decoded(cli_data, stock_checkpoint, batching):
    _, data = cli_data
    out = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "greedy", *batching)
    assert sorted(hypotheses(out.stdout)) == list(range(N_TEST))


def test_iad_identical_to_greedy_and_reports_stats(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    greedy = generate(data, ckpt, "--generator", "greedy", "--batch-size", 16)
    iad = generate(data, ckpt, "--generator", "iad", "--batch-size", 16,
                   fresh=True)  # fairseq-generate as a user starts it
    beam_one = generate(data, ckpt, "--task", "translation", "--beam", 1, "--batch-size", 16,
                        task="translation")
    assert hypotheses(iad.stdout) == hypotheses(greedy.stdout)
    assert len(hypotheses(iad.stdout)) == N_TEST
    # The stock task drops the tail batch (37 = 16 + 16 + 5, 5 not a multiple of 8) ...
    stock = hypotheses(beam_one.stdout)
    assert len(stock) < N_TEST
    # ... and agrees with us on every sentence it does decode.
    assert all(hypotheses(iad.stdout)[i] == h for i, h in stock.items())
    summary = [l for l in iad.stderr.splitlines() if "pardec generator=iad" in l]
    assert len(summary) == 1
    assert "sentences %d" % N_TEST in summary[0]
    assert "mean accepted tokens per iteration" in summary[0]


def test_lookup_with_a_draft_corpus_identical_to_greedy(cli_data, stock_checkpoint):
    root, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    greedy = generate(data, ckpt, "--generator", "greedy", "--batch-size", 8)
    lookup = generate(data, ckpt, "--generator", "lookup", "--draft-corpus", root / "raw" / "train.tgt",
                      "--batch-size", 8)
    assert hypotheses(lookup.stdout) == hypotheses(greedy.stdout)
    assert "lookup drafter: n-gram table of" in lookup.stderr
    proc = generate(data, ckpt, "--generator", "lookup", "--draft-corpus", root / "nope.txt", check=False)
    assert_clean_error(proc, "--draft-corpus", "no such file")


def test_checkpoint_of_our_task_decodes_with_stock_task(cli_data):
    root, data = cli_data
    save = root / "ckpt-ours"
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec", *TINY,
        "--max-update", 4, "--save-dir", save, "--no-epoch-checkpoints",
        fresh=True)  # fairseq-train as a user starts it
    out = generate(data, save / "checkpoint_last.pt", "--beam", 2, "--required-batch-size-multiple", 1,
                   task="translation")
    assert len(hypotheses(out.stdout)) == N_TEST


def test_interactive_empty_line_decodes_and_continues(cli_data, stock_checkpoint):
    _, data = cli_data
    lines = "Це речення .\n\nЩе одне речення .\n"
    out = run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--path",
              stock_checkpoint / "checkpoint_last.pt", "--task", "translation_pardec",
              "--generator", "iad", "--source-lang", "src", "--target-lang", "tgt",
              "--max-len-b", 20, input_text=lines, fresh=True)  # as a user starts it
    assert len(re.findall(r"^H-\d+\t", out.stdout, re.M)) == 3


# ---------------------------------------------------------------- bad input: one line, no traceback
def test_iad_sampling_is_seeded_and_lean_greedy_equals_greedy(cli_data, stock_checkpoint):
    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    runs = [generate(data, ckpt, "--generator", "iad", "--sampling", "--beam", 1, "--sampling-topk", 5,
                     "--temperature", 0.7, "--seed", seed, "--batch-size", 4).stdout
            for seed in (3, 3, 4)]
    assert hypotheses(runs[0]) == hypotheses(runs[1])
    assert sorted(hypotheses(runs[0])) == list(range(N_TEST))
    assert hypotheses(runs[0]) != hypotheses(runs[2])  # another seed, other samples
    greedy = generate(data, ckpt, "--generator", "greedy", "--batch-size", 4).stdout
    lean = generate(data, ckpt, "--generator", "lean_greedy", "--batch-size", 4).stdout
    assert hypotheses(lean) == hypotheses(greedy)


def test_sampling_filters_need_sampling(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    "--sampling-topk", 5, check=False)
    assert_clean_error(proc, "--sampling-topk and --sampling-topp need --sampling")


def test_unknown_generator_lists_choices(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "nope", check=False)
    assert_clean_error(proc, "--generator", "invalid choice", "greedy", "iad")


def test_generator_without_our_task(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                    task="translation", check=False)
    assert_clean_error(proc, "--task translation_pardec")


def test_block_size_must_be_positive(cli_data, stock_checkpoint):
    _, data = cli_data
    for bad in ("0", "-3"):
        proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "iad",
                        "--block-size", bad, check=False)
        assert_clean_error(proc, "--block-size", ">= 1")


@pytest.mark.parametrize("generator,flags,needle", [
    ("iad", ["--drafter-path", "x.pt"], "--drafter-path is an option of --generator gad"),
    ("greedy", ["--block-size", "4"], "--generator greedy does not use it"),
    ("lean_greedy", ["--gad-beta", "3"], "--gad-beta is an option of --generator lookup or gad"),
    ("iad", ["--blockwise-topk", "2"], "--blockwise-topk is an option of --generator blockwise"),
    ("iad", ["--draft-corpus", "x.txt"], "--draft-corpus is an option of --generator lookup"),
])
def test_options_of_another_generator_are_refused(cli_data, stock_checkpoint, generator, flags, needle):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", generator,
                    *flags, check=False)
    assert_clean_error(proc, needle)


def test_missing_data_dir(cli_data, stock_checkpoint):
    root, _ = cli_data
    proc = generate(root / "no-such-dir", stock_checkpoint / "checkpoint_last.pt", check=False)
    assert_clean_error(proc, "does not exist", "no-such-dir")


def test_benchmark_harness(cli_data, stock_checkpoint, tmp_path):
    import json

    _, data = cli_data
    out = tmp_path / "bench"
    proc = run("fairseq_pardec.benchmark", data, "--path", stock_checkpoint / "checkpoint_last.pt",
               "--generators", "beam:beam=2", "greedy", "iad", "--batch-sizes", 1, 4,
               "--repeats", 1, "--max-sentences", 9, "--warmup-sentences", 2, "--threads", 1,
               "--max-len-b", 12, "--no-progress", "--out-dir", out,
               fresh=True)  # the benchmark as a user starts it
    result = json.loads((out / "results.json").read_text())
    rows = {(r["generator"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(g, b) for g in ("beam2", "greedy", "iad") for b in (1, 4)}
    for b in (1, 4):
        # the subset is chosen before batching: 9 sentences are batches of 4, 4 and 1
        assert rows[("greedy", b)]["mean_batch_size"] == (1.0 if b == 1 else 3.0)
        assert rows[("iad", b)]["mean_batch_size"] == (1.0 if b == 1 else 3.0)
        assert rows[("greedy", b)]["decoder_calls"] >= (9 if b == 1 else 1)
        assert rows[("iad", b)]["first_divergence"] is None
        assert rows[("iad", b)]["identical_to_greedy"] == 1.0
        assert rows[("iad", b)]["sentences"] == 9
        assert rows[("greedy", b)]["speedup_vs_greedy"] == 1.0
        assert rows[("beam2", b)]["speedup_vs_beam"] == 1.0
        # how often the margin guard handed a choice to fairseq: counted for the guarded
        # generator (the fast step, exact acceptance), left blank for fairseq's own
        assert rows[("iad", b)]["close_calls"] >= 0
        assert rows[("greedy", b)]["close_calls"] is None
        # the guard's replays are a part of the time of their own, not the engine's
        if rows[("iad", b)]["close_calls"] == 0:
            assert rows[("iad", b)]["guard_share"] is None
        parts = ("verifier_share", "drafter_share", "encoder_share", "guard_share",
                 "engine_share")
        assert abs(sum(rows[("iad", b)][p] or 0.0 for p in parts) - 1.0) < 1e-9
    assert (out / "quality_vs_speed.png").stat().st_size > 0
    assert "| iad | 4 | 3.0 |" in (out / "results.md").read_text()
    assert "| iad | 4 | 3.0 |" in proc.stdout
    # one timed run may still include one-time costs: said, in one line
    assert "fairseq_pardec: warning: --repeats 1" in proc.stderr
    greedy1, greedy4 = rows[("greedy", 1)], rows[("greedy", 4)]
    assert greedy4["decoder_calls"] < greedy1["decoder_calls"]


def test_speed_ratios_are_paired_by_round():
    """A round in which the machine slowed both generators fourfold leaves their ratio alone:
    the median of the per-round ratios, with their range."""
    from fairseq_pardec.benchmark.runner import paired_ratio

    assert paired_ratio([2.0, 8.0, 3.0], [1.0, 4.0, 3.0]) == (2.0, 1.0, 2.0)
    assert paired_ratio([1.0], [0.0]) == (None, None, None)


def test_benchmark_true_batch_sizes(cli_data, stock_checkpoint):
    """A subset of 20 of the 37 test sentences at batch 8: batches of 8, 8, 4, each the shortest
    sentences first, exactly as fairseq orders the subset by length."""
    from fairseq_pardec.benchmark import runner as benchmark

    _, data = cli_data
    args = benchmark.get_parser().parse_args(
        [str(data), "--path", str(stock_checkpoint / "checkpoint_last.pt"), "--cpu"])
    task, model, _, utils = benchmark.load(args)
    dataset = task.dataset("test")

    samples = benchmark.batches(task, model, dataset, 8, 20, False, utils)
    assert [len(s["id"]) for s in samples] == [8, 8, 4]
    # consecutive runs of fairseq's length order of the subset (the collater re-sorts inside a batch)
    subset = [int(i) for i in dataset.ordered_indices() if i < 20]
    assert [sorted(s["id"].tolist()) for s in samples] == [sorted(subset[i:i + 8]) for i in (0, 8, 16)]


def test_demo_verdict_names_the_fastest_lossless_generator(tmp_path):
    """The demo's last lines: fairseq's generators and CTranslate2 are yardsticks, a generator
    that changed one output is not lossless, and no lossless generator is said plainly."""
    import json

    def row(generator, batch, speed, same, **extra):
        return dict(generator=generator, batch_size=batch, sentences_per_s=speed,
                    identical_to_greedy=same, speedup_vs_greedy=speed / 10.0,
                    speedup_vs_ct2=speed / 50.0, mean_accepted_tokens=2.5, **extra)

    rows = [row("greedy", 1, 10.0, 1.0), row("ct2", 1, 50.0, 1.0), row("beam5", 1, 5.0, 0.8),
            row("iad", 1, 20.0, 1.0), row("lookup", 1, 30.0, 0.99), row("auto", 1, 19.0, 1.0),
            row("greedy", 32, 40.0, 1.0), row("lookup", 32, 30.0, 0.5)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {"sentences": 100}, "rows": rows}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo_verdict.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    batch1, auto1, batch32 = out.splitlines()
    assert batch1.startswith("[demo] batch 1 (100 sentences): iad is the fastest lossless")
    assert "2.00x fairseq greedy, 0.40x CTranslate2" in batch1
    assert auto1.startswith("[demo] batch 1 (100 sentences): auto (--generator auto): 19.0 sent/s")
    assert "0.95x the fastest; all outputs identical to greedy" in auto1
    assert batch32.startswith("[demo] batch 32 (100 sentences): no generator gave fairseq greedy")


def test_benchmark_ctranslate2_rows(cli_data, stock_checkpoint, tmp_path):
    """ct2 converts the --path checkpoint once (cached) and decodes the same sentences; float32
    greedy gives fairseq greedy's output."""
    pytest.importorskip("ctranslate2")
    import json

    _, data = cli_data
    out = tmp_path / "bench"
    args = [data, "--path", stock_checkpoint / "checkpoint_last.pt", "--batch-sizes", 1, 5,
            "--repeats", 1, "--max-sentences", 12, "--warmup-sentences", 2, "--threads", 1,
            "--max-len-b", 12, "--no-progress", "--out-dir", out]
    run("fairseq_pardec.benchmark", *args, "--generators", "greedy", "ct2",
        "ct2:compute_type=int8", "ct2:beam=2")
    result = json.loads((out / "results.json").read_text())
    rows = {(r["generator"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(g, b) for g in ("greedy", "ct2", "ct2(compute_type=int8)", "ct2(beam=2)")
                         for b in (1, 5)}
    for b in (1, 5):
        assert rows[("ct2", b)]["sentences"] == 12
        assert rows[("ct2", b)]["identical_to_greedy"] == 1.0
        assert rows[("ct2", b)]["mean_batch_size"] == (1.0 if b == 1 else 4.0)
        assert rows[("ct2", b)]["speedup_vs_ct2"] == 1.0  # the float32 greedy row is the yardstick
        assert rows[("greedy", b)]["speedup_vs_ct2"] > 0
    # the step table: one row per batch decoded, CTranslate2's ms per step beside ours
    steps = {s["batch_size"]: s for s in result["meta"]["steps"]}
    assert set(steps) == {1, 5}
    for step in steps.values():
        assert step["engine"] == "FastBlockDecoder"
        assert all(step[key] > 0 for key in ("fairseq", "lean", "block 1", "block 16", "ct2_ms_per_step"))
    assert "| ct2 step |" in (out / "results.md").read_text()
    assert len(list((out / "ct2-cache").iterdir())) == 1  # one conversion for three rows
    for bad, needle in (("ct2:lenpen=2", "lenpen"), ("ct2:compute_type=float99", "compute_type")):
        proc = run("fairseq_pardec.benchmark", *args, "--generators", "greedy", bad, check=False)
        assert_clean_error(proc, needle)


def test_benchmark_ctranslate2_missing_says_how_to_install(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    code = (
        "import sys; sys.modules['ctranslate2'] = None\n"  # as if the extra were not installed
        "from fairseq_pardec.benchmark import cli_main; cli_main(sys.argv[1:])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(data), "--path", str(stock_checkpoint / "checkpoint_last.pt"),
         "--generators", "greedy", "ct2", "--batch-sizes", "1", "--repeats", "1", "--max-sentences",
         "2", "--no-progress", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert_clean_error(proc, "pip install -e '.[ct2]'")


def test_safe_loading_allowlist_is_what_makes_checkpoints_load(stock_checkpoint):
    """torch's weights-only loader refuses a --eval-bleu checkpoint until the plugin is imported."""
    code = (
        "import sys, torch\n"
        "p = sys.argv[1]\n"
        "try:\n"
        "    torch.load(p, weights_only=True); print('plain: loaded')\n"
        "except Exception:\n"
        "    print('plain: refused')\n"
        "import fairseq_pardec\n"
        "state = torch.load(p, weights_only=True)\n"
        "print('plugin: loaded', sorted(state)[:2])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(stock_checkpoint / "checkpoint_best.pt")],
                          capture_output=True, text=True, cwd=ROOT)
    assert "plain: refused" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "plugin: loaded" in proc.stdout, proc.stderr[-2000:]


def test_light_heads_train_with_fairseq_train_and_decode_as_greedy(cli_data, stock_checkpoint, tmp_path):
    root, data = cli_data
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
        *with_arch("blockwise_transformer"), "--proposal-heads", 3, "--identity-first-head",
        "--freeze-base", "--init-from-transformer", stock_checkpoint / "checkpoint_last.pt",
        "--proposal-layer", "light", "--proposal-hidden-dim", 8,
        "--criterion", "blockwise_cross_entropy", "--max-update", 4, "--save-dir", tmp_path,
        "--no-epoch-checkpoints")
    base = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "greedy",
                    "--batch-size", 8)
    light = generate(data, tmp_path / "checkpoint_last.pt", "--generator", "blockwise",
                     "--batch-size", 8)
    assert hypotheses(light.stdout) == hypotheses(base.stdout)


def test_blockwise_cli_frozen_identity_equals_base_greedy(cli_data, stock_checkpoint, blockwise_checkpoint):
    _, data = cli_data
    base = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "greedy",
                    "--batch-size", 8)
    blockwise = generate(data, blockwise_checkpoint, "--generator", "blockwise", "--batch-size", 8)
    assert hypotheses(blockwise.stdout) == hypotheses(base.stdout)
    assert len(hypotheses(blockwise.stdout)) == N_TEST
    assert "pardec generator=blockwise" in blockwise.stderr
    # a smaller block at generate time, top-k acceptance: runs, decodes everything
    relaxed = generate(data, blockwise_checkpoint, "--generator", "blockwise", "--block-size", 2,
                       "--blockwise-topk", 2, "--batch-size", 8)
    assert len(hypotheses(relaxed.stdout)) == N_TEST


def test_benchmark_other_checkpoint_in_same_process(cli_data, stock_checkpoint, blockwise_checkpoint, tmp_path):
    """path= puts a blockwise model next to the base model's greedy row; speedups stay vs that row."""
    import json

    _, data = cli_data
    out = tmp_path / "bench"
    run("fairseq_pardec.benchmark", data, "--path", stock_checkpoint / "checkpoint_last.pt",
        "--generators", "greedy", "blockwise:path=%s,label=bw-frozen" % blockwise_checkpoint,
        "--batch-sizes", 3, "--repeats", 1, "--max-sentences", 9, "--warmup-sentences", 2,
        "--threads", 1, "--max-len-b", 12, "--no-progress", "--out-dir", out)
    rows = {r["generator"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["bw-frozen"]["identical_to_greedy"] == 1.0  # identity p_1, frozen base
    assert rows["bw-frozen"]["checkpoint"] == str(blockwise_checkpoint)
    assert rows["greedy"]["speedup_vs_greedy"] == 1.0
    # a model with another vocabulary is refused in one line
    bad = run("fairseq_pardec.benchmark", data, "--path", stock_checkpoint / "checkpoint_last.pt",
              "--generators", "greedy:path=/no/such.pt", "--out-dir", out, check=False)
    assert_clean_error(bad, "/no/such.pt", "does not exist")


@pytest.mark.parametrize("flags,needle", [
    (["--block-size", 4], "larger than the model's --proposal-heads 3"),
    (["--min-block-size", 4], "--min-block-size 4 is larger than the block size 3"),
    (["--blockwise-distance", -1], "--blockwise-distance"),
    (["--blockwise-distance", 1], "ordinal vocabulary"),
])
def test_blockwise_bad_input(cli_data, blockwise_checkpoint, flags, needle):
    _, data = cli_data
    proc = generate(data, blockwise_checkpoint, "--generator", "blockwise", *flags, check=False)
    assert_clean_error(proc, needle)


def test_blockwise_generator_needs_proposal_heads(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "blockwise",
                    check=False)
    assert_clean_error(proc, "proposal heads", "blockwise_transformer")


def test_plugin_checkpoint_without_user_dir_fails_as_documented(cli_data, blockwise_checkpoint):
    """docs/troubleshooting.md documents fairseq's (misleading) error for a plugin arch without
    --user-dir."""
    _, data = cli_data
    proc = run("fairseq_cli.generate", data, "--path", blockwise_checkpoint, "--gen-subset",
               "test", check=False)
    assert proc.returncode != 0
    # torch >= 2.6 refuses the checkpoint's argparse.Namespace before fairseq even looks for the
    # architecture (older torch: fairseq's IndexError/KeyError); troubleshooting.md documents both
    assert re.search(r"argparse.Namespace|IndexError|KeyError", proc.stderr)


def test_gad_cli_equals_greedy(cli_data, stock_checkpoint, drafter_checkpoint):
    _, data = cli_data
    verifier = stock_checkpoint / "checkpoint_last.pt"
    greedy = generate(data, verifier, "--generator", "greedy", "--batch-size", 8)
    gad = generate(data, verifier, "--generator", "gad", "--drafter-path", drafter_checkpoint,
                   "--block-size", 4, "--batch-size", 8)
    assert hypotheses(gad.stdout) == hypotheses(greedy.stdout)
    assert "pardec generator=gad" in gad.stderr
    plus = generate(data, verifier, "--generator", "gad", "--drafter-path", drafter_checkpoint,
                    "--gad-beta", 3, "--gad-tau", 1.0, "--batch-size", 8)
    assert len(hypotheses(plus.stdout)) == N_TEST


def test_self_distilled_block_causal_drafter_on_a_verifier(cli_data, stock_checkpoint, tmp_path):
    """The fast path: self-distillation (one line per training source), a block-causal drafter
    reading the verifier's encoder and starting from its decoder, trained with the stock
    fairseq-train; GAD with it equals greedy."""
    root, data = cli_data
    verifier = stock_checkpoint / "checkpoint_last.pt"
    env = dict(os.environ, BEAM="1", GENERATOR="lean_greedy", CPU="1", THREADS="1",
               OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    out = tmp_path / "self"
    subprocess.run(["bash", os.path.join(ROOT, "examples", "distill.sh"), str(data), str(verifier),
                    str(root / "raw"), str(out), "src", "tgt"], check=True, env=env,
                   capture_output=True, timeout=600)
    sources = (root / "raw" / "train.src").read_text(encoding="utf-8").splitlines()
    targets = (out / "raw" / "train.tgt").read_text(encoding="utf-8").splitlines()
    assert len(targets) == len(sources) == 300
    # the targets are the verifier's own greedy output for the training sources, in their order
    # (decoded as distill.sh decodes them: same batches, same length limit)
    greedy = generate(data, verifier, "--generator", "lean_greedy", "--beam", 1, "--gen-subset",
                      "train", "--max-tokens", 8000, "--max-len-b", 200)
    decoded = hypotheses(greedy.stdout)
    assert len(decoded) == 300 and all(targets[i] == text for i, text in decoded.items())

    save = tmp_path / "drafter"
    run("fairseq_cli.train", out / "bin", "--user-dir", PLUGIN, "--task", "translation_pardec",
        *with_arch("glat_drafter"), "--drafter-block-size", 4, "--criterion", "glat_loss",
        "--drafter-attention", "block-causal", "--drafter-encoder", "verifier",
        "--init-from-verifier", verifier, "--init-drafter-decoder", "--glat-anneal-updates", 10,
        "--max-update", 6, "--save-dir", save, "--no-epoch-checkpoints")
    drafter = save / "checkpoint_last.pt"
    want = generate(data, verifier, "--generator", "greedy", "--batch-size", 8)
    got = generate(data, verifier, "--generator", "gad", "--drafter-path", drafter, "--batch-size", 8)
    assert hypotheses(got.stdout) == hypotheses(want.stdout)
    assert len(hypotheses(got.stdout)) == N_TEST


@pytest.mark.parametrize("flags,needle", [
    ([], "--drafter-path"),
    (["--drafter-path", "/no/such/drafter.pt"], "no such file"),
    (["--drafter-path", "VERIFIER"], "not a glat_drafter"),
    (["--drafter-path", "DRAFTER", "--gad-beta", 0], "--gad-beta"),
    (["--drafter-path", "DRAFTER", "--gad-tau", -1], "--gad-tau"),
    (["--drafter-path", "DRAFTER", "--block-size", 0], "--block-size"),
])
def test_gad_bad_input(cli_data, stock_checkpoint, drafter_checkpoint, flags, needle):
    _, data = cli_data
    verifier = stock_checkpoint / "checkpoint_last.pt"
    swap = {"VERIFIER": verifier, "DRAFTER": drafter_checkpoint}
    flags = [swap.get(f, f) if isinstance(f, str) else f for f in flags]
    proc = generate(data, verifier, "--generator", "gad", *flags, check=False)
    assert_clean_error(proc, needle)


def test_gad_dictionary_mismatch(cli_data, stock_checkpoint, tmp_path):
    """A drafter trained on another dictionary is refused, naming both sizes."""
    root, data = cli_data
    other = tmp_path / "other"
    run("fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", root / "raw" / "train", "--destdir", other, "--joined-dictionary",
        "--nwordssrc", 300, "--workers", 1)
    for split in ("valid", "test"):
        for f in os.listdir(data):
            if f.startswith(split):
                os.symlink(data / f, other / f)
    tiny = with_arch("glat_drafter")
    run("fairseq_cli.train", other, "--user-dir", PLUGIN, "--task", "translation_pardec", *tiny,
        "--drafter-block-size", 4, "--criterion", "glat_loss", "--max-update", 1,
        "--save-dir", tmp_path / "d", "--no-epoch-checkpoints", "--disable-validation")
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "gad",
                    "--drafter-path", tmp_path / "d" / "checkpoint_last.pt", check=False)
    assert_clean_error(proc, "dictionaries differ")


@pytest.mark.parametrize("flags", [
    ["--ib-directions", 4],                          # IMDecoder: direction embeddings are new
    ["--ib-directions", 2, "--ib-positions", "learned"],  # double-token: learned positions are new
])
def test_ibdecoder_init_from_transformer(cli_data, stock_checkpoint, tmp_path, flags):
    """A trained fairseq transformer seeds every IBDecoder parameter it has."""
    import torch

    _, data = cli_data
    stock = stock_checkpoint / "checkpoint_last.pt"
    run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
        *with_arch("ibdecoder"), *flags, "--init-from-transformer", stock, "--lr", 1e-12,
        "--warmup-updates", 1, "--max-update", 1, "--save-dir", tmp_path, "--no-epoch-checkpoints")
    base = torch.load(stock, map_location="cpu", weights_only=False)["model"]
    tuned = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    for key in ("encoder.layers.0.fc1.weight", "decoder.layers.0.self_attn.k_proj.weight",
                "decoder.embed_tokens.weight"):
        assert torch.allclose(base[key], tuned[key], atol=1e-6), key


def test_ibdecoder_init_from_other_model_is_refused(cli_data, blockwise_checkpoint, tmp_path):
    _, data = cli_data
    proc = run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
               *with_arch("ibdecoder"), "--init-from-transformer", blockwise_checkpoint,
               "--max-update", 1, "--save-dir", tmp_path, check=False)
    assert_clean_error(proc, "--init-from-transformer", "does not match this model", "decoder.proposal")


def test_ibdecoder_cli_decodes_every_sentence(cli_data, ibdecoder_checkpoint):
    _, data = cli_data
    default = generate(data, ibdecoder_checkpoint, "--beam", 4, "--batch-size", 8)  # beam -> interleaved
    explicit = generate(data, ibdecoder_checkpoint, "--generator", "interleaved", "--beam", 4,
                        "--batch-size", 8)
    assert hypotheses(default.stdout) == hypotheses(explicit.stdout)
    assert len(hypotheses(explicit.stdout)) == N_TEST
    assert "pardec generator=interleaved" in explicit.stderr


def test_ibdecoder_bad_input(cli_data, stock_checkpoint, ibdecoder_checkpoint):
    root, data = cli_data
    proc = generate(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "interleaved",
                    check=False)
    assert_clean_error(proc, "ibdecoder")
    proc = generate(data, ibdecoder_checkpoint, "--generator", "iad", check=False)
    assert_clean_error(proc, "--generator interleaved")
    proc = generate(data, ibdecoder_checkpoint, "--diverse-beam-groups", 2, check=False)
    assert_clean_error(proc, "--diverse-beam-groups")
    proc = run("fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "translation_pardec",
               *with_arch("ibdecoder"), "--ib-directions", 3, "--max-update", 1,
               "--save-dir", root / "ckpt-bad", check=False)
    assert_clean_error(proc, "--ib-directions", "even")
