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

    python examples/margin_spread.py DATA --path CKPT [-s SRC -t TGT] [--sentences 150]
"""

import argparse

import numpy as np
import torch

from fairseq_pardec.benchmark import runner
from fairseq_pardec.decoding.step.block_layout import BlockLayout
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

    def line(self, name):
        whole = np.array(self.whole)
        return "%-18s %6d positions  max %.2e  p99.9 %.2e  max at the best two %.2e" % (
            name, whole.size, whole.max(), np.quantile(whole, 0.999), max(self.best_two))


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
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    task, model, _, utils = runner.load(argparse.Namespace(
        data=a.data, path=a.path, source_lang=a.source_lang, target_lang=a.target_lang,
        cpu=True, gen_subset="test", fp16=False, bf16=False))
    model.eval()
    samples = runner.batches(task, model, task.dataset("test"), 1, a.sentences, False, utils)
    generator = runner.build(task, model, ("lean_greedy", "lean_greedy", {}),
                             argparse.Namespace(max_len_a=a.max_len_a, max_len_b=a.max_len_b))
    step, encode = generator._step_and_encoder()
    spreads = {name: Spread() for name in ("step, batch 1", "block, batch 1", "step, batch 8")}
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
            one = BlockLayout(torch.zeros(1, 1, dtype=torch.bool), dense=True)
            got = torch.cat([step.log_probs(step.forward_packed(
                torch.tensor([[token]]), torch.tensor([t]), one, encoder_out, cache))
                for t, token in enumerate(tokens)])
            spreads["step, batch 1"].add(got, expected)
            cache = step.new_state(max_len=len(tokens) + 2)
            block = BlockLayout(torch.zeros(1, len(tokens), dtype=torch.bool), dense=True)
            got = step.log_probs(step.forward_packed(torch.tensor([tokens]), torch.tensor([0]),
                                                     block, encoder_out, cache))
            spreads["block, batch 1"].add(got, expected)
        by_length = sorted(sentences, key=lambda s: len(s[1]))
        pad = task.source_dictionary.pad()
        for first in range(0, len(by_length) - 7, 8):
            group = by_length[first: first + 8]
            length = min(len(tokens) for _, tokens, _ in group)
            width = max(net["src_tokens"].size(1) for net, _, _ in group)
            src = torch.full((8, width), pad, dtype=torch.long)
            for r, (net, _, _) in enumerate(group):  # left-padded, as fairseq batches them
                src[r, width - net["src_tokens"].size(1):] = net["src_tokens"][0]
            lengths = torch.tensor([net["src_tokens"].size(1) for net, _, _ in group])
            encoder_out = encode({"src_tokens": src, "src_lengths": lengths})
            cache = step.new_state(max_len=length + 2)
            dense = BlockLayout(torch.zeros(8, 1, dtype=torch.bool), dense=True)
            for t in range(length):
                column = torch.tensor([[tokens[t]] for _, tokens, _ in group])
                got = step.log_probs(step.forward_packed(column, torch.full((8,), t), dense,
                                                         encoder_out, cache))
                spreads["step, batch 8"].add(got, torch.stack([e[t] for _, _, e in group]))
    for name, spread in spreads.items():
        print(spread.line(name))


if __name__ == "__main__":
    main()
