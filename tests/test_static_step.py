"""The static decoder step (cuda/static.py) run eagerly on the CPU: the code CUDA records as
graphs (tests/test_cuda.py replays them) computes fairseq's decoder within the guard's margin,
and the engine on it decides as fairseq greedy does."""

import pytest
import torch

from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.decoding.draft_verify.drafters import CachedNARDrafter
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.step.block_decoder import BlockDecoder
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step_factory import block_decoder_for
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.decoding.cuda.static import (StaticBlockDecoder, batch_bucket, block_bucket,
                                                static_supported)

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer
from test_engine_lossless import RandomDrafter, lengths
from test_lean_decoder import _drive

ARCHITECTURES = [
    {},
    {"decoder_normalize_before": True, "encoder_normalize_before": True},
    {"decoder_learned_pos": True},
    {"no_scale_embedding": True, "layernorm_embedding": True},
]


def on_static_step(generator, model):
    """The engine on the static step (eager here), on fairseq's encoder output."""
    generator.block_decoder = StaticBlockDecoder(model.decoder)
    generator.encode = model.encoder.forward_torchscript
    return generator


def _log_probs(step, features):
    with torch.no_grad():
        return step.log_probs(features.reshape(-1, features.size(-1)))


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 33, 48, 64, 65)] == \
        [1, 2, 4, 8, 16, 16, 32, 48, 48, 64, 80]
    assert [block_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 32]


@pytest.mark.parametrize("overrides, ragged", [(a, True) for a in ARCHITECTURES] + [({}, False)])
def test_static_log_probs_within_the_guards_bound(overrides, ragged):
    """Through blocks, rollbacks, shrinking batches and bucket padding (8 rows, then 7 and 6 in
    a bucket of 8, blocks of 1-5 in buckets of 1-8), the static step's log-probabilities stay
    within a tenth of its declared margin of fairseq's module path."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=31, **overrides)
    sample = random_batch(d, [4, 9, 1, 15, 6, 3, 22, 2], seed=7)
    static = StaticBlockDecoder(model.decoder)
    module = BlockDecoder(model.decoder)
    worst = 0.0
    for x, y in zip(_drive(static, model, sample, seed=5, ragged=ragged),
                    _drive(module, model, sample, seed=5, ragged=ragged)):
        worst = max(worst, float((_log_probs(static, x) - _log_probs(module, y)).abs().max()))
    assert worst < static.margin / 10


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_static_features_equal_fairseqs_full_forward(batch_size):
    """A target fed in blocks of random lengths (1-9 positions, ragged sources) gives the
    features of fairseq's decoder over the whole target at once, within float32 rounding; the
    cache outgrows its first capacity (64 entries) on the way."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=50 + batch_size)
    sample = random_batch(d, lengths(batch_size), seed=batch_size)
    g = torch.Generator().manual_seed(batch_size)
    target = torch.randint(d.nspecial, len(d), (batch_size, 70), generator=g)
    target[:, 0] = d.eos()
    step = StaticBlockDecoder(model.decoder)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        want, _ = model.decoder.extract_features(target, encoder_out=encoder_out)
        cache, done, got = step.new_state(), 0, []
        while done < target.size(1):
            width = min(int(torch.randint(1, 10, (1,), generator=g)), target.size(1) - done)
            block_pad = torch.zeros(batch_size, width, dtype=torch.bool)
            got.append(step.forward_block(target[:, done: done + width],
                                          torch.full((batch_size,), done), block_pad,
                                          encoder_out, cache))
            done += width
    assert cache.slot.capacity == 128
    assert torch.allclose(torch.cat(got, dim=1), want, rtol=0, atol=2e-5)


