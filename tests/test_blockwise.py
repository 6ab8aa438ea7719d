"""Blockwise parallel decoding: model, criterion, generator, acceptance rules."""

import argparse
import copy

import pytest
import torch

from fairseq_pardec.criterions.blockwise_cross_entropy import BlockwiseCrossEntropyCriterion
from fairseq_pardec.decoding.registry import GENERATORS
from fairseq_pardec.decoding.draft_verify.acceptance import (
    DistanceAcceptance,
    ExactAcceptance,
    MinimumBlock,
    TopKAcceptance,
)
from fairseq_pardec.decoding.cpu.layer_stack import NativeLayerStack
from fairseq_pardec.models.blockwise_transformer import BlockwiseTransformerModel

from helpers import (by_id, collate, fairseq_greedy, make_dictionary, make_task, pooled, random_batch,
                     tiny_args)


# Thresholds on what a model trained in the test reaches sit about halfway between the
# untrained baseline and the lowest value measured over CPU kernel variants (ATen AVX2 and
# default kernels, MKL code paths, MKL_CBWR, 1 and 2 threads) and seven training seeds: a
# training that rounds differently follows another trajectory, much as another seed does.
# Identity p_1, trained heads, 64 sentences: 1.35-1.53 tokens per iteration, untrained heads
# 1.08-1.17.
IDENTITY_TPI = 1.25
# Heads trained on frozen features, held-out blockwise loss against the untrained heads': 0.53-0.63.
HEADS_LOSS_RATIO = 0.8


def blockwise_model(task, heads=4, identity=True, seed=0, base=None, **overrides):
    torch.manual_seed(seed)
    args = tiny_args(**overrides)
    args.proposal_heads, args.identity_first_head = heads, identity
    args.freeze_base, args.init_from_transformer = False, None
    model = BlockwiseTransformerModel.build_model(args, task)
    if base is not None:
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("decoder.proposal.") for k in missing)
    model.eval()
    return model


def blockwise_generator(task, model, **cfg):
    for key, value in dict(dict(block_size=None, blockwise_topk=1, blockwise_distance=None,
                                min_block_size=1, draft_vocab=None), **cfg).items():
        setattr(task.cfg, key, value)
    args = argparse.Namespace(beam=1, max_len_a=1.0, max_len_b=10, min_len=1, lenpen=1.0,
                              unkpen=0.0, temperature=1.0)
    return GENERATORS["blockwise"](task, [model], args)


@pytest.fixture(scope="module")
def trained_heads(copy_model):
    """A blockwise model (identity p_1) initialised from the near-copy model and fine-tuned."""
    base, d, make_sample = copy_model
    task = make_task(d)
    model = blockwise_model(task, heads=4, base=base, encoder_layers=1, decoder_layers=2)
    fit_heads(model, task, make_sample, steps=250, lr=2e-3, first_seed=1000)
    return base, model, task, make_sample


def fit_heads(model, task, make_sample, steps, lr, first_seed):
    """Train the parameters that require gradients with the blockwise criterion (mean of heads)."""
    criterion = BlockwiseCrossEntropyCriterion(task, False, 0.0, head_sampling="mean")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        loss, _, _ = criterion(model, make_sample(32, seed=first_seed + step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.mark.trains
@pytest.mark.parametrize("block_size", [None, 4])  # adaptive per-row caps; the paper's fixed k
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_identity_p1_exact_equals_base_greedy(trained_heads, batch_size, block_size):
    _, model, task, make_sample = trained_heads
    generator = blockwise_generator(task, model, block_size=block_size)
    assert generator.drafter.adaptive == (block_size is None)
    for sample in pooled(make_sample, batch_size, first_seed=batch_size):
        # the base model is the blockwise model's p_1 (identity head): fairseq greedy of it
        expected = fairseq_greedy(model, task.target_dictionary, sample, max_len_a=1.0, max_len_b=10)
        got = generator.generate([model], sample)
        assert by_id(sample, expected) == by_id(sample, got)
    # the heads propose useful tokens; over 64 sentences
    assert generator.stats.tokens_per_iteration > IDENTITY_TPI


@pytest.mark.parametrize("block_size", [None, 5])
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_random_heads_are_still_lossless(batch_size, block_size):
    d = make_dictionary(40)
    task = make_task(d)
    model = blockwise_model(task, heads=5, seed=batch_size)
    torch.nn.init.normal_(model.decoder.proposal.fc2.weight, std=0.5)  # proposals: noise
    sample = random_batch(d, [1 + (i * 11) % 30 for i in range(batch_size)], seed=batch_size)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=10)
    got = blockwise_generator(task, model, block_size=block_size).generate([model], sample)
    assert by_id(sample, expected) == by_id(sample, got)


@pytest.mark.parametrize("identity", [True, False])
def test_proposal_features_are_heads_two_to_n(identity):
    """The drafter reads heads 2..n+1 alone (no p_1 when it is the identity): the same
    logits as the full heads' slice."""
    d = make_dictionary(30)
    task = make_task(d)
    model = blockwise_model(task, heads=5, identity=identity)
    torch.nn.init.normal_(model.decoder.proposal.fc2.weight, std=0.5)
    x = torch.randn(3, model.decoder.output_embed_dim)
    with torch.no_grad():
        full = model.decoder.head_logits(x)
        later = model.decoder.base_logits(model.decoder.proposal_features(x, 3))
    assert torch.allclose(later, full[:, 1:4], atol=1e-5)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8])
