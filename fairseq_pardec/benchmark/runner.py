"""Side-by-side decoding benchmark: ``python -m fairseq_pardec.benchmark DATA --path CKPT ...``.

One process, one loaded model, the same sentences for every generator. Protocol: a warm-up pass
per generator, then ``--repeats`` rounds in which the generators run one after another, each
round starting one generator later (A B C, B C A, C A B, ...), at every batch size; a
generator's time is the median over rounds of its total decode time (``generate`` calls only:
batching and detokenisation excluded); ``torch`` threads fixed. A speed ratio between two
generators is the median over rounds of the ratio within each round (paired: what the machine
does to both in one round cancels), with its range over the rounds.

Reports BLEU and chrF (sacrebleu, on text after removing BPE), latency, sentences/s, speedup vs
greedy and vs beam at the same batch size, mean accepted tokens per iteration, iterations per
sentence and the identical-to-greedy rate. Writes ``results.md``, ``results.json`` and
``quality_vs_speed.png`` to ``--out-dir``.
"""

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from argparse import Namespace

import torch

from fairseq_pardec.benchmark.report import markdown, plot
from fairseq_pardec.benchmark.specs import check_spec
from fairseq_pardec import errors, failures
from fairseq_pardec.errors import (PREFIX, UsageError, install_cli_boundary,
                                   running_a_cli, warn)
from fairseq_pardec.input_files import require_file
from fairseq_pardec.output_files import replace_together

logger = logging.getLogger("fairseq_pardec.benchmark")


# ---------------------------------------------------------------------- generator specs
def parse_spec(spec):
    """``name`` or ``name:key=value,key=value`` -> (label, name, {key: value}).

    ``label=TEXT`` names the row in the report (default: the name and its options).

    Keys are fairseq generation options (beam, lenpen, max_len_a, ...) or task options of
    translation_pardec (block_size, ...); values are parsed as Python literals when possible.
    ``path=CKPT`` decodes with another checkpoint of the same dictionaries (a blockwise or an
    IBDecoder model next to the Transformer's greedy and beam rows, in the same process).
    """
    import ast

    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError("bad generator option %r in %r (want key=value)" % (item, spec))
        try:
            options[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key.replace("-", "_")] = value
    check_spec(spec, options)
    if name == "beam" and "beam" not in options:
        options["beam"] = 5
    label = options.pop("label", None)
    if label is None:
        label = name if name != "beam" else "beam%d" % options["beam"]
        extra = {k: v for k, v in options.items() if k != "beam" or name != "beam"}
        if extra:
            label += "(" + ",".join("%s=%s" % kv for kv in sorted(extra.items())) + ")"
    return str(label), name, options


def generation_args(options, defaults):
    """fairseq's generation defaults (beam 1 unless a spec asks), the run's length limits."""
    from dataclasses import asdict

    from fairseq.dataclass.configs import GenerationConfig

    args = asdict(GenerationConfig())
    args.update(beam=1, max_len_a=defaults.max_len_a, max_len_b=defaults.max_len_b,
                prefix_allowed_tokens_fn=None)
    args.update(options)
    return Namespace(**args)


# ---------------------------------------------------------------------- loading
def load(args):
    from fairseq import checkpoint_utils, tasks, utils

    import fairseq_pardec  # noqa: F401  (registers the task, allows safe checkpoint loading)
    # Let fairseq's own parser build the task config, exactly as fairseq-generate does.
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [args.data, "--task", "translation_pardec", "--path", args.path]
    if args.source_lang:
        argv += ["--source-lang", args.source_lang]
    if args.target_lang:
        argv += ["--target-lang", args.target_lang]
    parser = options.get_generation_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))
    task = tasks.setup_task(cfg.task)
    task.report_summary = False  # the benchmark reports itself
    task.warm_up_generators = False  # its own warm-up, or none with --warmup-sentences 0
    use_cuda = torch.cuda.is_available() and not args.cpu
    model = load_model(task, args.path, args, use_cuda)
    task.load_dataset(args.gen_subset)
    return task, model, use_cuda, utils