def test_rejected_entries_are_overwritten():
    """After blocks whose drafts are rejected (a different number per row), the next block sees
    exactly the kept entries: its features equal those of a fresh cache fed the kept tokens."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=32)
    sample = random_batch(d, [7, 12, 3], seed=8)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, 40, (3, 3), generator=g)
    block = torch.randint(4, 40, (3, 5), generator=g)
    keep = torch.tensor([1, 4, 2])
    nxt = torch.randint(4, 40, (3, 2), generator=g)
    no_pad = torch.zeros(3, 5, dtype=torch.bool)
    with torch.no_grad():
        state = step.new_state()
        step.forward_block(prefix, torch.zeros(3, dtype=torch.long), no_pad[:, :3], enc, state)
        step.forward_block(block, torch.full((3,), 3), no_pad, enc, state)
        step.rollback(state, 5, keep)
        assert step.cache_length(state) == 7
        assert step.valid_mask(state).sum(1).tolist() == (3 + keep).tolist()
        # another rejection on top, then the block that must see only what was kept
        step.forward_block(torch.randint(4, 40, (3, 4), generator=g), 3 + keep,
                           no_pad[:, :4], enc, state)
        step.rollback(state, 4, torch.zeros(3, dtype=torch.long))
        after = step.forward_block(nxt, 3 + keep, no_pad[:, :2], enc, state)
        for r in range(3):  # each row alone, from a fresh cache
            fresh_state = step.new_state()
            enc_r = model.encoder.reorder_encoder_out(enc, torch.tensor([r]))
            kept = torch.cat([prefix[r], block[r, : int(keep[r])]]).unsqueeze(0)
            step.forward_block(kept, torch.zeros(1, dtype=torch.long),
                               torch.zeros_like(kept, dtype=torch.bool), enc_r, fresh_state)
            fresh = step.forward_block(nxt[r:r + 1], 3 + keep[r:r + 1], no_pad[:1, :2], enc_r,
                                       fresh_state)
            assert torch.allclose(after[r], fresh[0], rtol=0, atol=1e-5)


def test_bucket_padding_rows_do_not_change_real_rows():
    """Five rows run on a grid of eight: the three padding rows' buffers, poisoned with NaN, and
    the stale entries past each row's length, poisoned with large values, change nothing in the
    real rows, which equal each row decoded alone (a grid of one)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=36)
    sample = random_batch(d, [5, 11, 2, 8, 14], seed=9)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(4, 40, (5, 4), generator=g)
    second = torch.randint(4, 40, (5, 3), generator=g)
    with torch.no_grad():
        state = step.new_state()
        step.forward_block(first, torch.zeros(5, dtype=torch.long),
                           torch.zeros(5, 4, dtype=torch.bool), enc, state)
        step.rollback(state, 4, torch.tensor([4, 2, 3, 1, 4]))
        slot = state.slot
        assert slot.rows == 8
        for t in slot.keys + slot.values + slot.enc_keys + slot.enc_values:
            t[5:] = float("nan")
        lengths = slot.lengths[:5]
        for t in slot.keys + slot.values:
            stale = slot.key_index.view(1, 1, -1, 1) >= lengths.view(5, 1, 1, 1)
            t[:5].masked_fill_(stale, 1e4)
        kept = torch.tensor([4, 2, 3, 1, 4])
        together = step.forward_block(second, kept, torch.zeros(5, 3, dtype=torch.bool), enc, state)
        assert together.isfinite().all()
        for r in range(5):
            alone = step.new_state()
            enc_r = model.encoder.reorder_encoder_out(enc, torch.tensor([r]))
            step.forward_block(first[r:r + 1, : int(kept[r])], torch.zeros(1, dtype=torch.long),
                               torch.zeros(1, int(kept[r]), dtype=torch.bool), enc_r, alone)
            assert alone.slot.rows == 1
            out = step.forward_block(second[r:r + 1], kept[r:r + 1],
                                     torch.zeros(1, 3, dtype=torch.bool), enc_r, alone)
            assert torch.allclose(together[r], out[0], rtol=0, atol=1e-5)


def test_rows_leaving_move_to_a_smaller_bucket():
    """Rows finishing mid-bucket: 20 rows (a grid of 32) down to 9 (16), then 3 (4); the kept
    rows' caches move with them, and their features stay those of the module path."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=37)
    sample = random_batch(d, [3 + i % 13 for i in range(20)], seed=10)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    static, module = StaticBlockDecoder(model.decoder), BlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(2)
    states = [static.new_state(), module.new_state()]
    encs = [enc, enc]
    start = torch.zeros(20, dtype=torch.long)
    with torch.no_grad():
        for alive in (None, torch.arange(0, 20, 2)[:9], torch.tensor([1, 4, 8])):
            if alive is not None:
                start = start[alive]
                for i, step in enumerate((static, module)):
                    step.reorder(states[i], alive)
                    encs[i] = model.encoder.reorder_encoder_out(encs[i], alive)
            rows = start.numel()
            block = torch.randint(4, 40, (rows, 3), generator=g)
            pad = torch.zeros(rows, 3, dtype=torch.bool)
            x = static.forward_block(block, start, pad, encs[0], states[0])
            y = module.forward_block(block, start, pad, encs[1], states[1])
            assert torch.allclose(x, y, rtol=0, atol=1e-5)
            static.rollback(states[0], 3, torch.full((rows,), 3))
            module.rollback(states[1], 3, torch.full((rows,), 3))
            start = start + 3
            assert states[0].slot.rows == batch_bucket(rows)


def test_reserved_capacity():
    """A caller that knows the length limit reserves it before the first block: the batch's
    buffers are allocated once, at that size (rounded up to a power of two)."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=39)
    sample = random_batch(d, [6, 3], seed=15)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    state = step.new_state()
    step.reserve(state, 150)
    with torch.no_grad():
        step.forward_block(torch.full((2, 1), d.eos()), torch.zeros(2, dtype=torch.long),
                           torch.zeros(2, 1, dtype=torch.bool), enc, state)
    assert state.slot.capacity == 256 and state.slot.source == 16 and state.slot.rows == 2


