"""How many tokens an iteration could keep with the drafters that need no model: counts, no timing.

Verification is exact, so a draft keeps exactly its longest prefix that agrees with greedy
decoding's continuation, and every iteration adds one token of the verifier's own. Given a
model's greedy outputs, the draft of the copy drafter (iad's match) and of lookup (the source and
the output itself) after every prefix can therefore be scored without decoding. This module walks
each greedy output as the engine would and counts, per drafting rule:

* ``copy`` / ``lookup``: every iteration drafts ``cap`` tokens with that drafter;
* ``best of both``: every iteration verifies whichever of the two drafts keeps more, chosen with
  hindsight: in each iteration as much as any choice between them keeps at that cap
  (``--generator auto``'s choice is one, made without hindsight);
* ``cap=kept``: every draft is cut to exactly the tokens it keeps, chosen with hindsight (no
  rejected position is verified): the ceiling of any rule of draft lengths for that drafter.

Speed is tokens per iteration over an iteration's cost; what a verified position costs against a
plain iteration is the machine's (the benchmark's step table, docs/results.md). The counts say
how far drafting could go on a model before anything is timed: where ``best of both`` keeps
barely more than ``lookup``, mixing the two per row (auto) adds little at equal draft lengths,
and the distance from a generator's measured tokens per iteration to the ``cap=kept`` row is
what better draft lengths could still gain.

    python -m fairseq_pardec.benchmark.draft_ceiling DATA --path CKPT [-s SRC -t TGT]
"""

import argparse
from argparse import Namespace
from typing import Dict, List, Optional, Sequence

import torch

from fairseq_pardec.benchmark import runner
from fairseq_pardec.decoding.draft_verify.drafters.auto import COPY, LOOKUP, AutoDrafter
from fairseq_pardec.decoding.draft_verify.drafters.pricing import FixedPrices
from fairseq_pardec.errors import UsageError

BEST = "best of both"
# each rule's name and the drafters whose drafts it compares in every iteration
RULES = {"copy": (COPY,), "lookup": (LOOKUP,), BEST: (COPY, LOOKUP)}


def kept(draft: Sequence[int], continuation: Sequence[int]) -> int:
    """How many of ``draft``'s tokens exact verification keeps against ``continuation``."""
    count = 0
    for drafted, greedy in zip(draft, continuation):
        if drafted != greedy:
            break
        count += 1
    return count


def drafter_for(src_dict, tgt_dict) -> AutoDrafter:
    """The drafter whose copy and lookup drafts are scored: auto's, so that the drafts are
    exactly what ``--generator auto`` would verify (its prices are never read here)."""
    return AutoDrafter(src_dict, tgt_dict, prices=FixedPrices())


class SentenceDrafts:
    """The copy and lookup drafts of one sentence after a growing prefix of its output: the
    drafter's own matching, its state carried from one prefix to the next as in decoding (the
    sentence is a batch of one row; the drafter reads only its source tokens)."""

    def __init__(self, drafter: AutoDrafter, src_tokens: torch.Tensor, bos: int):
        self.drafter = drafter
        self.state = drafter.start({"net_input": {"src_tokens": src_tokens.view(1, -1)}},
                                   None, bos)
        # BOS + the prefix so far: the drafter's own record of the row's output, which
        # decoding extends with each iteration's accepted tokens
        self.output = self.state.outputs[0]

    def draft(self, kind: str, prefix: Sequence[int], cap: int) -> List[int]:
        self.output.extend(prefix[len(self.output) - 1:])
        return self.drafter.cheap_draft(self.state, kind, 0, len(prefix), cap)


def walk(drafts: SentenceDrafts, output: Sequence[int], kinds, cap: int,
         cut_to_kept: bool = False) -> tuple:
    """(iterations, verified positions) of decoding ``output`` when each iteration verifies the
    draft of ``kinds`` that keeps the most (of at most ``cap`` tokens; cut to what it keeps
    where ``cut_to_kept``)."""
    done = iterations = positions = 0
    while done < len(output):
        continuation = output[done:]
        best_kept, best_length = None, 0
        for kind in kinds:  # the most kept, the shorter draft among equals
            draft = drafts.draft(kind, output[:done], cap)
            keeps = kept(draft, continuation)
            length = keeps if cut_to_kept else len(draft)
            if best_kept is None or (keeps, -length) > (best_kept, -best_length):
                best_kept, best_length = keeps, length
        iterations += 1
        positions += 1 + best_length
        done += min(best_kept + 1, len(continuation))
    return iterations, positions


