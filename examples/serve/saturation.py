"""How fast the server's running batch decodes when every request is already waiting: the peak
a replica can reach, without HTTP, a client or arrivals in between.

    python examples/serve/saturation.py DATA --path CKPT --input FILE [--sentences 300]
        [--rounds 3] [--batch-size 32] [fairseq-pardec-serve's options]

The same model (loaded once, as the server loads it) decodes the first ``--sentences`` lines of
``--input`` three ways, in alternating rounds:

* ``join``: the server's ``IterationBatch``: up to ``--batch-size`` rows run; whenever rows
  finish, the next lines in file order join before the next iteration, encoded ahead up to
  ``--prepare-rows`` at a time (by default ``--batch-size``) while more wait than there are
  free places;
* ``join-each``: the same with ``--prepare-rows 0``: each joiner is encoded as it joins;
* ``rounds``: the server's ``RoundBatch``: ``--batch-size`` lines in file order, decoded to
  their end, then the next;
* ``offline``: the lines sorted by length, in batches of ``--batch-size`` (what the offline
  benchmark's batch rows do).

It prints sentences per second for each (median over rounds), ``join`` over ``offline``
(paired by round), and per way the decoder calls and the mean rows an iteration ran. Every
output of every way is compared with each sentence decoded alone (at batch 1, untimed; for a
lossless generator fairseq greedy's ``--batch-size 1`` output). ``join`` must equal it: each
joined row has its own length limit. ``rounds`` and ``offline`` decode fairseq's batches, whose
rows share the limit of the batch's longest source, so a row that reaches its limit alone ends
elsewhere there.
"""

import argparse
import functools
import statistics
import sys
import time


def run_join(model, rows_of, capacity, prepare=None):
    from fairseq_pardec.serve.running_batch import IterationBatch, Row

    batch = IterationBatch(model, capacity, prepare)
    waiting = [Row(source=source, job=None, index=i) for i, source in enumerate(rows_of)]
    waiting.reverse()
    outputs = {}
    while waiting or batch.running():
        room = batch.room()
        if room and waiting:
            batch.admit([waiting.pop() for _ in range(min(room, len(waiting)))])
        for row in batch.step().finished:
            outputs[row.index] = row.hypotheses[0]["tokens"].tolist()
    return outputs


def run_rounds(model, rows_of, capacity):
    from fairseq_pardec.serve.running_batch import RoundBatch, Row

    batch = RoundBatch(model, capacity)
    outputs = {}
    for start in range(0, len(rows_of), capacity):
        batch.admit([Row(source=source, job=None, index=start + i)
                     for i, source in enumerate(rows_of[start: start + capacity])])
        for row in batch.step().finished:
            outputs[row.index] = row.hypotheses[0]["tokens"].tolist()
    return outputs


def run_offline(model, rows_of, capacity):
    order = sorted(range(len(rows_of)), key=lambda i: len(rows_of[i]))
    outputs = {}
    for start in range(0, len(order), capacity):
        ids = order[start: start + capacity]
        sample = model.batch([rows_of[i] for i in ids])
        for position, hypos in zip(sample["id"].tolist(), model.decode(sample)):
            outputs[ids[position]] = hypos[0]["tokens"].tolist()
    return outputs


def run_join_each(model, rows_of, capacity):
    return run_join(model, rows_of, capacity, prepare=0)


WAYS = {"join": run_join, "join-each": run_join_each, "rounds": run_rounds,
        "offline": run_offline}


def loaded(argv, **more):
    """``--input``, ``--sentences`` and ``more`` (name -> default, an int) of this command line,
    the server's options of the rest, the model loaded as the server loads it, and the first
    ``--sentences`` non-empty lines of ``--input`` encoded as its rows."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--input", required=True)
    ours.add_argument("--sentences", type=int, default=300)
    for name, default in more.items():
        ours.add_argument("--" + name, type=int, default=default)
    mine, rest = ours.parse_known_args(argv)

    from fairseq_pardec.input_files import text_lines
    from fairseq_pardec.serve.model import LoadedModel
    from fairseq_pardec.serve.options import parse_args

    args = parse_args(rest)
    model = LoadedModel(args)
    texts = [t for t in text_lines(mine.input, "--input") if t.strip()][: mine.sentences]
    return mine, args, model, [model.encode(text) for text in texts]


def main(argv=None):
    mine, args, model, rows_of = loaded(argv, rounds=3)

    import torch

    capacity = args.batch_size
    # the server's join, with this command's --prepare-rows
    ways = dict(WAYS, join=functools.partial(run_join, prepare=args.prepare_rows))
    stats = model.generator.stats
    with torch.no_grad():
        alone = run_offline(model, rows_of, 1)  # each sentence at batch 1: the reference
    seconds = {way: [] for way in ways}
    work = {}
    outputs = {}
    with torch.no_grad():
        for way, run in ways.items():  # warm-up
            run(model, rows_of[: capacity], capacity)
        for round_ in range(mine.rounds):
            names = list(ways)
            turn = round_ % len(names)
            for way in names[turn:] + names[:turn]:
                calls, row_iterations = stats.decoder_calls, stats.row_iterations
                start = time.perf_counter()
                outputs[way] = ways[way](model, rows_of, capacity)
                seconds[way].append(time.perf_counter() - start)
                work[way] = (stats.decoder_calls - calls, stats.row_iterations - row_iterations)
    n = len(rows_of)
    for way in ways:
        calls, row_iterations = work[way]
        same = sum(outputs[way][i] == alone[i] for i in range(n))
        print("%-9s %7.1f sent/s  decoder calls %6d  rows an iteration %5.1f  = alone %d/%d"
              % (way, n / statistics.median(seconds[way]), calls,
                 row_iterations / max(1, calls), same, n))
    for way in ("join", "join-each"):
        ratios = [off / joined for off, joined in zip(seconds["offline"], seconds[way])]
        print("%s / offline: %.2f (%.2f-%.2f) over %d rounds"
              % (way, statistics.median(ratios), min(ratios), max(ratios), mine.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
