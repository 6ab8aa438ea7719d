"""What verifying K extra draft positions costs per iteration, on this machine, for this model.

A drafter that always proposes K copies of one token (nearly always rejected) runs next to
lean_greedy (nothing drafted) on the same sentences, batch 1, alternating, median of 3: the time
of one iteration (one verifier call) against an iteration with nothing drafted. A draft of K
tokens pays for itself only if it is accepted often enough to cover that ratio.

usage: python examples/position_cost.py DATA_BIN CHECKPOINT [-s SRC -t TGT] [--sentences 40]
       [--extra 1 2 4 8 16] [--token the] [--cpu]
"""

import argparse
import os
import statistics
import time

import torch
from fairseq import checkpoint_utils, utils


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data")
    parser.add_argument("checkpoint")
    parser.add_argument("-s", "--source-lang", default=None)
    parser.add_argument("-t", "--target-lang", default=None)
    parser.add_argument("--split", default="test")
    parser.add_argument("--sentences", type=int, default=40)
    parser.add_argument("--extra", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--token", default="the", help="the drafted token (a frequent one)")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    plugin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fairseq_pardec")
    utils.import_user_module(argparse.Namespace(user_dir=os.path.normpath(plugin)))
    from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
    from fairseq_pardec.decoding.draft_verify.drafters import Drafter, NoDrafter

    overrides = {"data": args.data}
    if args.source_lang:
        overrides.update(source_lang=args.source_lang, target_lang=args.target_lang)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.checkpoint], arg_overrides=overrides)
    model = models[0].eval()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        model.cuda()
    task.load_dataset(args.split)
    data = task.dataset(args.split)
    samples = [data.collater([data[i]]) for i in range(min(args.sentences, len(data)))]
    if cuda:
        samples = [utils.move_to_cuda(s) for s in samples]
    dictionary = task.target_dictionary
    token = dictionary.index(args.token)

    class Repeat(Drafter):
        def __init__(self, k):
            self.k = k

        def propose(self, state, view):
            return [[token] * min(room, self.k) for room in view.room]

    generators = {k: DraftVerifyGenerator([model], dictionary, Repeat(k) if k else NoDrafter(),
                                          ExactAcceptance(), max_len_a=1.2, max_len_b=10)
                  for k in [0] + args.extra}
    times = {k: [] for k in generators}
    with torch.no_grad():
        for generator in generators.values():  # warm-up
            for sample in samples[:5]:
                generator.generate([model], sample)
        for _ in range(3):
            for k, generator in generators.items():
                generator.stats.reset()
                if cuda:
                    torch.cuda.synchronize()
                began = time.perf_counter()
                for sample in samples:
                    generator.generate([model], sample)
                if cuda:
                    torch.cuda.synchronize()
                times[k].append((time.perf_counter() - began) / generator.stats.decoder_calls)
    base = statistics.median(times[0])
    for k in generators:
        t = statistics.median(times[k])
        print("extra positions %2d: %.2f ms per iteration, %.2f x nothing drafted" % (k, t * 1e3, t / base))


if __name__ == "__main__":
    main()