def load_model(task, path, args, use_cuda, flag="--path"):
    """The checkpoint ``path``, given by ``flag`` (``--path``, or ``path=`` of a generator)."""
    from fairseq import checkpoint_utils

    require_file(path, flag, "checkpoint file", ".pt")
    try:
        models, _ = checkpoint_utils.load_model_ensemble([path], task=task)
    except RuntimeError as e:
        if "size mismatch" not in str(e):  # not another vocabulary: a real failure, as it is
            raise
        sizes = failures.dictionary_sizes(e) or str(e).splitlines()[-1].strip()
        raise UsageError(failures.other_dictionaries(
            "%s %s" % (flag, path), sizes, "those of the data %s" % args.data)) from None
    model = models[0]
    if args.fp16:
        model.half()
    elif args.bf16:
        model.to(torch.bfloat16)
    if use_cuda:
        model.cuda()
    return model.eval()


def precision(args):
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def batches(task, model, dataset, batch_size, max_sentences, use_cuda, utils):
    """Length-sorted batches of ``batch_size`` sentences (the last one smaller).

    The subset (the first ``max_sentences`` sentences) is chosen *before* batching, so a row at
    batch 32 decodes batches of 32, not the members of whole-split batches that fall inside
    the subset. Batching itself is fairseq's: its length order, size filter and collater.
    """
    indices = dataset.ordered_indices()
    if max_sentences is not None:
        indices = indices[indices < max_sentences]
    max_positions = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    indices = task.filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs=True)
    out = []
    for batch in dataset.batch_by_size(indices, max_sentences=batch_size, required_batch_size_multiple=1):
        sample = dataset.collater([dataset[int(i)] for i in batch])
        out.append(utils.move_to_cuda(sample) if use_cuda else sample)
    return out


# ---------------------------------------------------------------------- decoding
def spec_path(spec, args):
    return os.path.abspath(spec[2].get("path", args.path))


def build(task, model, spec, defaults, use_cuda=False):
    label, name, options = spec
    options = {k: v for k, v in options.items() if k != "path"}
    if name == "ct2":
        return build_ct2(task, model, spec_path(spec, defaults), options, defaults, use_cuda)
    from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig

    task_keys = set(TranslationPardecConfig.__dataclass_fields__) - {"data"}
    task_options = {k: v for k, v in options.items() if k in task_keys}
    gen_options = {k: v for k, v in options.items() if k not in task_keys}
    variant = task.with_options(generator=name, **task_options)
    return variant.build_generator([model], generation_args(gen_options, defaults))


def build_ct2(task, model, path, options, defaults, use_cuda):
    from fairseq_pardec.benchmark import ctranslate2_baseline

    ctranslate2_baseline.check_options(options)
    model_dir = ctranslate2_baseline.convert(
        model, path, defaults.data, os.path.join(defaults.out_dir, "ct2-cache"),
        defaults.source_lang, defaults.target_lang,
    )
    return ctranslate2_baseline.CTranslate2Generator(
        model_dir, task.source_dictionary, task.target_dictionary,
        beam=int(options.get("beam", 1)), compute_type=str(options.get("compute_type", "float32")),
        threads=defaults.threads, device="cuda" if use_cuda else "cpu",
        max_len_a=defaults.max_len_a, max_len_b=defaults.max_len_b,
        max_positions=model.max_decoder_positions(),
    )


def decode(task, model, generator, samples, progress=None):
    """Decode every batch; returns {sentence id: tokens}, the generator's statistics and the
    number of ``generate`` calls (so that the batch size actually decoded is measured)."""
    outputs = {}
    generator.stats.reset()
    calls = 0
    for sample in samples:
        hypos = task.inference_step(generator, [model], sample, prefix_tokens=None)
        calls += 1
        for sid, hypo in zip(sample["id"].tolist(), hypos):
            outputs[sid] = hypo[0]["tokens"].int().cpu()
        if progress is not None:
            progress.update(len(hypos))
    stats = generator.stats.as_dict()
    stats["generate_calls"] = calls
    return outputs, stats


