#!/usr/bin/env python
"""What one decoder step's matrix products cost on this CPU, by kernel, for R rows.

A step of a transformer decoder multiplies R rows (batch x block positions) by every weight of
every layer (fused query/key/value, attention output, encoder-attention query and output, two
feed-forward maps) and by the output embedding. At batch 1 the weights (19 MB for a d256 3+3
model with an 8k vocabulary) do not stay in the caches from one step to the next, so the chain
is bound by how fast the weights stream in. This script times the whole chain, in the order a
step runs it, three ways: MKL's ``addmm`` on transposed copies (the fast step before oneDNN),
``F.linear`` (fairseq's modules), and oneDNN with every weight packed once
(``decoding/cpu/fast.py``). Runs alternate between the kernels; each cell is the median of 5
alternating medians (of ``--calls`` calls each, after a warm-up of 3).

usage: examples/decoder_products_cost.py CHECKPOINT [--rows 1 4 8 32 128 256] [--threads 2]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from fairseq_pardec.benchmark.step_table import median_ms


def decoder_weights(state):
    """(weight, bias) of every product of a step, in order, from a fairseq checkpoint's
    ``model`` state dict; the output embedding last (bias None)."""
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.")})
    out = []
    for i in layers:
        p = "decoder.layers.%d." % i
        qkv = [p + "self_attn.%s_proj." % n for n in "qkv"]
        out.append((torch.cat([state[n + "weight"] for n in qkv]),
                    torch.cat([state[n + "bias"] for n in qkv])))
        for name in ("self_attn.out_proj", "encoder_attn.q_proj", "encoder_attn.out_proj",
                     "fc1", "fc2"):
            out.append((state[p + name + ".weight"], state[p + name + ".bias"]))
    out.append((state.get("decoder.output_projection.weight",
                          state["decoder.embed_tokens.weight"]), None))
    return [(w.float().contiguous(), None if b is None else b.float()) for w, b in out]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)["model"]
    weights = decoder_weights(state)
    megabytes = sum(w.numel() for w, _ in weights) * 4 / 2 ** 20
    transposed = [(w.t().contiguous(), b) for w, b in weights]
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w, None), b) for w, b in weights]
    print("%d products, %.1f MB of float32 weights, %d threads" % (len(weights), megabytes,
                                                                 args.threads))
    print("| rows | addmm, transposed (ms) | F.linear (ms) | oneDNN packed (ms) |")
    print("|---:|---:|---:|---:|")
    with torch.no_grad():
        for rows in args.rows:
            inputs = {d: torch.randn(rows, d) for d in {w.size(1) for w, _ in weights}}

            def mkl():
                for w, b in transposed:
                    x = inputs[w.size(0)]
                    torch.addmm(b, x, w) if b is not None else x @ w

            def linear():
                for w, b in weights:
                    F.linear(inputs[w.size(1)], w, b)

            def onednn():
                for (w, _), (p, b) in zip(weights, packed):
                    torch.ops.mkldnn._linear_pointwise(inputs[w.size(1)], p, b, "none", [], "")

            kernels = {"mkl": mkl, "linear": linear, "onednn": onednn}
            runs = {name: [] for name in kernels}
            for _ in range(5):
                for name, fn in kernels.items():
                    runs[name].append(median_ms(fn, args.calls))
            print("| %d | %.2f | %.2f | %.2f |" % (
                rows, *(statistics.median(runs[name]) for name in kernels)))


if __name__ == "__main__":
    main()
