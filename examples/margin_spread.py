"""How far the engine's log-probabilities stray from fairseq's, on a trained model's sentences: the
measurement behind the margin guard's margins (decoding/step/margins.py), with the library's own
measurement (decoding/step/rounding_spread.py, which the margins in force are calibrated with).

For each of the first ``--sentences`` test sentences, fairseq's greedy path is computed with its
own arithmetic (its encoder, then one-position steps at batch 1 and its output layer), and the
step a decode takes on this device (the fast step on the CPU, the static step on CUDA) computes
the same log-probabilities

* one position a call for groups of 8 sentences of similar length, cut to the group's shortest
  path (``step``: lean_greedy at batch 32),
* the whole path as one block at batch 1 (``block``: a verified draft),
* one position a call at batch 1 (``step, batch 1``: lean_greedy at batch 1),

and the lean step the whole path as one block on fairseq's encoder output (``pass``: the margin
guard's teacher-forced first try at a close call). It prints, per way, the positions compared,
the largest |difference| of the log-probabilities over the whole vocabulary, its 99.9th
percentile, and the largest at fairseq's best two tokens (what the guard's choice reads).

    python examples/margin_spread.py DATA --path CKPT [-s SRC -t TGT] [--sentences 150] [--cuda]
        [--json FILE]
"""

import argparse
import json

import torch

from fairseq_pardec.benchmark import runner
from fairseq_pardec.decoding.step import rounding_spread

WAYS = ("step", "block", "step, batch 1", "pass")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data")
    parser.add_argument("--path", required=True)
    parser.add_argument("-s", "--source-lang")
    parser.add_argument("-t", "--target-lang")
    parser.add_argument("--sentences", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=200,
                        help="the longest greedy path followed per sentence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="measure the CUDA step on the GPU")
    parser.add_argument("--json", help="also write the figures to this file")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    task, model, use_cuda, utils = runner.load(argparse.Namespace(
        data=a.data, path=a.path, source_lang=a.source_lang, target_lang=a.target_lang,
        cpu=not a.cuda, gen_subset="test", fp16=False, bf16=False))
    if a.cuda and not use_cuda:
        parser.error("--cuda: no CUDA device")
    model.eval()
    samples = runner.batches(task, model, task.dataset("test"), 1, a.sentences, use_cuda, utils)
    generator = runner.build(task, model, ("lean_greedy", "lean_greedy", {}),
                             argparse.Namespace(max_len_a=1.2, max_len_b=10), use_cuda)
    step, encode = generator._step_and_encoder()
    d = task.target_dictionary
    sources = sorted((s["net_input"] for s in samples), key=lambda n: n["src_tokens"].size(1))
    totals = {way: rounding_spread.Spread() for way in WAYS}
    with torch.no_grad():
        for first in range(0, len(sources), 8):
            spreads = rounding_spread.measure(model, step, encode, sources[first: first + 8],
                                              d.eos(), d.eos(), d.pad(), a.max_tokens, WAYS,
                                              src_pad=task.source_dictionary.pad())
            for way, spread in spreads.items():
                totals[way].per_position += spread.per_position
                totals[way].at_best_two = max(totals[way].at_best_two, spread.at_best_two)
    figures = {}
    for way, spread in totals.items():
        figures[way] = dict(positions=spread.positions, max=spread.largest,
                            p999=spread.quantile(0.999), best_two=spread.at_best_two)
        print("%-14s %6d positions  max %.2e  p99.9 %.2e  max at the best two %.2e" % (
            way, spread.positions, spread.largest, spread.quantile(0.999), spread.at_best_two))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(path=a.path, device=str(next(model.parameters()).device),
                           step=type(step).__name__, margin=step.margin, ways=figures), f,
                      indent=1)


if __name__ == "__main__":
    main()