def test_shortlisted_heads_stay_lossless(trained_heads, batch_size):
    """--draft-vocab: the heads score a shortlist; the output is still base greedy's."""
    _, model, task, make_sample = trained_heads
    sample = make_sample(batch_size, seed=20 + batch_size)
    expected = fairseq_greedy(model, task.target_dictionary, sample, max_len_a=1.0, max_len_b=10)
    generator = blockwise_generator(task, model, draft_vocab=10)
    assert by_id(sample, expected) == by_id(sample, generator.generate([model], sample))


@pytest.mark.trains
def test_adaptive_caps_follow_acceptance(trained_heads):
    """Rows whose proposals are rejected draft 1 head's token; the cap grows back with
    acceptance and never passes the model's heads."""
    from fairseq_pardec.decoding.draft_verify.drafters import (DraftOutcome, DraftView,
                                                              HeadsDrafter)

    _, model, task, make_sample = trained_heads
    drafter = HeadsDrafter(model.decoder, task.target_dictionary.pad(), 4, adaptive=True)
    sample = make_sample(2, seed=7)
    state = drafter.start(sample, None, task.target_dictionary.eos())
    rows = [0, 1]
    features = torch.randn(2, model.decoder.output_embed_dim)
    newest = torch.full((2,), task.target_dictionary.eos())

    def outcome(accepted):
        return DraftOutcome(rows, accepted, features=features, newest=newest)

    # first call: no draft
    drafter.observe(state, outcome([0, 0]))
    assert state.next_len == [3, 3]
    for _ in range(4):  # row 0 accepts nothing, row 1 everything
        drafts = drafter.propose(state, DraftView(rows, [0, 0], [10, 10], None))
        drafter.observe(state, outcome([0, len(drafts[1])]))
    assert state.next_len == [1, 3]


@pytest.mark.trains
def test_merged_invocation_one_model_call_per_iteration(trained_heads, monkeypatch):
    _, model, task, make_sample = trained_heads
    calls = []
    # the feed-forward's layer norm runs once per decoder pass in every step that runs the
    # layers as torch operations (fairseq's modules, the lean step and the fast step, which
    # multiplies with fc1's weights directly); the fast step's native layer stack runs them all
    # in one call
    handle = model.decoder.layers[0].final_layer_norm.register_forward_hook(
        lambda *a: calls.append(1))
    run_stack = NativeLayerStack.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run_stack(self, *args, **kwargs)

    monkeypatch.setattr(NativeLayerStack, "__call__", counted)
    try:
        for seed in range(5):
            generator = blockwise_generator(task, model)
            generator.generate([model], make_sample(1, seed=seed))
            stats = generator.stats
            # batch 1: model calls = iterations; the first one (empty draft, as the paper's
            # initial prediction call) also yields p_1's first token, then one call per verify
            assert len(calls) == stats.decoder_calls == stats.row_iterations
            calls.clear()
    finally:
        handle.remove()