def first_difference(a, b):
    """Index of the first position where sequences ``a`` and ``b`` differ (the shorter one's
    length when one is a prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(outputs, reference):
    """Share of sentences identical to ``reference`` and, over the others, the mean index of the
    first token where they differ. Values are token tensors or lists (of ids or words)."""
    as_list = lambda x: x.tolist() if torch.is_tensor(x) else list(x)  # noqa: E731
    firsts = [first_difference(as_list(tokens), as_list(reference[sid])) for sid, tokens in outputs.items()]
    firsts = [f for f in firsts if f is not None]
    identical = 1.0 - len(firsts) / max(1, len(outputs))
    return identical, (statistics.mean(firsts) if firsts else None)


def to_text(task, tokens, remove_bpe):
    return task.target_dictionary.string(tokens, remove_bpe, extra_symbols_to_ignore={task.target_dictionary.eos()})


def quality(task, outputs, references, remove_bpe, sources=None):
    """BLEU and chrF against the references; with ``sources`` (text), also the share of
    outputs identical to their source (how much a GEC model copies: what IAD feeds on)."""
    import sacrebleu

    ids = sorted(outputs)
    hyps = [to_text(task, outputs[i], remove_bpe) for i in ids]
    refs = [references[i] for i in ids]
    result = {
        "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
    }
    if sources is not None:
        result["identical_to_source"] = sum(h == sources[i] for h, i in zip(hyps, ids)) / max(1, len(ids))
    return result


def machine_description(use_cuda, threads):
    if use_cuda:
        return "%s, CUDA %s" % (torch.cuda.get_device_name(0), torch.version.cuda)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "CPU %s, %d cores visible, torch threads %d" % (cpu, os.cpu_count() or 0, threads)


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip() or None
    except OSError:
        return None


# "x best single": a row's speed over the fastest of these in the same run
SINGLE_GENERATORS = ("lean_greedy", "iad", "lookup")


def run(args):
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task, model, use_cuda, utils = load(args)
    dataset = task.dataset(args.gen_subset)
    specs = [parse_spec(s) for s in args.generators]
    labels = [s[0] for s in specs]
    if len(set(labels)) != len(labels):
        raise UsageError("a generator is listed twice: %s" % labels)
    n_sentences = len(dataset) if args.max_sentences is None else min(args.max_sentences, len(dataset))
    references = {
        i: task.target_dictionary.string(dataset.tgt[i], args.remove_bpe)
        for i in range(n_sentences)
    }
    # outputs equal to their source are only possible with one shared vocabulary (GEC)
    sources = None
    if task.source_dictionary.symbols == task.target_dictionary.symbols:
        sources = {
            i: task.source_dictionary.string(dataset.src[i], args.remove_bpe)
            for i in range(n_sentences)
        }
    # every checkpoint is loaded once, before any timing
    models = {os.path.abspath(args.path): model}
    paths = {}
    for spec in specs:
        path = paths[spec[0]] = spec_path(spec, args)
        if path not in models:
            models[path] = load_model(task, path, args, use_cuda, "--generators path=")
    # speedups are relative to the --path model's own greedy and beam rows
    greedy_label = next((s[0] for s in specs if s[1] == "greedy" and "path" not in s[2]), None)
    beam_label = next((s[0] for s in specs if s[1] == "beam" and "path" not in s[2]), None)
    # CTranslate2's greedy float32 row, the yardstick users convert to
    ct2_label = next((s[0] for s in specs if s[1] == "ct2" and int(s[2].get("beam", 1)) == 1
                      and s[2].get("compute_type", "float32") == "float32"), None)
    steps = []

    rows = []
    for batch_size in args.batch_sizes:
        samples = batches(task, model, dataset, batch_size, args.max_sentences, use_cuda, utils)
        generators = {spec[0]: build(task, models[paths[spec[0]]], spec, args, use_cuda) for spec in specs}
        # at least one batch, unless --warmup-sentences 0 asks for none (cold timings)
        warm = samples[: max(1, args.warmup_sentences // batch_size)] if args.warmup_sentences else []
        for label, generator in generators.items():  # warm-up (caches, allocator, threads)
            decode(task, models[paths[label]], generator, warm)
        times = {label: [] for label in generators}
        outputs, stats = {}, {}
        total = len(generators) * args.repeats * n_sentences
        with tqdm(total=total, desc="batch %d" % batch_size, unit="sent", file=sys.stderr,
                  disable=args.no_progress) as progress:
            order = list(generators.items())
            for round_ in range(args.repeats):
                # alternating, each round starting one later: no generator always runs first
                turn = round_ % len(order)
                for label, generator in order[turn:] + order[:turn]:
                    out, st = decode(task, models[paths[label]], generator, samples, progress)
                    times[label].append(st["wall_time"])
                    outputs[label], stats[label] = out, st
        for label in generators:
            wall = statistics.median(times[label])
            st = stats[label]
            row = {
                "generator": label,
                "batch_size": batch_size,
                "mean_batch_size": st["sentences"] / max(1, st["generate_calls"]),
                "sentences": st["sentences"],
                "wall_time_s": wall,
                "wall_times_s": times[label],
                "sentences_per_s": st["sentences"] / wall if wall > 0 else None,
                "latency_ms_per_sentence": 1000.0 * wall / max(1, st["sentences"]),
                "mean_accepted_tokens": st["tokens_per_iteration"],
                "iterations_per_sentence": st["row_iterations"] / max(1, st["sentences"]),
                "decoder_calls": st["decoder_calls"],
                "drafter_share": (st["drafter_time"] / st["wall_time"]
                                  if st.get("drafter_time") and st["wall_time"] > 0 else None),
                "verifier_share": (st["verifier_time"] / st["wall_time"]
                                   if st.get("verifier_time") and st["wall_time"] > 0 else None),
                "encoder_share": (st["encoder_time"] / st["wall_time"]
                                  if st.get("encoder_time") and st["wall_time"] > 0 else None),
                "guard_share": (st["guard_time"] / st["wall_time"]
                                if st.get("guard_time") and st["wall_time"] > 0 else None),
                "target_tokens": st["target_tokens"],
                # decisions the margin guard handed to fairseq's own search (the last run's),
                # for generators that have the guard
                "close_calls": st.get("close_calls") if _guarded(generators[label]) else None,
                # of those, the ones one teacher-forced pass decided (the rest were replayed
                # step by step)
                "close_calls_in_one_pass": (st.get("close_calls_in_one_pass")
                                            if _guarded(generators[label]) else None),
                # the margins in force, as measured on the model (step/calibration.py)
                "margins": st.get("margins") or None,
                "checkpoint": paths[label],
                # --generator auto: each drafter's share of the row-iterations (the last run's)
                "drafts": getattr(generators[label].stats, "drafter_shares", str)() or None,
            }
            if row["verifier_share"] is not None:  # what runs between the model's calls
                row["engine_share"] = 1.0 - sum(row[part] or 0.0 for part in (
                    "verifier_share", "drafter_share", "encoder_share", "guard_share"))
            row.update(quality(task, outputs[label], references, args.remove_bpe, sources))
            if greedy_label is not None:
                same, first = divergence(outputs[label], outputs[greedy_label])
                row["identical_to_greedy"] = same
                row["first_divergence"] = first
            rows.append(row)
        by_label = {r["generator"]: r for r in rows if r["batch_size"] == batch_size}
        # the fastest (by median) of the single generators auto chooses among, on the --path
        # model
        singles = [s[0] for s in specs if s[1] in SINGLE_GENERATORS and "path" not in s[2]
                   and by_label[s[0]]["sentences_per_s"]]
        best_single = min(singles, key=lambda label: by_label[label]["wall_time_s"], default=None)
        for row in by_label.values():
            for ref_label, key in ((greedy_label, "speedup_vs_greedy"), (beam_label, "speedup_vs_beam"),
                                   (ct2_label, "speedup_vs_ct2"),
                                   (best_single, "speedup_vs_best_single")):
                if ref_label is not None and row["wall_time_s"] > 0:
                    ratio, low, high = paired_ratio(by_label[ref_label]["wall_times_s"],
                                                    row["wall_times_s"])
                    row[key], row[key + "_range"] = ratio, [low, high]
            if greedy_label is not None:
                row["iteration_cost"] = iteration_cost(row, by_label[greedy_label])
        if args.step_table and table_steps_decoder(model):
            steps.append(step_row(model, samples[0], by_label.get(ct2_label), args))

    meta = {
        "data": os.path.abspath(args.data),
        "checkpoint": os.path.abspath(args.path),
        "gen_subset": args.gen_subset,
        "sentences": n_sentences,
        "machine": machine_description(use_cuda, args.threads),
        "threads": args.threads,
        "repeats": args.repeats,
        "precision": precision(args),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "steps": steps,
    }
    return meta, rows


def paired_ratio(reference_times, times):
    """How many times faster than the reference a generator ran: the median over rounds of
    the ratio of the two times within each round, and the least and the most of those ratios.
    Paired by round, so that a round in which the machine slowed both counts once."""
    ratios = [ref / own for ref, own in zip(reference_times, times) if own > 0]
    if not ratios:
        return None, None, None
    return statistics.median(ratios), min(ratios), max(ratios)


def table_steps_decoder(model) -> bool:
    """Whether the step table measures ``model``'s decoder: a left-to-right Transformer decoder
    that the engine's steps run (an ibdecoder model's is not: its table is left out)."""
    from fairseq_pardec.decoding.step.block_decoder import UnsupportedDecoder, check_supported_decoder

    try:
        check_supported_decoder(model.decoder)
    except UnsupportedDecoder:
        return False
    return True


def step_row(model, sample, ct2_row, args):
    """One batch size's row of the step table (step_table.py), on the first batch decoded."""
    from fairseq_pardec.benchmark import step_table

    row = {"batch_size": int(sample["nsentences"]), "prefix": 16}
    row.update(step_table.step_costs(model, sample, prefix=row["prefix"]))
    if ct2_row is not None and ct2_row.get("decoder_calls"):
        row["ct2_ms_per_step"] = 1000.0 * ct2_row["wall_time_s"] / ct2_row["decoder_calls"]
    return row


