"""How often blockwise proposal heads agree with their verifier (issue #13: acceptance per head).

The verifier decodes the first N sentences of a split greedily; each heads checkpoint (trained on
that verifier, frozen base) is then run teacher-forced on those outputs. Printed per checkpoint:
the share of positions where head j's top-1 equals the verifier's token j - 1 further ahead
(j = 2..k; recurrent heads read the verifier's tokens before theirs, as exact acceptance feeds
them), and the mean run of agreeing heads 2, 3, ... (the proposals a fixed block keeps per
iteration beyond p_1's token).

usage: python examples/translation/head_agreement.py DATA_BIN VERIFIER.pt HEADS.pt [HEADS.pt ...]
       [--split test] [--sentences 200] [-s de -t en]
"""

import argparse
import os

import torch
from fairseq import checkpoint_utils, utils
from fairseq.sequence_generator import SequenceGenerator


def greedy_outputs(model, dictionary, samples):
    generator = SequenceGenerator([model], dictionary, beam_size=1, max_len_a=1.2, max_len_b=10)
    with torch.no_grad():
        return [[h[0]["tokens"] for h in generator.generate([model], s)] for s in samples]


def teacher_forced(outputs, dictionary):
    """(targets, previous tokens) of a batch of outputs, right-padded."""
    width = max(len(h) for h in outputs)
    target = torch.full((len(outputs), width), dictionary.pad())
    prev = torch.full((len(outputs), width), dictionary.pad())
    for i, h in enumerate(outputs):
        target[i, : len(h)] = h
        prev[i, 0] = dictionary.eos()
        prev[i, 1 : len(h)] = h[:-1]
    return target, prev


def shifted(target, offset, pad):
    return torch.cat([target[:, offset:], target.new_full((target.size(0), offset), pad)], 1)


def agreement(model, samples, outputs, dictionary):
    decoder, pad = model.decoder, dictionary.pad()
    k = decoder.proposal_heads
    agree, total, runs = torch.zeros(k - 1), torch.zeros(k - 1), []
    with torch.no_grad():
        for sample, hyps in zip(samples, outputs):
            target, prev = teacher_forced(hyps, dictionary)
            net = dict(sample["net_input"], prev_output_tokens=prev)
            features, _ = model(**net, features_only=True)
            ahead = torch.stack([shifted(target, j, pad) for j in range(k - 1)], -1)
            later = decoder.proposal_features(features, k - 1, tokens=ahead)
            guess = decoder.base_logits(later).argmax(-1)  # (B, T, k-1): head j+2 -> t+j+1
            alive = torch.ones_like(target, dtype=torch.bool)
            run = torch.zeros_like(target)
            for j in range(k - 1):
                label = shifted(target, j + 1, pad)
                valid = label.ne(pad)
                hit = guess[..., j].eq(label) & valid
                agree[j] += hit.sum()
                total[j] += valid.sum()
                alive &= hit
                run += alive.long()
            runs.append(run[target.ne(pad)].float())
    return (agree / total.clamp(min=1)).tolist(), float(torch.cat(runs).mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data")
    parser.add_argument("verifier")
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--split", default="test")
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("-s", "--source-lang", default=None)
    parser.add_argument("-t", "--target-lang", default=None)
    args = parser.parse_args()
    plugin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fairseq_pardec")
    utils.import_user_module(argparse.Namespace(user_dir=os.path.normpath(plugin)))
    overrides = {"data": args.data}
    if args.source_lang:
        overrides.update(source_lang=args.source_lang, target_lang=args.target_lang)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.verifier], arg_overrides=overrides)
    verifier = models[0].eval()
    task.load_dataset(args.split)
    data = task.dataset(args.split)
    n = min(args.sentences, len(data))
    samples = [data.collater([data[i] for i in range(s, min(s + 50, n))]) for s in range(0, n, 50)]
    dictionary = task.target_dictionary
    outputs = greedy_outputs(verifier, dictionary, samples)
    for path in args.heads:
        model = checkpoint_utils.load_model_ensemble([path], task=task)[0][0].eval()
        if not hasattr(model.decoder, "proposal_heads"):
            raise SystemExit("head_agreement.py: error: %s is not a blockwise_transformer checkpoint" % path)
        per_head, run = agreement(model, samples, outputs, dictionary)
        print("%s: heads 2..%d agree %s; mean run %.3f" % (
            path, len(per_head) + 1, " ".join("%.3f" % a for a in per_head), run))


if __name__ == "__main__":
    main()