@pytest.mark.trains
def test_p1_is_fairseq_output_and_heads_shift_targets(trained_heads):
    _, model, task, make_sample = trained_heads
    sample = make_sample(4, seed=3)
    with torch.no_grad():
        features, _ = model(**sample["net_input"], features_only=True)
        heads = model.decoder.head_logits(features)
        out, _ = model(**sample["net_input"])
    assert heads.shape[-2] == 4
    assert torch.allclose(heads[..., 0, :], out, atol=1e-5)


def crafted(lp_rows, draft):
    lprobs = torch.log_softmax(torch.tensor(lp_rows, dtype=torch.float), -1).unsqueeze(0)
    draft = torch.tensor([draft])
    return draft, torch.ones_like(draft, dtype=torch.bool), lprobs, lprobs.argmax(-1)


def test_topk_rule():
    # position 0: draft token 2 is 2nd best; position 1: token 0 is 3rd best
    draft, valid, lprobs, verifier = crafted([[3.0, 1.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]], [2, 0])
    assert ExactAcceptance().accept(draft, valid, lprobs, verifier).tolist() == [0]
    assert TopKAcceptance(1).accept(draft, valid, lprobs, verifier).tolist() == [0]
    assert TopKAcceptance(2).accept(draft, valid, lprobs, verifier).tolist() == [1]
    assert TopKAcceptance(3).accept(draft, valid, lprobs, verifier).tolist() == [2]
    assert TopKAcceptance(3).accept(draft, torch.tensor([[True, False]]), lprobs, verifier).tolist() == [1]


def ordinal_dictionary(n=10):
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(n):
        d.add_symbol(str(i))
    return d


def test_distance_rule_and_refusal():
    d = ordinal_dictionary()
    v = lambda s: d.index(s)  # noqa: E731
    size = len(d)
    rows = []
    for best in ("5", "5", "5"):
        row = [0.0] * size
        row[v(best)] = 5.0
        rows.append(row)
    draft, valid, lprobs, verifier = crafted(rows, [v("6"), v("3"), v("5")])
    assert DistanceAcceptance(d, 1).accept(draft, valid, lprobs, verifier).tolist() == [1]
    assert DistanceAcceptance(d, 2).accept(draft, valid, lprobs, verifier).tolist() == [3]
    assert DistanceAcceptance(d, 0).accept(draft, valid, lprobs, verifier).tolist() == [0]
    with pytest.raises(ValueError, match="ordinal vocabulary"):
        DistanceAcceptance(make_dictionary(5), 1)
    with pytest.raises(ValueError, match=">= 0"):
        DistanceAcceptance(d, -1)


def test_min_block_rule():
    draft, valid, lprobs, verifier = crafted([[3.0, 1.0, 2.0], [1.0, 3.0, 2.0], [0, 0, 1.0]], [2, 2, 2])
    assert ExactAcceptance().accept(draft, valid, lprobs, verifier).tolist() == [0]
    assert MinimumBlock(ExactAcceptance(), 3).accept(draft, valid, lprobs, verifier).tolist() == [2]
    short = torch.tensor([[True, False, False]])
    assert MinimumBlock(ExactAcceptance(), 3).accept(draft, short, lprobs, verifier).tolist() == [1]
    assert MinimumBlock(ExactAcceptance(), 1).lossless


@pytest.mark.trains
def test_bad_configurations(trained_heads, copy_model):
    base, model, task, _ = trained_heads
    with pytest.raises(ValueError, match="no(ne)?|proposal heads"):
        blockwise_generator(task, base)
    with pytest.raises(ValueError, match="larger than the model's --proposal-heads 4"):
        blockwise_generator(task, model, block_size=5)
    with pytest.raises(ValueError, match="--min-block-size 4 is larger than the block size 3"):
        blockwise_generator(task, model, block_size=3, min_block_size=4)
    with pytest.raises(ValueError, match="ordinal"):
        blockwise_generator(task, model, blockwise_distance=1.0)


