"""The benchmark's step table: what one decoder call costs, by batch and block size.

Speedup = tokens per iteration / cost of an iteration, so the cost of verifying a block of
``L`` positions against a one-position step says how many accepted tokens a drafter needs to
pay. For each batch size the table times, on the benchmark's own sentences with a cache of
``prefix`` target positions already decoded:

* fairseq's incremental step (what ``fairseq-generate --beam 1`` calls once per token), with
  its output projection and log-softmax, and the lean step (fairseq's operations in fairseq's
  order, step/lean.py) for one position;
* the engine's block step for blocks of 1, 4, 8 and 16 positions (the static step, replayed
  as CUDA graphs, on CUDA; the fast step in float32 on the CPU; else the lean step), projection
  and log-softmax included; the block is rolled back after each call so the cache stays at
  ``prefix``. On CUDA each call is timed to the end of its kernels.

Each cell is the median over ``repeats`` timed calls after a warm-up.
"""

import statistics
import time
from typing import Dict, List

import torch

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step_factory import block_decoder_for

BLOCKS = (1, 2, 4, 8, 16)


def median_ms(call, repeats: int, device=None) -> float:
    """Median wall time of ``repeats`` calls of ``call`` in ms, after a warm-up of 3. On a CUDA
    ``device`` each call is timed to the end of its kernels (a call only queues them)."""
    cuda = device is not None and torch.device(device).type == "cuda"

    def timed():
        call()
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(3):
        timed()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        timed()
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


def kernel_ms(call, repeats: int, device) -> float:
    """Mean GPU kernel time of a call in ms (torch profiler, CUDA activity only), beside its wall
    time: what the call costs the GPU, without the host's launches; NaN where the profiler sees
    no kernels (a build without CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize(device)
    total_us = sum(getattr(event, "self_device_time_total", 0.0) for event in prof.key_averages())
    return total_us / repeats / 1000.0 if total_us > 0 else float("nan")


def step_costs(model, sample, prefix: int = 16, repeats: int = 20,
               blocks=BLOCKS) -> Dict[str, float]:
    """ms per decoder call for one batch (``sample``): ``fairseq`` and ``block L`` per L."""
    decoder = model.decoder
    net_input = sample["net_input"]
    bsz = net_input["src_tokens"].size(0)
    device = net_input["src_tokens"].device
    g = torch.Generator().manual_seed(0)
    vocab = decoder.embed_tokens.num_embeddings
    history = torch.randint(4, vocab, (bsz, prefix + max(blocks)), generator=g).to(device)
    costs = {}
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(net_input)

        # fairseq's incremental step after ``prefix`` tokens
        state: Dict = {}
        decoder.forward(history[:, :prefix], encoder_out=encoder_out, incremental_state=state)
        saved = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
                 for k, v in state.items()}

        def fairseq_step():
            state.clear()
            state.update({k: dict(v) for k, v in saved.items()})
            out = decoder.forward(history[:, : prefix + 1], encoder_out=encoder_out,
                                  incremental_state=state)
            model.get_normalized_probs(out, log_probs=True)

        costs["fairseq"] = median_ms(fairseq_step, repeats, device)

        lean = block_decoder_for(decoder, lean=True, fast=False)
        lean_cache = lean.new_state()
        first = torch.zeros(bsz, dtype=torch.long, device=device)
        lean.forward_packed(history[:, :prefix], first,
                            BlockLayout(torch.zeros(bsz, prefix, dtype=torch.bool, device=device)),
                            encoder_out, lean_cache)
        one = BlockLayout(torch.zeros(bsz, 1, dtype=torch.bool, device=device))
        at_prefix = torch.full((bsz,), prefix, dtype=torch.long, device=device)
        none_kept = torch.zeros(bsz, dtype=torch.long, device=device)

        def lean_step():
            features = lean.forward_packed(history[:, prefix: prefix + 1], at_prefix, one,
                                           encoder_out, lean_cache)
            lean.log_probs(features)
            lean.rollback(lean_cache, 1, none_kept, keep_range=(0, 0))

        costs["lean"] = median_ms(lean_step, repeats, device)

        engine = block_decoder_for(decoder, lean=True, fast=True)
        cache = engine.new_state()
        start = torch.zeros(bsz, dtype=torch.long, device=device)
        no_pad = torch.zeros(bsz, prefix, dtype=torch.bool, device=device)
        engine.forward_packed(history[:, :prefix], start, BlockLayout(no_pad), encoder_out, cache)
        for length in blocks:
            block = history[:, prefix: prefix + length]
            layout = BlockLayout(torch.zeros(bsz, length, dtype=torch.bool, device=device))
            at = torch.full((bsz,), prefix, dtype=torch.long, device=device)
            reject = torch.zeros(bsz, dtype=torch.long, device=device)

            def block_step():
                features = engine.forward_packed(block, at, layout, encoder_out, cache)
                engine.log_probs(features, state=cache)
                engine.rollback(cache, length, reject, keep_range=(0, 0))

            costs["block %d" % length] = median_ms(block_step, repeats, device)
            if length == 1 and torch.device(device).type == "cuda":
                costs["block 1 kernels"] = kernel_ms(block_step, repeats, device)
    costs["engine"] = type(engine).__name__
    return costs


def markdown(table: List[dict], ct2_ms_per_step: Dict[int, float]) -> str:
    """The step table as markdown; ``ct2_ms_per_step``: batch size -> CTranslate2's ms per
    decoding step in the benchmark's ct2 row (all sentences, the same batches)."""
    lines = [
        "ms per decoder call (projection and log-softmax included), after %s positions, median "
        "of timed calls; *x step*: a block of 8 in one-position steps of the same engine; "
        "*ct2 step*: CTranslate2's ms per decoding step in its row above (its own process)."
        % (table[0]["prefix"] if table else "-"),
        "",
        "| batch | engine | fairseq step | lean step | " + " | ".join("block %d" % n for n in BLOCKS)
        + " | x step (8) | ct2 step |",
        "|---:|---|---:|---:|" + "---:|" * len(BLOCKS) + "---:|---:|",
    ]
    for row in table:
        ct2 = ct2_ms_per_step.get(row["batch_size"])
        lines.append(
            "| %d | %s | %.2f | %.2f | %s | %.2f | %s |" % (
                row["batch_size"], row["engine"], row["fairseq"], row["lean"],
                " | ".join("%.2f" % row["block %d" % n] for n in BLOCKS),
                row["block 8"] / row["block 1"], "" if ct2 is None else "%.2f" % ct2,
            )
        )
    return "\n".join(lines) + "\n"
