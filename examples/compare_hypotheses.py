"""Compare the H- lines of two fairseq-generate outputs: share identical, first divergence.

usage: python examples/compare_hypotheses.py REFERENCE.txt OTHER.txt [--strict]

Prints one line: how many sentences are identical and, over the others, the mean index of the
first token (whitespace-separated, as printed) where they differ. With --strict any difference
exits with status 1: in float32 a lossless generator must equal fairseq greedy on every sentence.
In float16/bfloat16 a verified block and a one-token step round differently, so a difference is
reported, not an error.
"""

import argparse
import re
import statistics
import sys


def hypotheses(path):
    with open(path, encoding="utf-8") as f:
        return {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", f.read(), re.M)}


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference")
    p.add_argument("other")
    p.add_argument("--strict", action="store_true", help="exit 1 on any difference (float32)")
    args = p.parse_args(argv)
    ref, other = hypotheses(args.reference), hypotheses(args.other)
    if set(ref) != set(other):
        sys.exit("compare_hypotheses: error: %s and %s decode different sentences (%d vs %d)"
                 % (args.reference, args.other, len(ref), len(other)))
    firsts = [first_difference(ref[i], other[i]) for i in ref if ref[i] != other[i]]
    line = "identical on %d of %d sentences (%.2f%%)" % (len(ref) - len(firsts), len(ref),
                                                       100.0 * (len(ref) - len(firsts)) / max(1, len(ref)))
    if firsts:
        line += "; the %d others first differ at token %.1f on average" % (len(firsts), statistics.mean(firsts))
    print(line)
    if firsts and args.strict:
        sys.exit("compare_hypotheses: error: outputs differ in float32 (a bug: please report it)")


if __name__ == "__main__":
    main()
