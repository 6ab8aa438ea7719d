#!/usr/bin/env python
"""What the vocabulary projection of R rows costs on this CPU, by kernel.

A decoding step multiplies R rows of features (1 at batch 1 greedy, a block's positions when a
draft is verified, batch x positions in a batch) by the output embedding (V x d). Three ways:
``F.linear`` (what fairseq calls: MKL), a contiguous transposed copy of the weight
(``x @ W_t``), and oneDNN with the weight packed once (``decoding/step/output_projection.py``).
"cold" flushes the caches before every call, as a real step does (the rest of the model passes
through the caches in between); "hot" repeats the call on a weight already in cache.

usage: examples/projection_cost.py [--vocab 8184] [--dim 256] [--rows 1 2 3 5 8 16 32 64]
"""

import argparse
import time

import torch


def median_time(fn, calls: int, flush) -> float:
    times = []
    for _ in range(calls):
        if flush is not None:
            flush.add_(1.0)  # streams 64 MB through the caches
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=8184)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.dim)
    transposed = weight.t().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    flush = torch.zeros(64 * 1024 * 1024 // 4)
    print("%d x %d projection, %d threads, median of %d calls, microseconds"
          % (args.vocab, args.dim, args.threads, args.calls))
    print("| rows | F.linear cold | x @ W_t cold | oneDNN packed cold | F.linear hot | x @ W_t hot "
          "| oneDNN packed hot |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        x = torch.randn(rows, args.dim)
        kernels = [
            lambda: torch.nn.functional.linear(x, weight),
            lambda: x @ transposed,
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        ]
        cells = [median_time(k, args.calls, flush) for k in kernels]
        cells += [median_time(k, args.calls, None) for k in kernels]
        print("| %d | %s |" % (rows, " | ".join("%.0f" % (c * 1e6) for c in cells)))


if __name__ == "__main__":
    main()
