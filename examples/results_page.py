"""Write the results page (docs/results.md) from the benchmark output of examples/reproduce.sh.

usage: python examples/results_page.py WORK PRESET OUT_MD

Reads WORK/bench/*/results.json, WORK/blockwise/bench-*/results.json, WORK/reproduce.log and, if present,
WORK/NOTES.md (the runner's remarks on the run, included verbatim), copies the
quality-vs-speed plots next to OUT_MD and prints nothing but errors. Every number on the page comes
from those files; the paper column is the papers' own headline, quoted with its setting.
"""

import json
import os
import shutil
import sys

from blockwise_table import markdown as blockwise_markdown

# label prefix -> (method, flags, the paper's corresponding headline, why ours can differ)
DDTP_ROWS = [
    ("greedy", "Transformer (KD), greedy", "`--generator greedy`", "reference (1.00x)", ""),
    ("beam5", "Transformer (KD), beam 5", "`--beam 5`", "", ""),
    ("beam4", "Transformer (KD), beam 4", "`--beam 4`", "IBDecoder paper's Transformer row (B=4): 387 ms/sent on a GTX 1080", ""),
    ("gad-k25", "GAD (lossless)", "`--generator gad --drafter-path D --block-size 25`",
     "GAD: identical to greedy, ~3.0x over beam-5 (WMT14 En-De, P100)", "drafter trained for minutes, not 300k steps: fewer accepted tokens"),
    ("gad++top3-tau1", "GAD++ (top-3, tau 1)", "`... --gad-beta 3 --gad-tau 1.0`",
     "GAD++ top-3/tau 1: 3.6x over beam-5, BLEU above greedy", "as above"),
    ("blockwise-frozen-k4", "Blockwise, frozen base, identity p1, k=4", "`--generator blockwise` (model: `--proposal-heads 4 --freeze-base --identity-first-head`)",
     "Stern et al. Table 1 (frozen, distilled, k=4): BLEU unchanged, mean block 1.85 (newstest2013, TPU/GPU)", "our base and heads are small and briefly trained"),
    ("blockwise-finetune-k6-top2", "Blockwise, fine-tuned, k=6, top-2 acceptance", "`--generator blockwise --blockwise-topk 2`",
     "Stern et al. § 5.1, top-2, k=6: mean block 4.59, -0.28 BLEU vs exact", ""),
    ("blockwise-finetune-k6", "Blockwise, fine-tuned, k=6", "`--generator blockwise`",
     "Stern et al. Table 1 (fine-tuned, distilled, k=6): mean block 4.18, -0.23 BLEU; best wall clock 3.3x at k=8", "10 min of fine-tuning on CPU"),
    ("ibdecoder-b4", "IBDecoder h=2 c=1, beam 4", "model `--ib-directions 2`; `--beam 4`",
     "IBDecoder: 1.90x over Transformer B=4, -0.2 BLEU with KD (GTX 1080, batch 1)", "speedup is vs our beam-4 row"),
    ("ibdecoder-b1", "IBDecoder h=2 c=1, beam 1", "`--beam 1`", "IBDecoder B=1: 2.33x", "vs our greedy row"),
    ("ibdecoder-sa-b4", "IBDecoder +SA h=2 c=2, beam 4", "model `--ib-words-per-direction 2`", "+SA: 3.31x, -1.0 BLEU (KD)", ""),
    ("ibdecoder-sa-b1", "IBDecoder +SA h=2 c=2, beam 1", "`--beam 1`", "+SA B=1: 4.35x", ""),
    ("imdecoder-b4", "IMDecoder h=4, beam 4", "model `--ib-directions 4`", "IMDecoder: 3.79x, -2.7 BLEU (KD)", ""),
    ("imdecoder-b1", "IMDecoder h=4, beam 1", "`--beam 1`", "IMDecoder B=1: 4.55x", ""),
    ("double-token-b4", "Double-token (head+tail, learned positions), beam 4", "model `--ib-positions learned`",
     "double-token paper: 13%-24% faster than single-token on WMT-14", ""),
    ("double-token-b1", "Double-token, beam 1", "`--beam 1`", "", ""),
    ("vanilla-sa-b4", "Vanilla SA h=1 c=2, beam 4", "model `--ib-directions 1 --ib-words-per-direction 2 --ib-positions vanilla`",
     "SA (Wang et al. 2018) as a baseline in the IBDecoder paper", ""),
    ("vanilla-sa-b1", "Vanilla SA, beam 1", "`--beam 1`", "", ""),
]
GEC_ROWS = [
    ("beam5", "Transformer, beam 5", "`--beam 5`", "reference of the IAD paper's speedups", ""),
    ("greedy", "Transformer, greedy", "`--generator greedy`", "", ""),
    ("iad", "IAD (copy drafter, lossless)", "`--generator iad` (CPU draft cap 10)",
     "IAD: identical to greedy, 7x-9x over beam-5 on GPU, ~6x on CPU (CoNLL-14, Transformer-big)",
     "our model is small and under-trained: more iterations per sentence"),
    ("lookup", "Lookup drafting (source and output, lossless)", "`--generator lookup`",
     "", "ours: also drafts the model's repetition loops from its own output"),
]


