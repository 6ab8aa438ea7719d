"""How far the fast step's log-probabilities stray from fairseq's, on a trained model's sentences:
the measurement behind the margin guard's margin (decoding/step/margins.py, step/fast.py).

For each of the first ``--sentences`` test sentences, fairseq greedy's output (the engine's
lean_greedy, identical to it) is fed back, teacher-forced, through

* fairseq's own arithmetic: its encoder, then one-position steps at batch 1 (step/one_row_steps.py,
  bit for bit fairseq's incremental decoder) and its output layer one position at a time;
* the engine's fast encoder and step, three ways: one position a call at batch 1 (lean_greedy at
  batch 1), the whole output as one block at batch 1 (a verified draft), and one position a
  call for batches of 8 sentences of similar length, each cut to the group's shortest output
  (lean_greedy at batch 32).

It prints, per way, the positions compared and the largest |difference| of the log-probabilities
over the whole vocabulary, its 99.9th percentile, and the largest at fairseq's best two tokens
(what the guard's choice reads).

A fourth way is the lean step's pass over the whole output as one block, on fairseq's encoder
output: the margin guard's teacher-forced first try at a close call. With ``--cuda`` every way
runs on the GPU, with the step a CUDA decode takes (the static step), against fairseq's
arithmetic on the GPU.
``--json FILE`` writes the figures too.

    python examples/margin_spread.py DATA --path CKPT [-s SRC -t TGT] [--sentences 150] [--cuda]
"""

import argparse
import json

import numpy as np
import torch

from fairseq_pardec.benchmark import runner
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps


def fairseq_log_probs(model, net_input, tokens):
    """(T, V) fairseq's log-probabilities after each of ``tokens`` (BOS first), at batch 1."""
    decoder = model.decoder
    encoder_out = model.encoder.forward_torchscript(net_input)
    rows = []
    for features in OneRowSteps(decoder, encoder_out).run(tokens, features_of_all=True):
        logits = decoder.output_layer(features.unsqueeze(1))
        rows.append(model.get_normalized_probs((logits, None), log_probs=True)[:, -1, :])
    return torch.cat(rows)


class Spread:
    """The largest differences of one way, over every position it computed."""

    def __init__(self):
        self.whole, self.best_two = [], []

    def add(self, got, expected):
        diff = (got - expected).abs()
        diff[~torch.isfinite(diff)] = 0  # -inf on both sides (padding)
        best = expected.topk(2, dim=-1).indices
        self.whole += diff.max(dim=-1).values.tolist()
        self.best_two += diff.gather(1, best).max(dim=-1).values.tolist()

    def figures(self):
        whole = np.array(self.whole)
        return dict(positions=int(whole.size), max=float(whole.max()),
                    p999=float(np.quantile(whole, 0.999)), best_two=float(max(self.best_two)))

    def line(self, name):
        f = self.figures()
        return "%-18s %6d positions  max %.2e  p99.9 %.2e  max at the best two %.2e" % (
            name, f["positions"], f["max"], f["p999"], f["best_two"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data")
    parser.add_argument("--path", required=True)
    parser.add_argument("-s", "--source-lang")
    parser.add_argument("-t", "--target-lang")
    parser.add_argument("--sentences", type=int, default=150)
    parser.add_argument("--max-len-a", type=float, default=1.2)
    parser.add_argument("--max-len-b", type=int, default=10)
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
    device = next(model.parameters()).device
    samples = runner.batches(task, model, task.dataset("test"), 1, a.sentences, use_cuda, utils)
    generator = runner.build(task, model, ("lean_greedy", "lean_greedy", {}),
                             argparse.Namespace(max_len_a=a.max_len_a, max_len_b=a.max_len_b),
                             use_cuda)
    step, encode = generator._step_and_encoder()
    lean = LeanBlockDecoder(model.decoder)
    ways = ["step, batch 1", "block, batch 1", "step, batch 8", "lean block, batch 1"]
    spreads = {name: Spread() for name in ways}

    def tensor(data):
        return torch.tensor(data, device=device)
    sentences = []
    with torch.no_grad():
        for sample in samples:
            hypo = task.inference_step(generator, [model], sample)[0][0]["tokens"].tolist()
            tokens = [generator.eos] + hypo[:-1]  # BOS, then the output less its EOS
            net_input = sample["net_input"]
            expected = fairseq_log_probs(model, net_input, tokens)
            sentences.append((net_input, tokens, expected))
            encoder_out = encode(net_input)
            cache = step.new_state(max_len=len(tokens) + 2)
            one = BlockLayout(torch.zeros(1, 1, dtype=torch.bool, device=device), dense=True)
            got = torch.cat([step.log_probs(step.forward_packed(
                tensor([[token]]), tensor([t]), one, encoder_out, cache))
                for t, token in enumerate(tokens)])
            spreads["step, batch 1"].add(got, expected)
            block = BlockLayout(torch.zeros(1, len(tokens), dtype=torch.bool, device=device),
                                dense=True)
            cache = step.new_state(max_len=len(tokens) + 2)
            got = step.log_probs(step.forward_packed(tensor([tokens]), tensor([0]),
                                                     block, encoder_out, cache))
            spreads["block, batch 1"].add(got, expected)
            # the guard's teacher-forced pass: the lean step on fairseq's encoder output
            plain = model.encoder.forward_torchscript(net_input)
            cache = lean.new_state(max_len=len(tokens) + 2)
            got = lean.log_probs(lean.forward_packed(tensor([tokens]), tensor([0]), block,
                                                     plain, cache))
            spreads["lean block, batch 1"].add(got, expected)
        by_length = sorted(sentences, key=lambda s: len(s[1]))
        pad = task.source_dictionary.pad()
        for first in range(0, len(by_length) - 7, 8):
            group = by_length[first: first + 8]
            length = min(len(tokens) for _, tokens, _ in group)
            width = max(net["src_tokens"].size(1) for net, _, _ in group)
            src = torch.full((8, width), pad, dtype=torch.long, device=device)
            for r, (net, _, _) in enumerate(group):  # left-padded, as fairseq batches them
                src[r, width - net["src_tokens"].size(1):] = net["src_tokens"][0]
            lengths = tensor([net["src_tokens"].size(1) for net, _, _ in group])
            encoder_out = encode({"src_tokens": src, "src_lengths": lengths})
            cache = step.new_state(max_len=length + 2)
            dense = BlockLayout(torch.zeros(8, 1, dtype=torch.bool, device=device), dense=True)
            for t in range(length):
                column = tensor([[tokens[t]] for _, tokens, _ in group])
                got = step.log_probs(step.forward_packed(column, tensor([t] * 8), dense,
                                                         encoder_out, cache))
                spreads["step, batch 8"].add(got, torch.stack([e[t] for _, _, e in group]))
    spreads = {name: spread for name, spread in spreads.items() if spread.whole}
    for name, spread in spreads.items():
        print(spread.line(name))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(path=a.path, device=str(device), step=type(step).__name__,
                           margin=step.margin, ways={name: spread.figures()
                                                     for name, spread in spreads.items()}),
                      f, indent=1)


if __name__ == "__main__":
    main()