def test_position_head_sampling_labels_and_gradients():
    d = make_dictionary(30)
    task = make_task(d)
    criterion = BlockwiseCrossEntropyCriterion(task, False, 0.0, head_sampling="position")
    pad = d.pad()
    target = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, pad, pad]])
    # head h's output at every position is the constant h: the picked value names the head
    outputs = torch.arange(4.0).view(1, 1, 4, 1).expand(2, 5, 4, 3).clone()
    torch.manual_seed(0)
    (picked,), (labels,) = criterion.one_head_per_position(outputs, target, heads=[1, 2, 3])
    padded = torch.cat([target, torch.full((2, 3), pad)], 1)
    for b in range(2):
        for t in range(5):
            head = int(picked[b, t, 0])
            assert head in (1, 2, 3)
            expect = pad if target[b, t] == pad else int(padded[b, t + head])
            assert int(labels[b, t]) == expect

    # one training step: every learned head of the proposal layer receives a gradient
    model = blockwise_model(task, heads=4, identity=True)
    model.train()
    with torch.no_grad():  # zero-initialised fc2 would pass no gradient to fc1
        model.decoder.proposal.fc2.weight.normal_(std=0.1)
    sample = random_batch(d, [6, 5, 7, 4] * 4, seed=3)
    sample["target"] = sample["net_input"]["src_tokens"].flip(1)  # any non-pad tokens
    sample["target"] = torch.where(sample["target"].eq(pad), torch.full_like(sample["target"], 2), sample["target"])
    sample["net_input"]["prev_output_tokens"] = sample["target"]
    loss, size, _ = criterion(model, sample)
    loss.backward()
    grad = model.decoder.proposal.fc2.weight.grad.view(3, -1, model.decoder.proposal.fc2.weight.size(1))
    assert size > 0 and all(float(g.abs().sum()) > 0 for g in grad)


@pytest.fixture(scope="module")
def trained_light_heads(copy_model):
    """Light heads (one small residual block each) on a frozen copy of the near-copy model."""
    return frozen_base_heads(copy_model, "light", hidden=16, first_seed=3000)


def frozen_base_heads(copy_model, layer, hidden, first_seed):
    """(base, model, untrained, task, make_sample): ``layer`` heads trained on a frozen copy of
    the near-copy model, and the same model before that training (every head starts as p_1)."""
    base, d, make_sample = copy_model
    task = make_task(d)
    model = blockwise_model(task, heads=4, base=base, encoder_layers=1, decoder_layers=2,
                            proposal_layer=layer, proposal_hidden_dim=hidden)
    untrained = copy.deepcopy(model)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith("decoder.proposal.")
    fit_heads(model, task, make_sample, steps=200, lr=3e-3, first_seed=first_seed)
    return base, model, untrained, task, make_sample


def assert_heads_learned(task, model, untrained, sample, generator):
    """Frozen features limit what the heads learn: their drafts gain a few hundredths of a token
    per iteration over the same heads untrained (every head p_1), less than that gain moves
    between CPUs. What training did is clear in the criterion's loss on held-out sentences."""
    criterion = BlockwiseCrossEntropyCriterion(task, False, 0.0, head_sampling="mean")
    with torch.no_grad():
        trained, before = float(criterion(model, sample)[0]), float(criterion(untrained, sample)[0])
    assert trained < HEADS_LOSS_RATIO * before, (trained, before)
    assert generator.stats.tokens_per_iteration > 1.0  # drafts were accepted: the path was exercised


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_light_heads_frozen_base_equal_base_greedy(trained_light_heads, batch_size):
    base, model, untrained, task, make_sample = trained_light_heads
    sample = make_sample(batch_size, seed=40 + batch_size)
    expected = fairseq_greedy(base, task.target_dictionary, sample, max_len_a=1.0, max_len_b=10)
    generator = blockwise_generator(task, model)
    assert by_id(sample, expected) == by_id(sample, generator.generate([model], sample))
    if batch_size == 64:
        assert_heads_learned(task, model, untrained, sample, generator)


def test_light_heads_shapes_and_identity_start():
    from fairseq_pardec.models.blockwise_transformer import LightProposalLayer

    layer = LightProposalLayer(8, 3, heads=4, identity_first_head=True)
    x = torch.randn(2, 5, 8)
    out = layer(x)
    assert out.shape == (2, 5, 4, 8)
    # W2 = 0: every head is p_1. Exact by construction: each residual is a sum of products with
    # zero (+0.0, as the hidden units are >= 0 after the ReLU) plus a zero bias, and x + 0 == x.
    assert torch.equal(out, x.unsqueeze(-2).expand_as(out))
    torch.nn.init.normal_(layer.fc2_weight)
    # a prefix of the heads: the two calls multiply matrices of other shapes (2 heads' rows of W1
    # against 3), which MKL and oneDNN block differently on each CPU, so the products agree to
    # float32 rounding only (terms of size ~10 here: 1e-5 is ~100 units in the last place)
    torch.testing.assert_close(layer(x, heads=2), layer(x)[..., :2, :], rtol=1e-5, atol=1e-5)
    assert layer.fc1.weight.numel() + layer.fc2_weight.numel() == 2 * 3 * 8 * 3


