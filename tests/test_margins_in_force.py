"""Margins that follow the model (step/calibration.py, step/margins.py ``margins_in_force``).

* the rule: each margin the larger of its floor and twenty times the spread measured on the
  model;
  no teacher-forced pass where its margin would not be below the step's;
* a step that strays three times its declared floor: with the margin measured on the model the
  outputs are fairseq greedy's, where the floor alone lets crafted near-ties go the other way;
* the measurement is made on a model's first batches until enough rows are measured, once per
  model, step kind, device and dtype, and again after the weights change;
* at transformer_wmt_en_de and transformer_vaswani_wmt_en_de_big widths (random weights,
  embeddings scaled to a trained model's logit range): the spread on other sentences than the
  measured ones stays under a tenth of the margin in force, and the outputs equal fairseq
  greedy's.
"""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import CopyDrafter
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.step import calibration, rounding_spread
from fairseq_pardec.decoding.step.margins import (CPU_FP32_MARGIN, MEASURED_HEADROOM,
                                                  margins_in_force)

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_step_margins import GAP, AlwaysDrafts, nudge

pytestmark = pytest.mark.full_calibration

LIMITS = dict(max_len_a=1.0, max_len_b=6)


def test_the_rule():
    # below the floor: the floor
    m = margins_in_force(5e-4, 1.6e-4, 2e-5, 5e-6, 100)
    assert (m.step, m.teacher_forced) == (5e-4, 1.6e-4)
    # above it: MEASURED_HEADROOM times the measurement
    m = margins_in_force(5e-4, 1.6e-4, 1e-4, 3e-5, 100)
    assert m.step == pytest.approx(MEASURED_HEADROOM * 1e-4)
    assert m.teacher_forced == pytest.approx(MEASURED_HEADROOM * 3e-5)
    # a pass no tighter than the step certifies nothing: every close call is replayed
    m = margins_in_force(5e-4, 1.6e-4, 1e-5, 3e-5, 100)
    assert m.step == 5e-4 and m.teacher_forced is None
    assert "pass replay" in m.describe()
    # none claimed on this device and dtype
    assert margins_in_force(2.5e-4, None, 1e-5, None, 10).teacher_forced is None


