"""The lean block step computes fairseq's module path bit for bit, through rollbacks,
compaction and batch shrinking; unsupported layers fall back to the module path."""

import math

import pytest
import torch

from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.step_factory import block_decoder_for
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder

from helpers import make_dictionary, make_task, random_batch, tiny_transformer


def _drive(blocks, model, sample, seed, ragged=True, encode=None):
    """Run the same random block / rollback / compact / shrink schedule; return every feature.
    ``encode``: what encodes the batch (fairseq's encoder by default)."""
    d_pad = model.decoder.padding_idx
    with torch.no_grad():
        enc = (encode or model.encoder.forward_torchscript)(sample["net_input"])
    bsz = sample["net_input"]["src_tokens"].size(0)
    g = torch.Generator().manual_seed(seed)
    state = blocks.new_state()
    start = torch.zeros(bsz, dtype=torch.long)
    last = torch.full((bsz,), 2, dtype=torch.long)
    features = []
    with torch.no_grad():
        for it in range(9):
            width = int(torch.randint(1, 6, (1,), generator=g))
            lens = torch.randint(1, width + 1, (start.numel(),), generator=g)
            if not ragged:
                lens = torch.full_like(lens, width)
            block = torch.randint(4, 40, (start.numel(), width), generator=g)
            block[:, 0] = last
            block_pad = torch.arange(width).unsqueeze(0) >= lens.unsqueeze(1)
            x = blocks.forward_block(block, start, block_pad, enc, state)
            features.append(torch.where(block_pad.unsqueeze(-1), torch.zeros_like(x), x))
            keep = torch.stack([torch.randint(1, int(n) + 1, (1,), generator=g)[0] for n in lens])
            blocks.rollback(state, width, keep)
            blocks.compact(state, min_holes=0.3)
            last = block[torch.arange(start.numel()), keep - 1]
            start = start + keep
            if it in (4, 7) and start.numel() > 1:  # a row finishes: the batch shrinks
                alive = torch.arange(start.numel())[1:]
                start, last = start[alive], last[alive]
                blocks.reorder(state, alive)
                enc = model.encoder.reorder_encoder_out(enc, alive)
    assert d_pad == model.decoder.padding_idx
    return features


@pytest.mark.parametrize("overrides", [
    {},
    {"decoder_normalize_before": True, "encoder_normalize_before": True},
    {"decoder_learned_pos": True},
    {"no_scale_embedding": True, "layernorm_embedding": True},
])
def test_lean_equals_module_path(overrides):
    """Blocks without padding: bit for bit (same operations, same shapes), rollback holes,
    compaction and batch shrinking included. Ragged blocks run the position-wise work on the
    real positions only (other matrix shapes, so float rounding may differ by ~1e-7)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=21, **overrides)
    sample = random_batch(d, [4, 9, 1, 15, 6, 3], seed=5)
    lean = block_decoder_for(model.decoder)
    assert isinstance(lean, LeanBlockDecoder)
    module = BlockDecoder(model.decoder)
    a = _drive(lean, model, sample, seed=3, ragged=False)
    b = _drive(module, model, sample, seed=3, ragged=False)
    for x, y in zip(a, b):
        # bitwise by construction: the lean step runs fairseq's own tensor operations on the same
        # shapes in the same order (lean.py), so each product goes through the same kernel
        assert torch.equal(x, y)
    a = _drive(lean, model, sample, seed=4)
    b = _drive(module, model, sample, seed=4)
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=0, atol=1e-5)


def test_unsupported_layers_keep_the_module_path():
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=22, scale_attn=True, scale_fc=True)
    blocks = block_decoder_for(model.decoder)
    assert type(blocks) is BlockDecoder
    sample = random_batch(d, [5, 7], seed=6)
    assert len(_drive(blocks, model, sample, seed=1)) == 9


def test_output_layer_through_a_packed_copy():
    """Any number of rows goes through oneDNN's packed copy of the weight (another kernel than
    fairseq's F.linear, same values up to float rounding), refreshed when the weight changes;
    a replaced output layer is always honoured."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=23)
    lean, module = LeanBlockDecoder(model.decoder), BlockDecoder(model.decoder)
    x = torch.randn(7, model.decoder.embed_dim)
    with torch.no_grad():
        assert torch.allclose(lean.log_probs(x), module.log_probs(x), rtol=0, atol=1e-5)
        assert torch.allclose(lean.log_probs(x[:1]), module.log_probs(x[:1]), rtol=0, atol=1e-5)
        model.decoder.output_projection.weight.mul_(2.0)  # in place: the copy must follow
        assert torch.allclose(lean.log_probs(x), module.log_probs(x), rtol=0, atol=1e-5)
        model.decoder.output_layer = lambda f: torch.zeros(f.shape[:-1] + (len(d),))
        honoured = lean.log_probs(x)
        # zero logits: every entry is the same 0 - logsumexp, so the row is constant to the bit;
        # its value goes through the log-softmax kernel's own log, so within a float32 rounding
        assert torch.equal(honoured, honoured[:1, :1].expand_as(honoured))
        assert abs(float(honoured[0, 0]) + math.log(len(d))) < 1e-6


def test_output_projection_without_onednn(monkeypatch):
    """Where oneDNN's packed linear is missing (or the weight is not float32), the projection
    runs on a transposed copy: same values up to float rounding."""
    from fairseq_pardec.decoding.step import onednn, output_projection

    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=24)
    x = torch.randn(5, model.decoder.embed_dim)
    with torch.no_grad():
        expected = model.decoder.output_projection(x)
        monkeypatch.setattr(onednn, "_ONEDNN_OK", False)
        plain = output_projection.OutputProjection(model.decoder.output_projection)
        assert torch.allclose(plain(x), expected, rtol=0, atol=1e-5)
        assert not plain._prepared()[1]
        model.double()
        wide = output_projection.OutputProjection(model.decoder.output_projection)
        monkeypatch.setattr(onednn, "_ONEDNN_OK", None)
        assert torch.allclose(wide(x.double()), model.decoder.output_projection(x.double()))
        assert not wide._prepared()[1]


def test_every_step_declares_the_engines_interface():
    """Each step has every member the engine reads (step/interface.py), so that the engine
    never probes a step for one; steps without a fast path say so with honest defaults."""
    from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
    from fairseq_pardec.decoding.step.interface import DecoderStep
    from fairseq_pardec.decoding.cuda.static import StaticBlockDecoder

    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=5)
    steps = [BlockDecoder(model.decoder), LeanBlockDecoder(model.decoder),
             FastBlockDecoder(model.decoder), StaticBlockDecoder(model.decoder)]
    for step in steps:
        assert isinstance(step, DecoderStep), type(step).__name__
    plain = steps[:2]
    for step in plain:
        assert not step.fast and step.kernels is None and step.scores_kernel() is None
    assert steps[2].fast and steps[2].kernels is not None