def _guarded(generator) -> bool:
    """Whether the generator's choices pass the fast step's margin guard."""
    guarded = getattr(generator, "_guarded", None)
    return bool(callable(guarded) and guarded())


def iteration_cost(row, greedy_row):
    """Wall time of one decoder call of ``row`` (everything its iteration does: drafting,
    verifying, bookkeeping) in decoder calls of greedy at the same batch size.

    At batch 1 it is the break-even: the tokens per iteration a method needs to match greedy
    (speedup = tokens per iteration / iteration cost). Its inverse is the "overhead efficiency":
    wall speedup over the reduction in iterations.
    """
    if not row.get("decoder_calls") or not greedy_row.get("decoder_calls"):
        return None
    per_call = row["wall_time_s"] / row["decoder_calls"]
    return per_call / (greedy_row["wall_time_s"] / greedy_row["decoder_calls"])


def add_model_arguments(p):
    """The data, the checkpoint and the split: what every benchmark command line loads."""
    p.add_argument("data", help="fairseq-preprocess output directory")
    p.add_argument("--path", required=True, help="checkpoint of the (verifier) model")
    p.add_argument("-s", "--source-lang", default=None)
    p.add_argument("-t", "--target-lang", default=None)
    p.add_argument("--gen-subset", default="test")


