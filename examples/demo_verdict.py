"""The demo's last lines: per batch size, the fastest lossless generator against greedy and CTranslate2.

usage: python examples/demo_verdict.py BENCHMARK_DIR/results.json

Lossless means what the benchmark measured on this run: every output identical to fairseq greedy
(fairseq's own generators and CTranslate2 are the yardsticks, not candidates).
"""

import json
import sys

YARDSTICKS = ("greedy", "beam", "ct2")


def is_yardstick(label: str) -> bool:
    return label.startswith(YARDSTICKS)


def verdict(meta, rows):
    lines = []
    for batch in sorted({r["batch_size"] for r in rows}):
        candidates = [r for r in rows if r["batch_size"] == batch and not is_yardstick(r["generator"])]
        lossless = [r for r in candidates if r.get("identical_to_greedy") == 1.0]
        head = "batch %d (%d sentences):" % (batch, meta["sentences"])
        if not lossless:
            lines.append("%s no generator gave fairseq greedy's output on every sentence: a bug, "
                         "please report it with %s" % (head, sys.argv[1]))
            continue
        best = max(lossless, key=lambda r: r["sentences_per_s"])
        ct2 = (", %.2fx CTranslate2" % best["speedup_vs_ct2"]
               if best.get("speedup_vs_ct2") is not None else "")
        lines.append("%s %s is the fastest lossless generator: %.1f sent/s, %.2fx fairseq greedy%s; "
                     "all %d outputs identical to greedy; %.2f tokens per iteration"
                     % (head, best["generator"], best["sentences_per_s"],
                        best["speedup_vs_greedy"], ct2, meta["sentences"],
                        best["mean_accepted_tokens"]))
    return lines


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2])
    with open(sys.argv[1]) as f:
        results = json.load(f)
    for line in verdict(results["meta"], results["rows"]):
        print("[demo] " + line)


if __name__ == "__main__":
    main()