def twin_model(seed, **sizes):
    """A tiny transformer whose every other token has a twin GAP below it (as
    test_step_margins.near_tie_model, without rounding the logits: rounded logits jump by a
    sixteenth where two kernels round a feature apart, which the measurement would rightly
    see)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=seed, **sizes)
    project = model.decoder.output_layer
    first = torch.arange(d.nspecial, len(d) - 1, 2)

    def twin_logits(features):
        logits = project(features)
        logits[..., first + 1] = logits[..., first] - GAP
        return logits

    model.decoder.output_layer = twin_logits
    return model, d, first + 1


@pytest.mark.parametrize("kind,size", [("fast", "tiny"), ("lean", "tiny"), ("fast", "base")])
def test_a_step_straying_beyond_its_floor_is_measured_and_guarded(kind, size):
    """Near-ties everywhere (every other token a twin 2**-14 below its first), and a step
    straying 1.5e-3 towards each twin: three times the floor."""
    model, d, twins = twin_model(seed=11, **SIZES.get(size, {}))
    sample = random_batch(d, [5, 9, 3, 7], seed=4)
    expected = by_id(sample, fairseq_greedy(model, d, sample, **LIMITS))
    amount = 3 * CPU_FP32_MARGIN  # a lead of 1.5e-3 - 6e-5: certain at the floor

    def decoded(margin):
        generator = DraftVerifyGenerator([model], d, AlwaysDrafts(len(d), d.pad()),
                                         ExactAcceptance(), **LIMITS, lean=True,
                                         fast=kind == "fast", margin=margin)
        model.__dict__.pop("_pardec_margins", None)
        nudge(generator.block_decoder, twins, amount)  # strays beyond the floor
        return generator, by_id(sample, generator.generate([model], sample))

    generator, got = decoded(None)
    assert got == expected
    assert generator.stats.close_calls > 0
    assert "measured %.1e" % amount in generator.stats.margins, generator.stats.margins
    # the floor alone would not have held: the test has teeth
    _, floor_only = decoded(CPU_FP32_MARGIN)
    assert floor_only != expected


def test_measured_until_enough_rows_then_kept_until_the_weights_change(monkeypatch):
    """Batches of 2 rows: the first ROWS / 2 batches are measured (across the generators built
    on the model), later ones not, until a weight changes."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=3)
    sample = random_batch(d, [6, 4], seed=1)
    calls = []
    measure = rounding_spread.measure
    monkeypatch.setattr(rounding_spread, "measure",
                        lambda *a, **k: calls.append(len(a[3])) or measure(*a, **k))
    for _ in range(2):  # two generators on one model share the measurement
        generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                         **LIMITS)
        for _ in range(calibration.ROWS // 2 + 1):
            generator.generate([model], sample)
    assert calls == [2] * (calibration.ROWS // 2)
    assert generator.stats.margins.startswith("margin ")
    with torch.no_grad():
        model.decoder.layers[0].fc1.weight.mul_(1.01)
    generator.generate([model], sample)
    assert len(calls) == calibration.ROWS // 2 + 1


SIZES = {
    # transformer_wmt_en_de: d512, ffn 2048, 8 heads, 6+6 layers
    "base": dict(encoder_embed_dim=512, decoder_embed_dim=512, encoder_ffn_embed_dim=2048,
                 decoder_ffn_embed_dim=2048, encoder_attention_heads=8,
                 decoder_attention_heads=8, encoder_layers=6, decoder_layers=6),
    # transformer_vaswani_wmt_en_de_big's widths (d1024, ffn 4096, 16 heads), 2+2 layers to
    # keep the suite short: the dot products' length, not the depth, sets most of the rounding
    "big": dict(encoder_embed_dim=1024, decoder_embed_dim=1024, encoder_ffn_embed_dim=4096,
                decoder_ffn_embed_dim=4096, encoder_attention_heads=16,
                decoder_attention_heads=16, encoder_layers=2, decoder_layers=2),
}


def sized_model(size, d, seed=0):
    """Random weights with the shared embeddings scaled so that the logits span what a trained
    model's do (a standard deviation near 4 where initialisation gives about 1): a wider logit
    range and larger products are what round further."""
    model = tiny_transformer(make_task(d), seed=seed, share_all_embeddings=True, **SIZES[size])
    with torch.no_grad():
        model.decoder.embed_tokens.weight.mul_(4.0)
    return model.eval()


@pytest.mark.parametrize("size", ["base", "big"])
def test_real_sizes_stay_within_the_margin_in_force(size):
    torch.set_num_threads(2)
    d = make_dictionary(1000)
    model = sized_model(size, d)
    measured = random_batch(d, [12, 9, 15, 7, 11, 13, 8, 10], seed=5)  # ROWS rows
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                     max_len_a=1.0, max_len_b=5)
    got = generator.generate([model], measured)
    assert by_id(measured, got) == by_id(measured, fairseq_greedy(
        model, d, measured, max_len_a=1.0, max_len_b=5))
    (measured,) = model._pardec_margins.values()
    margins = measured.in_force
    # other sentences than the measured ones, every way the engine computes a log-probability
    others = rounding_spread.single_rows(random_batch(d, [10, 14, 8], seed=9)["net_input"],
                                         d.pad(), 3)  # 36 positions
    step, encode = generator._step_and_encoder()
    spreads = rounding_spread.measure(model, step, encode, others, d.eos(), d.eos(), d.pad(),
                                      max_tokens=12)
    largest = max(spreads[w].largest for w in ("step", "block", "step, batch 1"))
    print("%s: %s; on other sentences: step %.2e, pass %.2e" % (
        size, margins.describe(), largest, spreads["pass"].largest))
    assert largest < margins.step / 10
    if margins.teacher_forced is not None:
        assert spreads["pass"].largest < margins.teacher_forced / 10


def test_half_precision_says_it_is_not_guaranteed(caplog):
    """No margin is claimed in half precision, so no guard runs: one warning says the outputs
    are not guaranteed identical to float32 greedy, once per dtype."""
    from fairseq_pardec.decoding.step import margins

    margins._unguarded_warned.discard(torch.bfloat16)
    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=2).to(torch.bfloat16)
    sample = random_batch(d, [5, 3], seed=1)
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(), **LIMITS)
    with caplog.at_level("WARNING"):
        generator.generate([model], sample)
        generator.generate([model], sample)
    lines = [r.getMessage() for r in caplog.records if "not guaranteed identical" in r.getMessage()]
    assert len(lines) == 1 and "bfloat16" in lines[0]
    assert generator.stats.margins == ""


def test_a_decoder_the_one_row_steps_do_not_cover_is_measured_against_fairseqs_own():
    """NormFormer's layers are neither the lean step's nor the one-row steps': the reference is
    fairseq's incremental decoder itself, the spread that of fairseq's modules run on blocks
    (small), and no pass is measured (the guard runs none there)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=5, scale_attn=True)
    sample = random_batch(d, [6, 9, 4], seed=2)
    generator = DraftVerifyGenerator([model], d, AlwaysDrafts(len(d), d.pad()),
                                     ExactAcceptance(), **LIMITS)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, fairseq_greedy(model, d, sample, **LIMITS))
    (measured,) = model._pardec_margins.values()
    assert measured.step_spread < 1e-5 and measured.pass_spread is None
    assert measured.in_force.teacher_forced is None
