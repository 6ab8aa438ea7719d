"""The margin guard on CUDA (skipped without a GPU; ``pytest -m cuda tests/test_cuda_guard.py``).

* the float32 bound: every CUDA step's log-probabilities against fairseq's own decoder on the
  GPU, at batch 1/8/64 and blocks of 1-8 positions, stay under a tenth of CUDA_FP32_MARGIN
  (step/margins.py): the measurement the constant waits for, printed;
* crafted near-ties decided by fairseq's arithmetic replayed on the GPU, for every step kind;
* TF32 products refused before decoding;
* the engine reads the device once per iteration (its counter, and torch's own
  sync detector attributing each synchronising call to engine.py).
"""

import warnings

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import NoDrafter
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.step.margins import CUDA_FP32_MARGIN
from fairseq_pardec.errors import UsageError

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_step_margins import AlwaysDrafts, near_tie_model, nudge, static_step_or_skip

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def to_cuda(sample):
    from fairseq import utils

    return utils.move_to_cuda(sample)


def _steps(decoder):
    steps = {"reference": BlockDecoder(decoder), "lean": LeanBlockDecoder(decoder)}
    try:
        steps["static"] = static_step_or_skip(decoder)
    except pytest.skip.Exception:
        pass
    return steps


def _fairseq_log_probs(model, sample, tokens):
    """fairseq's own incremental decoder, one position at a time, as its greedy search runs it:
    (B, T, V) log-probabilities after each of ``tokens`` (B, T)."""
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    state = {}
    out = []
    for t in range(tokens.size(1)):
        logits, _ = model.decoder(tokens[:, : t + 1], encoder_out=encoder_out,
                                  incremental_state=state)
        out.append(model.get_normalized_probs((logits[:, -1:, :], None), log_probs=True))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@torch.no_grad()
def test_cuda_steps_stay_within_the_margin(batch_size):
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=batch_size).cuda().eval()
    sample = to_cuda(random_batch(d, [1 + (i * 13) % 45 for i in range(batch_size)],
                                  seed=batch_size))
    g = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(4, len(d), (batch_size, 12), generator=g).cuda()
    tokens[:, 0] = d.eos()
    expected = _fairseq_log_probs(model, sample, tokens)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    worst = {}
    for name, step in _steps(model.decoder).items():
        for width in (1, 4, 8):  # blocks of several positions on top of the cache
            state = step.new_state()
            got = []
            for start in range(0, tokens.size(1), width):
                block = tokens[:, start: start + width]
                layout = BlockLayout(torch.zeros_like(block, dtype=torch.bool))
                features = step.forward_packed(block, torch.full((batch_size,), start,
                                                                 device="cuda"),
                                               layout, encoder_out, state)
                got.append(layout.unpack(step.log_probs(features, state=state)))
            got = torch.cat(got, dim=1)
            worst[(name, width)] = float((got - expected).abs().max())
    print("CUDA |log-prob - fairseq's| at batch %d:" % batch_size, worst)
    assert max(worst.values()) < CUDA_FP32_MARGIN / 10
    # what lets the engine skip the guard on plain steps (one_position_exact): one position per
    # row through fairseq's operations on fairseq's shapes is bitwise fairseq's own step
    for name, step in _steps(model.decoder).items():
        if step.one_position_exact:
            assert worst[(name, 1)] == 0.0, name


@pytest.mark.parametrize("kind", ["reference", "lean", "static"])
def test_guard_decides_cuda_near_ties(kind):
    model, d, twins = near_tie_model(seed=11)
    model = model.cuda()
    sample = to_cuda(random_batch(d, [5, 9, 3], seed=4))
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=6)
    generator = DraftVerifyGenerator([model], d, AlwaysDrafts(len(d), d.pad()), ExactAcceptance(),
                                     max_len_a=1.0, max_len_b=6, lean=kind != "reference",
                                     fast=False)
    if kind == "static":
        generator.block_decoder = static_step_or_skip(model.decoder)
    nudge(generator.block_decoder, twins)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, expected)
    assert generator.stats.close_calls > 0
    assert generator.device_reads <= generator.stats.decoder_calls + generator.stats.close_calls


def test_tf32_is_refused_before_decoding():
    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=2).cuda()
    sample = to_cuda(random_batch(d, [4, 6], seed=1))
    generator = DraftVerifyGenerator([model], d, NoDrafter(), ExactAcceptance())
    matmul = torch.backends.cuda.matmul
    try:
        matmul.allow_tf32 = True
        with pytest.raises(UsageError, match="TF32"):
            generator.generate([model], sample)
    finally:
        matmul.allow_tf32 = False
    generator.generate([model], sample)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_engine_reads_the_device_once_per_iteration(batch_size):
    """lean_greedy on the lean step (its cache needs no compaction at one token per row): the
    engine's own counter, and torch's sync detector, which warns at every synchronising call,
    attributed to engine.py by the warning's stack."""
    import traceback

    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=5).cuda()
    sample = to_cuda(random_batch(d, [3 + (5 * i) % 20 for i in range(batch_size)], seed=3))
    generator = DraftVerifyGenerator([model], d, NoDrafter(), ExactAcceptance(), fast=False)
    generator.generate([model], sample)  # warm-up
    reads_before, calls_before = generator.device_reads, generator.stats.decoder_calls
    from_engine = []

    def record(message, category, filename, lineno, file=None, line=None):
        # the detector's warnings only: other warnings raised under the engine (torch's
        # deprecation of mismatched attention masks, once a call with "always") are no syncs
        if "synchroniz" not in str(message):
            return
        stack = "".join(traceback.format_stack())
        if "draft_verify/engine.py" in stack:
            from_engine.append(stack)

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            generator.generate([model], sample)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    iterations = generator.stats.decoder_calls - calls_before
    assert generator.device_reads - reads_before == iterations
    print("synchronising calls under engine.py: %d in %d iterations"
          % (len(from_engine), iterations))
    # the engine's read, the encoder's and the step's own per-batch set-up, the retired rows
    assert len(from_engine) <= iterations + 4 * batch_size + 8


@pytest.mark.parametrize("name", ["lean_greedy", "iad", "lookup", "auto"])
def test_syncs_per_iteration_on_the_static_step(name):
    """torch's sync detector on the step a CUDA decode takes (the static step), per generator:
    every synchronising call the detector sees, per iteration, beside the bounds the CPU counter
    keeps (tests/test_sync_count.py: the most per iteration on average, and per batch outside
    the iterations). The outputs are fairseq greedy's."""
    from test_sync_count import BOUNDS, LIMITS, _generator

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=3).cuda().eval()
    samples = [to_cuda(random_batch(d, [5, 12, 9, 3], seed=2)),
               to_cuda(random_batch(d, [11], seed=5))]
    generator = _generator(name, d, model)
    for sample in samples:  # warm-up: the step's buffers and graphs are recorded here
        generator.generate([model], sample)
    calls_before = generator.stats.decoder_calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outputs = [generator.generate([model], sample) for sample in samples]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    iterations = generator.stats.decoder_calls - calls_before
    for sample, got in zip(samples, outputs):
        expected = fairseq_greedy(model, d, sample, **LIMITS)
        assert by_id(sample, got) == by_id(sample, expected)
    _, mean, outside = BOUNDS[name]
    print("CUDA syncs, %s on %s: %d in %d iterations and %d batches (%.2f per iteration; "
          "CPU bound %.2f per iteration + %d per batch)"
          % (name, type(generator.block_decoder).__name__, syncs, iterations, len(samples),
             syncs / iterations, mean, outside))
    assert syncs <= mean * iterations + outside * len(samples)
