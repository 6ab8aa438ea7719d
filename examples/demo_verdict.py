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
        lines.append("%s %s is the fastest lossless generator: %s; all %d outputs identical to "
                     "greedy" % (head, best["generator"], _speed(best), meta["sentences"]))
        auto = next((r for r in candidates if r["generator"] == "auto"), None)
        if auto is not None and auto is not best:
            same = ("all outputs identical to greedy" if auto.get("identical_to_greedy") == 1.0
                    else "%.1f%% of outputs identical to greedy: a bug, please report it with %s"
                    % (100 * (auto.get("identical_to_greedy") or 0), sys.argv[1]))
            lines.append("%s auto (--generator auto): %s, %.2fx the fastest; %s"
                         % (head, _speed(auto), auto["sentences_per_s"] / best["sentences_per_s"],
                            same))
    return lines


def _speed(row):
    ct2 = (", %.2fx CTranslate2" % row["speedup_vs_ct2"]
           if row.get("speedup_vs_ct2") is not None else "")
    return ("%.1f sent/s, %.2fx fairseq greedy%s, %.2f tokens per iteration"
            % (row["sentences_per_s"], row["speedup_vs_greedy"], ct2, row["mean_accepted_tokens"]))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2])
    with open(sys.argv[1]) as f:
        results = json.load(f)
    for line in verdict(results["meta"], results["rows"]):
        print("[demo] " + line)


if __name__ == "__main__":
    main()
