"""The benchmark's report: the results table (markdown) and the quality-vs-speed plot."""

from fairseq_pardec.decoding.step.margins import MEASURED_HEADROOM

COLUMNS = [
    ("generator", "generator", "%s"),
    ("batch_size", "batch", "%d"),
    ("mean_batch_size", "mean batch", "%.1f"),
    ("bleu", "BLEU", "%.2f"),
    ("chrf", "chrF", "%.2f"),
    ("sentences_per_s", "sent/s", "%.1f"),
    ("latency_ms_per_sentence", "ms/sent", "%.1f"),
    ("speedup_vs_greedy", "x greedy", "%.2f"),
    ("speedup_vs_beam", "x beam", "%.2f"),
    ("speedup_vs_ct2", "x ct2", "%.2f"),
    ("speedup_vs_best_single", "x best single", "%.2f"),
    ("mean_accepted_tokens", "tokens/iter", "%.2f"),
    ("iteration_cost", "iter cost", "%.2f"),
    ("drafter_share", "drafter", "%.0f%%"),
    ("verifier_share", "verifier", "%.0f%%"),
    ("encoder_share", "encoder", "%.0f%%"),
    ("guard_share", "guard", "%.0f%%"),
    ("engine_share", "engine", "%.0f%%"),
    ("iterations_per_sentence", "iters/sent", "%.1f"),
    ("identical_to_greedy", "= greedy", "%.1f%%"),
    ("close_calls", "close calls", "%d"),
    ("close_calls_in_one_pass", "in one pass", "%d"),
    ("margins", "margins in force", "%s"),
    ("identical_to_source", "= source", "%.1f%%"),
    ("first_divergence", "1st diff at", "%.1f"),
    ("drafts", "drafts", "%s"),
]


def markdown(meta, rows):
    lines = [
        "Machine: %s. Commit %s, %s, torch %s, %s. %d sentences of `%s`, median of %d "
        "alternating runs after warm-up (each round starting one generator later). *x greedy*, "
        "*x beam*, *x ct2* and *x best single*: the median over rounds of the speed ratio "
        "within each round, with its range. *batch*: the batch size asked for; *mean batch*: the "
        "batch size decoded; *iter cost*: wall time of one iteration (decoder call) in greedy "
        "steps of the same batch (at batch 1 the tokens/iter needed to break even); *drafter*: "
        "share of the decoding time spent drafting, *verifier*: in the verifier's decoder calls, "
        "*encoder*: in its encoder, *guard*: in the margin guard's replays of fairseq's "
        "arithmetic at close calls, *engine*: the rest, what runs between the model's calls "
        "(shares on the CPU only); *close calls*: choices the fast step's margin guard "
        "left to fairseq's own search, in one run, and *in one pass* of them, those one "
        "teacher-forced pass over the prefix decided; *margins in force*: the guard's margin "
        "on the step and on that pass (*replay*: none), each the larger of its floor and %d "
        "times the spread measured on the model before its first batch; *x best single*: "
        "speed over the fastest (by median) of lean_greedy, iad and lookup in the run; *drafts* (auto): each drafter's share of the "
        "row-iterations, with its accepted draft tokens per drafting iteration; *= source*: "
        "share of outputs identical to their source (shared vocabularies only); *1st diff at*: "
        "mean token index of the first difference from "
        "greedy, over the sentences that differ."
        % (meta["machine"], meta["commit"], meta["date"], meta["torch"], meta["precision"],
           meta["sentences"], meta["gen_subset"], meta["repeats"], MEASURED_HEADROOM),
        "",
        "| " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            if value is None:
                cells.append("")
            elif key in ("identical_to_greedy", "identical_to_source", "drafter_share",
                         "verifier_share", "encoder_share", "guard_share", "engine_share"):
                cells.append(fmt % (100 * value))
            elif row.get(key + "_range") and row[key + "_range"][0] != row[key + "_range"][1]:
                low, high = row[key + "_range"]
                cells.append((fmt + " (" + fmt + "-" + fmt + ")") % (value, low, high))
            else:
                cells.append(fmt % value)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for batch_size, marker in zip(sorted({r["batch_size"] for r in rows}), "osD^v"):
        sub = [r for r in rows if r["batch_size"] == batch_size]
        ax.scatter([r["sentences_per_s"] for r in sub], [r["bleu"] for r in sub], marker=marker,
                   label="batch %d" % batch_size)
        for r in sub:
            ax.annotate(r["generator"], (r["sentences_per_s"], r["bleu"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("sentences / s (log scale)")
    ax.set_ylabel("BLEU")
    ax.set_title("quality vs speed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
