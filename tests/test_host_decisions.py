"""Exact decisions made on the host (host_decisions.py) equal the tensor path's, number for
number: tokens, float32 scores, close calls and the engine's counts."""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import NoDrafter
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter
from fairseq_pardec.decoding.draft_verify.host_decisions import decides_on_host
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.acceptance import TopBetaTauAcceptance
from fairseq_pardec.decoding.step.native import native_kernel
from fairseq_pardec.decoding.step.products import MKL, NATIVE

from helpers import make_dictionary, make_task, random_batch, tiny_transformer
from test_beam_one import twin_vocabulary_model


def _both_paths(make_generator, model, sample, **generate_kwargs):
    """(host path's hypotheses and stats, tensor path's) of one generator setting."""
    results = []
    for on_host in (True, False):
        generator = make_generator()
        generator.host_decisions = on_host
        if hasattr(generator.block_decoder, "pin_kernel"):
            # the two generators must round alike: each would otherwise measure its own choice
            # of product kernels, which on a tiny model varies from one measurement to the next
            generator.block_decoder.pin_kernel(NATIVE if native_kernel() is not None else MKL)
        assert decides_on_host(generator, sample["net_input"]["src_tokens"],
                               generate_kwargs.get("prefix_tokens")) == on_host
        results.append((generator.generate([model], sample, **generate_kwargs),
                        vars(generator.stats).copy()))
    return results


def _assert_identical(host, tensor):
    """Bitwise, by construction: both paths run the same block step with the same (pinned)
    kernels on the same blocks, so every product has the same shapes and inputs; only where the
    decisions are made differs, and that is what must not change a bit."""
    (host_hypos, host_stats), (tensor_hypos, tensor_stats) = host, tensor
    for h, t in zip(host_hypos, tensor_hypos):
        assert torch.equal(h[0]["tokens"], t[0]["tokens"])
        assert torch.equal(h[0]["score"], t[0]["score"])
        assert torch.equal(h[0]["positional_scores"], t[0]["positional_scores"])
    for key in ("decoder_calls", "row_iterations", "positions_verified", "close_calls",
                "target_tokens"):
        assert host_stats[key] == tensor_stats[key], key


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("drafter", ["copy", "lookup"])
def test_host_decisions_equal_tensor_path(batch_size, fast, drafter):
    src = make_dictionary(50)
    tgt = make_dictionary(50)
    tgt.add_symbol("only_in_target")
    model = tiny_transformer(make_task(src, tgt), seed=60 + batch_size)
    sample = random_batch(src, [1 + (i * 13) % 45 for i in range(batch_size)], seed=batch_size)

    def make():
        draft = (CopyDrafter(src, tgt, adaptive=True) if drafter == "copy"
                 else LookupDrafter(src, tgt, None, adaptive=True))
        acceptance = ExactAcceptance() if drafter == "copy" else TopBetaTauAcceptance(1, 0.0)
        return DraftVerifyGenerator([model], tgt, draft, acceptance, max_len_a=1.2,
                                    max_len_b=10, fast=fast)

    _assert_identical(*_both_paths(make, model, sample))


@pytest.mark.parametrize("fast", [True, False])
def test_host_decisions_on_near_ties(fast):
    """The twin-token model ties fairseq's choice after adding the score at many steps: the
    host redoes those rows' ``topk`` as the tensor path does, and hands the same positions to the
    margin guard."""
    model, d = twin_vocabulary_model(seed=4)
    # with the fast step, or any step once a block was verified, every twin tie goes to
    # fairseq's own search: a small batch. Plain steps through the model's own output layer
    # round as fairseq does (no guard): there the tie rule alone decides, on a larger batch.
    sample = random_batch(d, [4, 11, 7] if fast else [3 + (7 * i) % 30 for i in range(8)], seed=5)

    def make():
        drafter = CopyDrafter(d, d) if fast else NoDrafter()
        return DraftVerifyGenerator([model], d, drafter, ExactAcceptance(),
                                    max_len_a=1.0 if fast else 1.5,
                                    max_len_b=6 if fast else 20, fast=fast)

    host, tensor = _both_paths(make, model, sample)
    _assert_identical(host, tensor)
    assert (host[1]["close_calls"] > 0) == fast


def test_host_decisions_every_position_close():
    """A margin that leaves every decision to fairseq: same close calls, same outputs."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=9)
    sample = random_batch(d, [5, 12, 9], seed=2)

    def make():
        return DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                    max_len_a=1.0, max_len_b=4, margin=1e3)

    host, tensor = _both_paths(make, model, sample)
    _assert_identical(host, tensor)
    # every token but an EOS forced at the length limit (the only candidate left)
    assert host[1]["close_calls"] >= host[1]["target_tokens"] - 3


def test_tensor_path_where_the_host_cannot_decide():
    """Forced prefixes, relaxed acceptance and sampling keep the tensor path."""
    d = make_dictionary(30)
    model = tiny_transformer(make_task(d), seed=1)
    src = random_batch(d, [4, 6], seed=1)["net_input"]["src_tokens"]
    exact = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance())
    assert decides_on_host(exact, src, None)
    assert not decides_on_host(exact, src, src[:, :2])
    relaxed = DraftVerifyGenerator([model], d, CopyDrafter(d, d), TopBetaTauAcceptance(2, 1.0))
    assert not decides_on_host(relaxed, src, None)