def fmt(value, pattern):
    return "" if value is None else pattern % value


def identical(row):
    value = row.get("identical_to_greedy")
    return "" if value is None else "%.1f%%" % (100 * value)


def table(result, spec, score_name):
    rows = {(r["generator"], r["batch_size"]): r for r in result["rows"]}
    batches = sorted({r["batch_size"] for r in result["rows"]})
    beam4 = {b: rows.get(("beam4", b)) for b in batches}
    greedy = {b: rows.get(("greedy", b)) for b in batches}
    out = [
        "| method | flags | batch | %s | chrF | sent/s | x greedy | x beam-5 | x same-beam Transformer | tokens/iter | = greedy | iters/sent | paper | why ours differs |" % score_name,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    listed = set()
    for batch in batches:
        for label, method, flags, paper, why in spec:
            r = rows.get((label, batch))
            if r is None:
                continue
            listed.add(label)
            same_beam = ""
            if label.endswith("-b4") and beam4[batch]:
                same_beam = "%.2f" % (beam4[batch]["wall_time_s"] / r["wall_time_s"])
            elif label.endswith("-b1") and greedy[batch]:
                same_beam = "%.2f" % (greedy[batch]["wall_time_s"] / r["wall_time_s"])
            out.append("| %s | %s | %d | %.2f | %.2f | %.1f | %s | %s | %s | %.2f | %s | %.1f | %s | %s |" % (
                method, flags, batch, r["bleu"], r["chrf"], r["sentences_per_s"],
                fmt(r.get("speedup_vs_greedy"), "%.2f"), fmt(r.get("speedup_vs_beam"), "%.2f"), same_beam,
                r["mean_accepted_tokens"], identical(r), r["iterations_per_sentence"],
                paper if batch == batches[0] else "", why if batch == batches[0] else ""))
    missing = sorted({r["generator"] for r in result["rows"]} - listed)
    for name in missing:  # a generator the page does not know yet still shows up
        for batch in batches:
            r = rows[(name, batch)]
            out.append("| %s | | %d | %.2f | %.2f | %.1f | %s | %s | | %.2f | | %.1f | | |" % (
                name, batch, r["bleu"], r["chrf"], r["sentences_per_s"], fmt(r.get("speedup_vs_greedy"), "%.2f"),
                fmt(r.get("speedup_vs_beam"), "%.2f"), r["mean_accepted_tokens"], r["iterations_per_sentence"]))
    return "\n".join(out)


def simple_table(result, reference):
    rows = result["rows"]
    ref = {r["batch_size"]: r for r in rows if r["generator"] == reference}
    out = ["| generator | batch | BLEU | chrF | sent/s | x %s | tokens/iter | iters/sent | = greedy |" % reference,
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = ref.get(r["batch_size"])
        speed = "%.2f" % (base["wall_time_s"] / r["wall_time_s"]) if base else ""
        out.append("| %s | %d | %.2f | %.2f | %.1f | %s | %.2f | %.1f | %s |" % (
            r["generator"], r["batch_size"], r["bleu"], r["chrf"], r["sentences_per_s"], speed,
            r["mean_accepted_tokens"], r["iterations_per_sentence"], identical(r)))
    return "\n".join(out)


def main(work, preset, out_md):
    out_dir = os.path.dirname(os.path.abspath(out_md))
    os.makedirs(out_dir, exist_ok=True)
    parts = []
    for name, spec, score, title in (
        ("ddtp-de-en", DDTP_ROWS, "BLEU", "ddtp-de-en test (German -> English, Debian package descriptions)"),
        ("ua-gec", GEC_ROWS, "BLEU", "UA-GEC test (Ukrainian grammatical error correction)"),
    ):
        path = os.path.join(work, "bench", name, "results.json")
        if not os.path.exists(path):
            parts.append("## %s\n\nNot measured yet (no %s).\n" % (title, path))
            continue
        result = json.load(open(path))
        meta = result["meta"]
        png = "results-%s-%s.png" % (preset, name)
        shutil.copy(os.path.join(work, "bench", name, "quality_vs_speed.png"), os.path.join(out_dir, png))
        parts.append("\n".join([
            "## %s" % title, "",
            "Machine: %s. Commit `%s`, %s, torch %s. First %d sentences of `%s`; median of %d "
            "alternating runs after a warm-up, all rows in one process. %s is sacrebleu on detokenised-BPE "
            "text against the reference%s." % (
                meta["machine"], meta["commit"], meta["date"], meta["torch"], meta["sentences"],
                meta["gen_subset"], meta["repeats"], score,
                " (the corrected sentence; not the M2/ERRANT F0.5 of the GEC papers, which has no "
                "Ukrainian scorer in our dependencies)" if name == "ua-gec" else ""),
            "",
            table(result, spec, score), "",
            "![quality vs speed](%s)" % png, ""]))
    for name, title, reference, paper in (
        ("ddtp-gad-sweep", "GAD++ block-size sweep (ddtp-de-en, batch 1)", "greedy",
         "GAD paper Table 2 (GAD++ top-3, tau 1, WMT14 dev, over beam-5): k=10 5.97 tokens/iter 3.04x; "
         "k=15 6.74 3.47x; k=25 7.56 3.79x; k=30 7.44 3.63x."),
        ("ddtp-ib-ablations", "IBDecoder ablations (ddtp-de-en, beam 4, batch 1)", "beam4",
         "IBDecoder paper Table 2 compares the relaxed mask M(2,1) and signed positions with the "
         "standard causal mask and flat positions (WMT14 En-De)."),
    ):
        path = os.path.join(work, "bench", name, "results.json")
        if not os.path.exists(path):
            parts.append("## %s\n\nNot measured yet (no %s).\n" % (title, path))
            continue
        result = json.load(open(path))
        parts.append("## %s\n\n%s %d sentences, median of %d runs, commit `%s`.\n\n%s\n" % (
            title, paper, result["meta"]["sentences"], result["meta"]["repeats"], result["meta"]["commit"],
            simple_table(result, reference)))
    blockwise = blockwise_markdown(os.path.join(work, "blockwise"))
    parts.append("## Blockwise parallel decoding, Stern et al. Table 1 (ddtp-de-en, batch 1)\n\n%s\n" % (
        "Every model starts from a base (regular data: the teacher; distilled data: the verifier); frozen = "
        "base frozen, identity p_1, so blockwise is identical to the base's greedy; finetune = all parameters "
        "trained. k = block size at decoding time; speedup and BLEU against the same model's greedy (p_1 "
        "alone); overhead efficiency = speedup / mean accepted block. From `WORK/blockwise` "
        "(examples/translation/blockwise.sh).\n\n" + blockwise if blockwise else
        "Not measured yet (no %s)." % os.path.join(work, "blockwise", "bench-*")))
    notes = os.path.join(work, "NOTES.md")  # optional, written by whoever ran it: what was special
    if os.path.exists(notes):
        parts.insert(0, "## Notes on this run\n\n" + open(notes).read().strip() + "\n")
    log = os.path.join(work, "reproduce.log")
    steps = open(log).read().strip() if os.path.exists(log) else "(no reproduce.log)"
    print("# Results (`examples/reproduce.sh %s`)\n" % preset)
    print("\n".join(parts))
    print("## Step log of this run (`%s/reproduce.log`)\n\n```\n%s\n```" % (os.path.basename(work.rstrip("/")), steps))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: results_page.py WORK PRESET OUT_MD")
    main(*sys.argv[1:])