@pytest.fixture(scope="module")
def trained_recurrent_heads(copy_model):
    """Recurrent heads (one step shared by all heads, each reading the token before it) on a
    frozen copy of the near-copy model."""
    return frozen_base_heads(copy_model, "recurrent", hidden=32, first_seed=5000)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size, block_size, draft_vocab",
                         [(1, None, None), (8, 4, None), (8, None, 10), (64, None, None)])
def test_recurrent_heads_frozen_base_equal_base_greedy(trained_recurrent_heads, batch_size,
                                                      block_size, draft_vocab):
    base, model, untrained, task, make_sample = trained_recurrent_heads
    sample = make_sample(batch_size, seed=60 + batch_size)
    expected = fairseq_greedy(base, task.target_dictionary, sample, max_len_a=1.0, max_len_b=10)
    generator = blockwise_generator(task, model, block_size=block_size, draft_vocab=draft_vocab)
    assert by_id(sample, expected) == by_id(sample, generator.generate([model], sample))
    if batch_size == 64:
        assert_heads_learned(task, model, untrained, sample, generator)


def test_recurrent_heads_read_the_tokens_before_them():
    """Head j + 1 is the step applied to head j's state and token; W2 = 0 starts every head as
    p_1; the decoder embeds the tokens with its own embedding."""
    from fairseq_pardec.models.blockwise_transformer import RecurrentProposalLayer

    layer = RecurrentProposalLayer(8, 6, 5, heads=4)
    x, emb = torch.randn(2, 3, 8), torch.randn(2, 3, 3, 6)
    # W2 = 0 and b2 = 0: each step adds exact zeros to its state, so every head is x to the bit
    assert torch.equal(layer.unroll(x, emb), x.unsqueeze(-2).expand(2, 3, 3, 8))
    torch.nn.init.normal_(layer.fc2.weight)
    out = layer.unroll(x, emb)
    second = layer.step(layer.step(x, emb[..., 0, :]), emb[..., 1, :])
    assert torch.allclose(out[..., 1, :], second)
    assert torch.equal(layer(x, heads=1), x.unsqueeze(-2))  # p_1 is x itself: no arithmetic
    with pytest.raises(Exception, match="tokens"):
        layer(x)  # later heads need their tokens


def test_recurrent_criterion_feeds_target_tokens():
    """At position t, head j + 1 reads target tokens t .. t + j - 1 (shifted, pad past the end)."""
    d = make_dictionary(6)
    task = make_task(d)
    model = blockwise_model(task, heads=3, proposal_layer="recurrent", proposal_hidden_dim=8)
    torch.nn.init.normal_(model.decoder.proposal.fc2.weight)
    criterion = BlockwiseCrossEntropyCriterion(task, False, 0.0, head_sampling="mean")
    g = torch.Generator().manual_seed(1)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (n,), generator=g),
                          torch.tensor([d.eos()])]) for n in (5, 3)]
    sample = collate(d, sources, targets=[s.flip(0).roll(-1) for s in sources])
    with torch.no_grad():
        features, _ = model(**sample["net_input"], features_only=True)
        outputs = criterion.head_outputs(model.decoder, features, sample["target"], 3)
        target = sample["target"]
        t = 1
        first = model.decoder.proposal_step(features[:, t], target[:, t])
        second = model.decoder.proposal_step(first, target[:, t + 1])
    assert outputs.shape[:3] == target.shape + (3,)
    assert torch.equal(outputs[:, t, 0], features[:, t])  # head 1 is the features, copied
    assert torch.allclose(outputs[:, t, 1], first, atol=1e-6)
    assert torch.allclose(outputs[:, t, 2], second, atol=1e-6)


def test_recurrent_heads_need_identity_first_head():
    d = make_dictionary(6)
    with pytest.raises(Exception, match="--identity-first-head"):
        blockwise_model(make_task(d), heads=3, identity=False, proposal_layer="recurrent")
