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
import sys

from fairseq_pardec.benchmark.runner import divergence


def hypotheses(path):
    with open(path, encoding="utf-8") as f:
        return {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", f.read(), re.M)}


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
    identical, first = divergence(other, ref)
    n_diff = round((1.0 - identical) * len(ref))
    line = "identical on %d of %d sentences (%.2f%%)" % (len(ref) - n_diff, len(ref), 100.0 * identical)
    if n_diff:
        line += "; the %d others first differ at token %.1f on average" % (n_diff, first)
    print(line)
    if n_diff and args.strict:
        sys.exit("compare_hypotheses: error: outputs differ in float32 (a bug: please report it)")


if __name__ == "__main__":
    main()
