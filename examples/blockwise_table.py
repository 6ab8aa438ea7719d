"""Our version of Stern et al. (2018) Table 1 from the output of examples/translation/blockwise.sh.

usage: python examples/blockwise_table.py OUT        (prints a markdown table; nothing if no results)

Reads OUT/bench-*/results.json: one benchmark per model (DATA-MODE-kK or DATA-MODE-shared-kK),
with a greedy row (p_1 alone) and one blockwise-kK row per decoded block size.
"""

import glob
import json
import os
import re
import sys

# Stern et al. (2018) Table 1, newstest2013 En-De: (BLEU, mean accepted block) per column and k
PAPER = {
    ("regular", "frozen"): {2: (25.81, 1.51), 4: (25.84, 1.73), 6: (26.08, 1.76), 8: (25.82, 1.76), 10: (25.69, 1.74)},
    ("distilled", "frozen"): {2: (26.52, 1.55), 4: (26.31, 1.85), 6: (26.26, 1.90), 8: (26.25, 1.91), 10: (26.34, 1.90)},
    ("regular", "finetune"): {2: (25.74, 1.78), 4: (25.05, 2.69), 6: (24.69, 2.98), 8: (24.27, 3.01), 10: (23.51, 2.87)},
    ("distilled", "finetune"): {2: (26.58, 1.88), 4: (26.36, 3.27), 6: (26.18, 4.18), 8: (26.11, 4.69), 10: (25.60, 4.95)},
}


def collect(out):
    """(data, mode, k, model, greedy row, blockwise row) for every measured block size."""
    found = []
    for path in glob.glob(os.path.join(out, "bench-*", "results.json")):
        name = os.path.basename(os.path.dirname(path))[len("bench-"):]
        data, mode = name.split("-")[:2]
        by_label = {r["generator"]: r for r in json.load(open(path))["rows"]}
        for label, row in by_label.items():
            match = re.fullmatch(r"blockwise-k(\d+)", label)
            if match:
                heads = int(name.rsplit("-k", 1)[1])
                model = ("one model, %d heads" % heads) if "-shared-" in name else "one model per k"
                found.append((data, mode, int(match.group(1)), model, by_label["greedy"], row))
    return sorted(found, key=lambda t: (t[0] != "regular", t[1] != "frozen", t[2]))


def markdown(out):
    rows = collect(out)
    if not rows:
        return ""
    lines = [
        "| data | mode | k | model | BLEU greedy (p_1) | BLEU blockwise | mean accepted block | x greedy | "
        "overhead efficiency | paper: BLEU / mean block |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for data, mode, k, model, greedy, row in rows:
        paper = PAPER.get((data, mode), {}).get(k)
        lines.append("| %s | %s | %d | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %s |" % (
            data, mode, k, model, greedy["bleu"], row["bleu"],
            row["mean_accepted_tokens"], row["speedup_vs_greedy"],
            row["speedup_vs_greedy"] / row["mean_accepted_tokens"], "%.2f / %.2f" % paper if paper else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: blockwise_table.py OUT")
    print(markdown(sys.argv[1]))