def ceilings(sentences, src_dict, tgt_dict, bos: int, caps: Sequence[int]) -> List[dict]:
    """One row per rule and cap: tokens per iteration and verified positions per token over
    ``sentences``, (source tokens, greedy output tokens) pairs."""
    rows = []
    tokens = sum(len(output) for _, output in sentences)
    drafter = drafter_for(src_dict, tgt_dict)  # built once: mapping dictionaries takes time
    for cap in list(caps) + [None]:
        for name, kinds in RULES.items():
            iterations = positions = 0
            for source, output in sentences:
                drafts = SentenceDrafts(drafter, source, bos)
                i, p = walk(drafts, output, kinds, cap or len(output), cut_to_kept=cap is None)
                iterations += i
                positions += p
            rows.append(dict(rule=name, cap="kept" if cap is None else cap,
                             tokens_per_iteration=tokens / max(1, iterations),
                             positions_per_token=positions / max(1, tokens)))
    return rows


def markdown(meta: Dict, rows: List[dict]) -> str:
    lines = ["%d sentences, %d greedy tokens (%s)" % (meta["sentences"], meta["tokens"],
                                                      meta["data"]), "",
             "| rule | cap | tokens / iteration | verified positions / token |",
             "|---|---:|---:|---:|"]
    for row in rows:
        lines.append("| %s | %s | %.3f | %.3f |" % (row["rule"], row["cap"],
                                                     row["tokens_per_iteration"],
                                                     row["positions_per_token"]))
    return "\n".join(lines)


def greedy_outputs(args) -> tuple:
    """(task, [(source tokens, greedy output)]) of the first ``--max-sentences`` sentences,
    decoded with lean_greedy (identical to fairseq's greedy search) in batches of 32, as
    fairseq-generate would with --batch-size 32 (its length limit follows each batch's longest
    source)."""
    task, model, use_cuda, utils = runner.load(args)
    dataset = task.dataset(args.gen_subset)
    samples = runner.batches(task, model, dataset, 32, args.max_sentences, use_cuda, utils)
    generator = runner.build(task, model, runner.parse_spec("lean_greedy"), args, use_cuda)
    outputs, _ = runner.decode(task, model, generator, samples)
    sentences = [(dataset[sid]["source"], outputs[sid].tolist()) for sid in sorted(outputs)]
    return task, sentences


def get_parser():
    p = argparse.ArgumentParser(prog="python -m fairseq_pardec.benchmark.draft_ceiling",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_model_arguments(p)
    p.add_argument("--max-sentences", type=int, default=300, help="first N sentences only")
    p.add_argument("--caps", type=int, nargs="+", default=[4, 8, 16],
                   help="draft lengths to count (a row for each, and one cut to what is kept)")
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--cpu", action="store_true")
    return p


def main(args, out=print):
    if args.max_sentences is not None and args.max_sentences < 1:
        raise UsageError("--max-sentences must be >= 1 (got %d)" % args.max_sentences)
    low = [cap for cap in args.caps if cap < 1]
    if low:
        raise UsageError("--caps must be >= 1 (got %d)" % low[0])
    runner.check_paths(args)
    runner.quiet_logs()
    # the greedy outputs in float32, the contract's precision (runner.load_model reads these)
    args = Namespace(**vars(args), fp16=False, bf16=False)
    task, sentences = greedy_outputs(args)
    if not sentences:
        raise UsageError("no sentences to count in %s's %r split (after --max-sentences %s and "
                         "the model's length limit); give a split with sentences (--gen-subset)"
                         % (args.data, args.gen_subset, args.max_sentences))
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    rows = ceilings(sentences, src_dict, tgt_dict, tgt_dict.eos(), args.caps)
    meta = dict(sentences=len(sentences), tokens=sum(len(o) for _, o in sentences),
                data=args.data)
    out(markdown(meta, rows))
    return rows


def cli_main(argv: Optional[List[str]] = None):
    return runner.cli_main(argv, make_parser=get_parser, command=main)


if __name__ == "__main__":
    cli_main()