def test_scores_in_the_call():
    """The log-probabilities computed inside the call are the output layer's, read once (a
    second read recomputes them); a caller that never reads them stops paying for them."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=38)
    sample = random_batch(d, [6, 3, 9], seed=11)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(3)
    block = torch.randint(4, 40, (3, 4), generator=g)
    pad = torch.tensor([[False] * 4, [False, False, True, True], [False] * 3 + [True]])
    layout = BlockLayout(pad)
    with torch.no_grad():
        state = step.new_state()
        features = step.forward_packed(block, torch.zeros(3, dtype=torch.long), layout, enc, state)
        assert features.size(0) == int((~pad).sum())
        in_call = step.log_probs(features, state=state)
        # not the call's any more: computed from the features
        again = step.log_probs(features, state=state)
        assert torch.allclose(in_call, again, rtol=0, atol=1e-6)
        step.rollback(state, 4, torch.zeros(3, dtype=torch.long))
        step.forward_packed(block, torch.zeros(3, dtype=torch.long), layout, enc, state)
        step.rollback(state, 4, torch.zeros(3, dtype=torch.long))
        assert step.scores_in_call
        features = step.forward_packed(block, torch.zeros(3, dtype=torch.long), layout, enc, state)
        assert not step.scores_in_call  # the previous call's were never read
        assert torch.allclose(step.log_probs(features, state=state), in_call, rtol=0, atol=1e-6)
        assert step.scores_in_call  # read again: computed in the calls again


def _iad(model, d, **kwargs):
    return on_static_step(
        DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(), **kwargs), model)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_static_engine_equals_fairseq(batch_size):
    """Copy, random and lookup drafters on the static step give fairseq greedy's output, with
    and without a length limit that cuts sentences off (at 64 rows, the copy drafter only)."""
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=40 + batch_size)
    sample = random_batch(d, [1 + (i * 13) % 45 for i in range(batch_size)], seed=batch_size)
    for limits in ({"max_len_a": 1.2, "max_len_b": 10}, {"max_len_a": 0.0, "max_len_b": 5}):
        expected = fairseq_greedy(model, d, sample, **limits)
        table = NgramTable([h[0]["tokens"][:-1].tolist() for h in expected], len(d), d.eos(),
                           d.eos())
        drafters = [CopyDrafter(d, d)]
        if limits["max_len_a"] and batch_size < 64:  # (64 rows: the copy drafter only, for time)
            drafters += [RandomDrafter(len(d), d.pad()), LookupDrafter(d, d, table, adaptive=True)]
        for drafter in drafters:
            generator = on_static_step(
                DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), **limits), model)
            got = generator.generate([model], sample)
            assert by_id(sample, got) == by_id(sample, expected), (drafter, limits)


def test_static_engine_with_prefixes():
    """Forced prefixes (fairseq's --prefix-size) through the static step: fairseq's output."""
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=44)
    sample = random_batch(d, [4, 17, 9, 1, 12, 6], seed=12)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(d.nspecial, len(d), (6, 3), generator=g)
    search = SequenceGenerator([model], d, beam_size=1, max_len_a=1.2, max_len_b=10)
    with torch.no_grad():
        expected = search.generate([model], sample, prefix_tokens=prefix)
    got = _iad(model, d, max_len_a=1.2, max_len_b=10).generate([model], sample,
                                                              prefix_tokens=prefix)
    assert by_id(sample, got) == by_id(sample, expected)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_trained_model_on_static_step_equals_fairseq(copy_model, batch_size):
    model, d, make_sample = copy_model
    sample = make_sample(batch_size, seed=400 + batch_size)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
    generator = _iad(model, d, max_len_a=1.0, max_len_b=10)
    got = generator.generate([model], sample)
    assert by_id(sample, got) == by_id(sample, expected)


def test_cached_drafter_on_the_static_step():
    """The block-causal drafter's step (explicit positions, its own block mask, mask slots
    dropped after each call, ragged new tokens) on the static step drafts what it drafts on
    the lean step, and GAD with it stays fairseq greedy."""
    from test_gad_cached import causal_drafter

    d = make_dictionary(40)
    task = make_task(d)
    verifier = tiny_transformer(task, seed=45)
    drafter_model = causal_drafter(task, k=4, seed=5)
    sample = random_batch(d, [3, 14, 8, 1, 11], seed=13)
    proposals = []
    for step_kind in (LeanBlockDecoder, StaticBlockDecoder):
        drafter = CachedNARDrafter(drafter_model, 4, d.eos(), d.pad())
        drafter.blocks = step_kind(drafter_model.decoder)
        seen, finish = [], drafter._finish

        def keep_logits(state, logits, cap, seen=seen, finish=finish):
            seen.append(logits.clone())
            return finish(state, logits, cap)

        drafter._finish = keep_logits
        generator = on_static_step(
            DraftVerifyGenerator([verifier], d, drafter, ExactAcceptance(), max_len_a=1.2,
                                 max_len_b=10), verifier)
        got = generator.generate([verifier], sample)
        assert by_id(sample, got) == by_id(sample, fairseq_greedy(verifier, d, sample,
                                                                  max_len_a=1.2, max_len_b=10))
        proposals.append(seen)
    lean, static = proposals
    assert len(lean) == len(static)
    for a, b in zip(lean, static):
        finite = a.isfinite()
        assert torch.equal(finite, b.isfinite())
        assert float((a - b)[finite].abs().max()) < 1e-4


def test_factory_picks_the_static_step_only_where_asked_or_on_cuda():
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=46)
    assert static_supported(model.decoder)
    assert isinstance(block_decoder_for(model.decoder, fast=True), FastBlockDecoder)  # CPU
    assert isinstance(block_decoder_for(model.decoder, static=True), StaticBlockDecoder)
    assert not isinstance(block_decoder_for(model.decoder, fast=True, static=False),
                          StaticBlockDecoder)
    normformer = tiny_transformer(make_task(d), scale_attn=True)
    assert not static_supported(normformer.decoder)
    assert not isinstance(block_decoder_for(normformer.decoder, static=True), StaticBlockDecoder)


def test_new_weights_reach_the_static_step():
    """Weights changed between two batches (here in place, as an optimizer does) are the ones
    the next batch decodes with: the fused copies are rebuilt."""
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=47)
    sample = random_batch(d, [5, 9], seed=14)
    enc = model.encoder.forward_torchscript(sample["net_input"])
    step = StaticBlockDecoder(model.decoder)
    block = torch.randint(4, 40, (2, 3), generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(2, 3, dtype=torch.bool)
    start = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        step.forward_block(block, start, pad, enc, step.new_state())
        model.decoder.layers[0].self_attn.q_proj.weight.mul_(1.5)
        got = step.forward_block(block, start, pad, enc, step.new_state())
        want = BlockDecoder(model.decoder).forward_block(block, start, pad, enc, {})
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_blockwise_merged_invocation_on_the_static_step(batch_size):
    """Blockwise decoding reads its heads' proposals from the verifier's features of the last
    kept position (merged invocation): on the static step it stays fairseq greedy."""
    from test_blockwise import blockwise_generator, blockwise_model

    d = make_dictionary(40)
    task = make_task(d)
    model = blockwise_model(task, heads=4, seed=batch_size)
    torch.nn.init.normal_(model.decoder.proposal.fc2.weight, std=0.5)
    sample = random_batch(d, [1 + (i * 11) % 30 for i in range(batch_size)], seed=batch_size)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
    generator = on_static_step(blockwise_generator(task, model), model)
    assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
    assert generator.stats.decoder_calls > 0


def test_speculative_sampling_on_the_static_step():
    """Speculative sampling on the static step draws fairseq's sampling distribution (the
    chi-square check of tests/test_speculative.py, top-k and temperature)."""
    from fairseq import search

    from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler
    from test_speculative import (ALPHA, MAX_LEN_B, chi_square_pvalue, draw, drafting_copier,
                                  one_source, peaked)

    d = make_dictionary(5)
    model = peaked(tiny_transformer(make_task(d), seed=31))
    temperature, topk, topp = 0.7, 3, -1.0
    torch.manual_seed(12345)
    reference = SequenceGenerator([model], d, beam_size=1, max_len_a=0, max_len_b=MAX_LEN_B,
                                  temperature=temperature,
                                  search_strategy=search.Sampling(d, topk, topp))
    want = draw(lambda s: reference.generate([model], s), one_source(d, 64), 800)
    generator = on_static_step(DraftVerifyGenerator(
        [model], d, drafting_copier(d), ExactAcceptance(), max_len_a=0, max_len_b=MAX_LEN_B,
        temperature=temperature, sampler=SpeculativeSampler(SamplingFilter(topk, topp), 7)),
        model)
    got = draw(lambda s: generator.generate([model], s), one_source(d, 16), 800)
    assert chi_square_pvalue(want, got) > ALPHA
    assert generator.stats.tokens_per_iteration > 1.0  # drafts were accepted
