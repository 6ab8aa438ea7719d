"""Every decoder step declares its margin, and the engine guards every step that may round
otherwise than fairseq: on crafted near-ties each step kind's close calls go to fairseq's own
arithmetic, and the output stays fairseq's. Also: the TF32 refusal, and the engine's one
read of the device per iteration."""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import Drafter, NoDrafter
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.step.margins import (CPU_FP32_MARGIN, CUDA_FP32_MARGIN,
                                                  reduced_precision_matmuls,
                                                  refuse_reduced_precision_matmuls,
                                                  rounding_margin)
from fairseq_pardec.errors import UsageError

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer

# the twins' gap: far above the rounding of adding a score (~1e-7 x |score|), far below twice
# any declared margin; and the step's error the test adds, within the margin
GAP = 2.0 ** -14
NUDGE = 2 * GAP


def near_tie_model(seed):
    """A tiny transformer whose every other token has a twin GAP below it. The logits are
    rounded to multiples of 2**-4 first, so that every way of computing them (blocks, kernels)
    agrees exactly on them and the only rounding error is the one the test adds to a step."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=seed)
    project = model.decoder.output_layer
    first = torch.arange(d.nspecial, len(d) - 1, 2)

    def twin_logits(features):
        logits = torch.round(project(features) * 16) / 16
        logits[..., first + 1] = logits[..., first] - GAP
        return logits

    model.decoder.output_layer = twin_logits
    return model, d, first + 1


def nudge(step, twins, amount=NUDGE):
    """Make ``step`` prefer each twin to its first by ``amount`` - GAP (by default a rounding
    error within its margin that flips every such choice)."""
    log_probs = step.log_probs

    def nudged(features, temperature=1.0, state=None):
        lprobs = log_probs(features, temperature, state)
        lprobs[..., twins.to(lprobs.device)] += amount
        return lprobs

    step.log_probs = nudged


class AlwaysDrafts(Drafter):
    """Two seeded random tokens per row wherever there is room: every iteration verifies a
    block of several positions."""

    def __init__(self, vocab: int, pad: int):
        self.vocab, self.pad = vocab, pad
        self.g = torch.Generator().manual_seed(0)

    def propose(self, state, view):
        return [torch.randint(4, self.vocab, (min(2, room),), generator=self.g).tolist()
                for room in view.room]


def static_step_or_skip(decoder):
    factory = pytest.importorskip("fairseq_pardec.decoding.step_factory")
    static = pytest.importorskip("fairseq_pardec.decoding.cuda.static")
    if not static.static_supported(decoder):
        pytest.skip("the static step does not cover this decoder")
    return factory.block_decoder_for(decoder, static=True)


def _generator(model, d, kind, drafter):
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.0,
                                     max_len_b=6, lean=kind != "reference", fast=kind == "fast")
    if kind == "static":
        generator.block_decoder = static_step_or_skip(model.decoder)
    return generator


STEP_TYPES = {"reference": BlockDecoder, "lean": LeanBlockDecoder, "fast": FastBlockDecoder}


def test_each_step_declares_its_margin():
    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=3)
    reference = BlockDecoder(model.decoder)
    lean = LeanBlockDecoder(model.decoder)
    fast = FastBlockDecoder(model.decoder)
    # fairseq's modules at one position per row are fairseq's own step; a block is not
    assert reference.one_position_exact and reference.margin == CPU_FP32_MARGIN
    # the lean step's vocabulary projection on the CPU is its own kernel
    assert not lean.one_position_exact and lean.margin == CPU_FP32_MARGIN
    assert not fast.one_position_exact and fast.margin == CPU_FP32_MARGIN
    model.half()
    assert BlockDecoder(model.decoder).margin is None  # half precision: no claim, no guard


def test_rounding_margin_per_device_and_dtype():
    assert rounding_margin("cpu", torch.float32) == CPU_FP32_MARGIN
    assert rounding_margin(torch.device("cuda", 0), torch.float32) == CUDA_FP32_MARGIN
    assert rounding_margin("cpu", torch.float64) == CPU_FP32_MARGIN
    assert rounding_margin("cuda", torch.float16) is None
    assert rounding_margin("cpu", torch.bfloat16) is None


def test_tf32_matmuls_are_refused_by_name():
    """Read through torch's legacy settings (which a CPU build keeps too): the refusal names the
    setting; the CPU, half precision and float32 products pass."""
    matmul = torch.backends.cuda.matmul
    assert reduced_precision_matmuls() is None
    refuse_reduced_precision_matmuls("cuda", torch.float32)
    try:
        matmul.allow_tf32 = True
        assert "allow_tf32 = True" in reduced_precision_matmuls()
        with pytest.raises(UsageError, match="TF32.*set_float32_matmul_precision\\('highest'\\)"):
            refuse_reduced_precision_matmuls("cuda", torch.float32)
        refuse_reduced_precision_matmuls("cpu", torch.float32)
        refuse_reduced_precision_matmuls("cuda", torch.float16)
    finally:
        matmul.allow_tf32 = False
    try:
        torch.set_float32_matmul_precision("high")
        assert reduced_precision_matmuls() is not None
        with pytest.raises(UsageError):
            refuse_reduced_precision_matmuls(torch.device("cuda"), torch.float32)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert reduced_precision_matmuls() is None


@pytest.mark.parametrize("kind", ["reference", "lean", "fast", "static"])
def test_guard_decides_near_ties_on_every_step(kind):
    """Each step, made to err within its margin at every twin near-tie, still gives fairseq's
    output: every such choice is a close call that fairseq's arithmetic decides."""
    model, d, twins = near_tie_model(seed=11)
    sample = random_batch(d, [5, 9, 3], seed=4)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=6)
    generator = _generator(model, d, kind, AlwaysDrafts(len(d), d.pad()))
    if kind in STEP_TYPES:
        assert type(generator.block_decoder) is STEP_TYPES[kind]
    nudge(generator.block_decoder, twins)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, expected)
    assert generator.stats.close_calls > 0
    # one read of the device per iteration (the replays read on their own)
    assert generator.device_reads == generator.stats.decoder_calls


def test_the_nudge_changes_choices_without_the_guard():
    """The test above is not vacuous: with no margin the nudged step's choices are its own."""
    model, d, twins = near_tie_model(seed=11)
    sample = random_batch(d, [5, 9, 3], seed=4)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=6)
    generator = _generator(model, d, "lean", AlwaysDrafts(len(d), d.pad()))
    generator.margin = 0.0
    nudge(generator.block_decoder, twins)
    assert by_id(sample, generator.generate([model], sample)) != by_id(sample, expected)


def test_plain_steps_of_fairseqs_modules_need_no_guard():
    """Greedy steps through fairseq's own modules round as fairseq does: no close call, and
    fairseq's output on the same near-tie model (nothing nudged)."""
    model, d, _ = near_tie_model(seed=12)
    sample = random_batch(d, [5, 9, 3], seed=6)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=6)
    generator = _generator(model, d, "reference", NoDrafter())
    assert generator._guarded()
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, expected)
    assert generator.stats.close_calls == 0
    assert generator.device_reads == generator.stats.decoder_calls


def test_half_precision_runs_no_guard():
    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=3).half()
    generator = DraftVerifyGenerator([model], d, NoDrafter(), ExactAcceptance())
    assert not generator._guarded()