def get_parser():
    p = argparse.ArgumentParser(prog="python -m fairseq_pardec.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--no-step-table", dest="step_table", action="store_false",
                   help="skip the table of ms per decoder call by batch and block size")
    p.add_argument("--generators", nargs="+", default=["beam:beam=5", "greedy", "iad"],
                   help="specs name[:key=value,...], e.g. beam:beam=5 greedy iad iad:block_size=10; "
                   "ct2[:beam=N,compute_type=T] decodes with CTranslate2 (pip install -e '.[ct2]')")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-sentences", type=int, default=None, help="first N sentences only")
    p.add_argument("--warmup-sentences", type=int, default=16,
                   help="sentences decoded by each generator before the timed runs (at least "
                   "one batch; 0: none)")
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--remove-bpe", default="@@ ", help="BPE marker to remove before scoring")
    p.add_argument("--cpu", action="store_true")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="decode in float16 (GPU)")
    precision.add_argument("--bf16", action="store_true", help="decode in bfloat16 (CPU or GPU)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default="benchmark-out")
    p.add_argument("--no-progress", action="store_true")
    return p


def cli_main(argv=None, make_parser=None, command=None):
    """The command line: errors of ours, and fairseq's known failures on bad files, become one
    line (exit status 1), as in fairseq's CLIs; anything else keeps its traceback. Ctrl-C and
    SIGTERM end it in one line too (the boundary's). ``make_parser`` and ``command``: another of
    the benchmark's command lines (draft_ceiling) behind the same boundary."""
    if running_a_cli():
        # ``python -m`` imports the package while sys.argv[0] is still "-m", so importing the
        # plugin did not install the boundary for this command line
        install_cli_boundary()
    try:
        return (command or main)((make_parser or get_parser)().parse_args(argv))
    except Exception as error:
        errors.exit_in_one_line(error)


def make_out_dir(path):
    """--out-dir, made and checked before anything is decoded: results are written only at the
    end, and a folder that cannot be made there would lose all of them."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise UsageError("--out-dir %s cannot be made (%s); give a directory that can be written"
                         % (path, error.strerror or error)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError("--out-dir %s is not writable; give a directory that can be written"
                         % path)


# options that must be at least 1 or 0; a value below fell through to a traceback (an empty
# subset, a division by zero) or was silently read as another one
_AT_LEAST = (("repeats", 1), ("threads", 1), ("max_sentences", 1), ("warmup_sentences", 0),
             ("max_len_a", 0), ("max_len_b", 0))


def check_numbers(args):
    for name, least in _AT_LEAST:
        value = getattr(args, name)
        if value is not None and value < least:
            raise UsageError("--%s must be >= %d (got %s)" % (name.replace("_", "-"), least, value))
    low = [b for b in args.batch_sizes if b < 1]
    if low:
        raise UsageError("--batch-sizes must be >= 1 (got %d)" % low[0])


def check_paths(args):
    """The data directory and the checkpoint, named in one line where missing."""
    if not os.path.isdir(args.data):
        raise UsageError("data directory %r does not exist" % args.data)
    require_file(args.path, "--path", "checkpoint file", ".pt")


def quiet_logs():
    """Warnings and errors only: fairseq and hydra log every dataset load and deprecation, and
    the report must stay readable."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from fairseq_pardec.compat import restore_log_level

    restore_log_level()  # also when run as python -m, which importing the plugin leaves alone
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("fairseq", "hydra", "fairseq_pardec"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(args):
    check_numbers(args)
    check_paths(args)
    for spec in args.generators:  # before minutes of loading and decoding
        parse_spec(spec)
    make_out_dir(args.out_dir)
    errors.on_interrupt(lambda: results_kept(args.out_dir))
    if args.repeats < 3:
        # the first timed round still pays one-time costs (allocator growth, thread pools) that
        # one warm-up batch does not settle; the median of three or more discounts it
        warn("--repeats %d: the timings are from %s, which may still include one-time costs; "
             "use --repeats 3 or more for timings to compare"
             % (args.repeats, "one run" if args.repeats == 1 else "%d runs" % args.repeats))
    quiet_logs()
    meta, rows = run(args)
    table = markdown(meta, rows)
    if meta["steps"]:
        from fairseq_pardec.benchmark import step_table

        table += "\n" + step_table.markdown(
            meta["steps"], {r["batch_size"]: r["ct2_ms_per_step"] for r in meta["steps"]
                            if "ct2_ms_per_step" in r})
    write_results(args.out_dir, table, meta, rows)
    print(table)
    return meta, rows


RESULT_FILES = ("results.md", "results.json", "quality_vs_speed.png")


def write_results(out_dir, table, meta, rows):
    """The table, the JSON and the plot, all three or none (output_files.py): a full disk or an
    interruption leaves the earlier run's files as they were."""
    os.makedirs(out_dir, exist_ok=True)
    document = json.dumps({"meta": meta, "rows": rows}, indent=2)

    def text(content):
        def write(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
        return write

    md, js, png = (os.path.join(out_dir, name) for name in RESULT_FILES)
    replace_together({md: text(table), js: text(document), png: lambda path: plot(rows, path)},
                     "--out-dir")


def results_kept(out_dir):
    """Part of the interruption's line: results are written only at the end."""
    earlier = [n for n in RESULT_FILES if os.path.isfile(os.path.join(out_dir, n))]
    return "no results written%s" % (
        "; the earlier %s in %s are kept" % (", ".join(earlier), out_dir) if earlier else "")


if __name__ == "__main__":
    cli_main()
