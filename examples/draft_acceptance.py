"""Tokens per iteration of the model-free drafters (iad, lookup), counted without the model.

Exact verification accepts exactly the verifier's greedy output, so once that output is known
(a ``fairseq-generate --beam 1`` log), how many tokens each iteration keeps follows from the
drafts alone: the real drafter classes propose, the known output accepts, batch 1, with the
drafters' own caps (adaptive under the CPU ceiling, or ``--block-size``). Outputs that reach the
length limit (degenerate loops) are also counted apart, since they are easy to draft from the
output itself.

usage: python examples/draft_acceptance.py DATA_BIN GENERATE_LOG -s SRC -t TGT [--split test]
       [--draft-corpus FILE] [--block-size K] [--sentences N] [--loop-length 200]
"""

import argparse
import os

import torch
from fairseq import utils
from fairseq.data import Dictionary, data_utils


def greedy_outputs(path, dictionary):
    """{sentence id: token ids + EOS} of the H- lines of a fairseq-generate log (BPE kept)."""
    outputs = {}
    with open(path, encoding="utf-8") as log:
        for line in log:
            if line.startswith("H-"):
                key, _, text = line.rstrip("\n").split("\t")
                outputs[int(key[2:])] = [dictionary.index(w) for w in text.split()] + [dictionary.eos()]
    return outputs


def tokens_per_iteration(make_drafter, sources, outputs, ids, eos):
    from fairseq_pardec.decoding.draft_verify.drafters import DraftOutcome, DraftView

    tokens = iterations = 0
    for i in ids:
        drafter = make_drafter()
        state = drafter.start({"net_input": {"src_tokens": sources[i].unsqueeze(0)}}, None, eos)
        target, kept = outputs[i], [eos]
        while len(kept) - 1 < len(target):
            n = len(kept) - 1
            draft = drafter.propose(state, DraftView([0], [n], [len(target) - n - 1],
                                                     torch.tensor([kept])))[0]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == target[n + accepted]:
                accepted += 1
            drafter.observe(state, DraftOutcome([0], [accepted]))
            kept += target[n: n + accepted + 1]  # the accepted drafts and the verifier's token
            iterations += 1
        tokens += len(target)
    return tokens / max(iterations, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data")
    parser.add_argument("generate_log")
    parser.add_argument("-s", "--source-lang", required=True)
    parser.add_argument("-t", "--target-lang", required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--draft-corpus", default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--sentences", type=int, default=None)
    parser.add_argument("--loop-length", type=int, default=200,
                        help="outputs at least this long (with EOS) count as loops")
    args = parser.parse_args()
    plugin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fairseq_pardec")
    utils.import_user_module(argparse.Namespace(user_dir=os.path.normpath(plugin)))
    from fairseq_pardec.decoding.draft_verify.drafters import CopyDrafter
    from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable

    s, t = args.source_lang, args.target_lang
    src_dict = Dictionary.load("%s/dict.%s.txt" % (args.data, s))
    tgt_dict = Dictionary.load("%s/dict.%s.txt" % (args.data, t))
    sources = data_utils.load_indexed_dataset("%s/%s.%s-%s.%s" % (args.data, args.split, s, t, s), src_dict)
    outputs = greedy_outputs(args.generate_log, tgt_dict)
    ids = sorted(outputs)[: args.sentences]
    loops = [i for i in ids if len(outputs[i]) >= args.loop_length]
    clean = [i for i in ids if len(outputs[i]) < args.loop_length]
    table = NgramTable.from_file(args.draft_corpus, tgt_dict) if args.draft_corpus else None
    adaptive = args.block_size is None
    drafters = (
        ("iad", lambda: CopyDrafter(src_dict, tgt_dict, args.block_size, adaptive=adaptive)),
        ("lookup" + (" + table" if table else ""),
         lambda: LookupDrafter(src_dict, tgt_dict, table, args.block_size, adaptive=adaptive)),
    )
    print("%d sentences, %d of them loops (outputs of >= %d tokens)" % (len(ids), len(loops), args.loop_length))
    for name, make in drafters:
        every = tokens_per_iteration(make, sources, outputs, ids, tgt_dict.eos())
        without = tokens_per_iteration(make, sources, outputs, clean, tgt_dict.eos())
        print("%-16s tokens per iteration %.3f; without the loops %.3f" % (name, every, without))


if __name__ == "__main__":
    main()
