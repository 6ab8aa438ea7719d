"""The block-causal GAD drafter: its cached incremental drafting equals its full forward, and
GAD with it (own encoder or the verifier's) stays identical to fairseq greedy."""

import copy

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import DraftView

from fairseq_pardec.decoding.registry import DraftVerifyGenerator
from fairseq_pardec.decoding.draft_verify.acceptance import ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import CachedNARDrafter
from fairseq_pardec.decoding.cpu.fast import FastBlockDecoder
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder
from fairseq_pardec.models.glat_drafter import GlatDrafterModel

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, pooled, tiny_args
from test_gad import train_drafter


# Trained block-causal drafter, 64 sentences: 2.34-3.61 tokens per iteration, untrained 1.02-1.25
# (kernel and seed variants as in test_gad.py; halfway would be 1.8).
CACHED_TPI = 1.5


def causal_drafter(task, k=4, seed=0, verifier=None, layers=2):
    """A block-causal drafter; with ``verifier`` it reads the verifier's (frozen) encoder and
    starts from its decoder, as ``--drafter-encoder verifier --init-drafter-decoder`` do."""
    torch.manual_seed(seed)
    args = tiny_args(encoder_layers=1, decoder_layers=layers)
    args.drafter_block_size, args.init_from_verifier = k, None
    args.drafter_attention = "block-causal"
    args.drafter_encoder = "own"
    model = GlatDrafterModel.build_model(args, task)
    if verifier is not None:
        state = {k: v for k, v in verifier.state_dict().items()
                 if k.startswith("encoder.") or k.startswith("decoder.")}
        model.load_state_dict(state, strict=False)
        model.args.drafter_encoder = "verifier"
        for param in model.encoder.parameters():
            param.requires_grad = False
    model.eval()
    return model


def gad(verifier, drafter, d, k=4, adaptive=False):
    return DraftVerifyGenerator(
        [verifier], d, CachedNARDrafter(drafter, k, d.eos(), d.pad(), adaptive=adaptive),
        ExactAcceptance(),
        max_len_a=1.0, max_len_b=10,
    )


@pytest.fixture(scope="module")
def trained_causal_drafter(copy_model):
    verifier, d, make_sample = copy_model
    task = make_task(d)
    model = causal_drafter(task, k=4, verifier=verifier)
    losses = train_drafter(model, task, make_sample, steps=150)
    return verifier, model, task, make_sample, losses


def test_block_causal_layout_and_mask():
    d = make_dictionary(30)  # the near-copy model's; no trained model needed
    model = causal_drafter(make_task(d), k=2)
    prefixes = torch.tensor([[2, 7, 8, 9], [2, 5, 1, 1]])
    tokens, slots = model.draft_inputs(prefixes, torch.tensor([2, 1]), 2)
    unk, pad = d.unk(), d.pad()
    assert tokens.tolist() == [[unk, unk, 2, 7, 8], [unk, unk, 2, 5, pad]]
    assert slots.tolist() == [[0, 1], [0, 1]]
    assert model.block_causal_steps(tokens).tolist() == [[3, 4, 0, 1, 2], [2, 3, 0, 1, -1]]
    mask = model.block_causal_mask(2, 5, torch.zeros(1)).isinf()
    assert not mask[:2].any()  # slots see everything
    assert mask[2:, :2].all()  # the prefix never sees a slot
    assert mask[2:, 2:].tolist() == [[False, True, True], [False, False, True], [False, False, False]]


@pytest.mark.trains
@pytest.mark.parametrize("step", ["fast", "lean"])
@pytest.mark.parametrize("reads_verifier", [False, True])
def test_cached_drafting_equals_full_forward(copy_model, reads_verifier, step):
    """Feed a random acceptance schedule through the cached drafter (rows finishing on the way)
    and compare every iteration's slot logits with the uncached forward over the whole prefix,
    on the fast step (a float32 drafter on the CPU runs it) and on the lean one (elsewhere)."""
    verifier, d, make_sample = copy_model
    model = causal_drafter(make_task(d), k=4, seed=3, verifier=verifier if reads_verifier else None)
    drafter = CachedNARDrafter(model, 4, d.eos(), d.pad())
    assert isinstance(drafter.blocks, FastBlockDecoder)
    if step == "lean":
        drafter.blocks = LeanBlockDecoder(model.decoder)
    sample = make_sample(6, seed=11)
    net = sample["net_input"]
    encoder_out = verifier.encoder.forward_torchscript(net)
    state = drafter.start(sample, encoder_out, d.eos())
    seen, finish = [], drafter._finish

    def keep_logits(state, logits, cap):  # the slot logits the draft is read from
        seen.append(logits)
        return finish(state, logits, cap)

    drafter._finish = keep_logits
    full_encoder = model.encode(net["src_tokens"], net["src_lengths"])
    g = torch.Generator().manual_seed(0)
    bsz, max_len = 6, 20
    tokens = torch.full((bsz, max_len + 2), d.pad())
    tokens[:, 0] = d.eos()
    tokens[:, 1:] = torch.randint(d.nspecial, len(d), (bsz, max_len + 1), generator=g)
    n_out = torch.zeros(bsz, dtype=torch.long)
    rows = torch.arange(bsz)
    for it in range(7):
        room = max_len - n_out
        drafter.propose(state, DraftView(rows.tolist(), n_out.tolist(), room.tolist(), tokens))
        got = seen[-1]
        inputs, slots = model.draft_inputs(tokens, n_out, 4)
        enc = model.encoder.reorder_encoder_out(full_encoder, rows)
        want = model.slot_logits(inputs, slots, enc)
        want[..., d.pad()] = float("-inf")  # as the drafter masks it
        finite = want.isfinite()
        assert torch.equal(finite, got.isfinite())  # the same masked (-inf) entries
        error = float((got - want)[finite].abs().max())
        assert error < 1e-4, (it, error)
        # The draft is read from the argmax. The two sides multiply matrices of other shapes
        # (the cached step against the whole prefix), so on a random model a near tie may break
        # either way; where the runner-up trails by more than twice the measured error, no
        # rounding within that error can reorder them, so the draft tokens must agree there.
        top2 = want.topk(2, dim=-1).values
        decided = top2[..., 0] - top2[..., 1] > 2 * error
        assert decided.float().mean() > 0.9  # the check covers the drafts, not a few positions
        assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])
        n_out = n_out + torch.randint(1, 4, (rows.numel(),), generator=g)
        if it == 3:  # two sentences finish: the batch shrinks
            keep = torch.tensor([0, 2, 3, 5])
            rows, tokens, n_out = rows[keep], tokens[keep], n_out[keep]


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_cached_gad_equals_greedy_random_drafter(copy_model, batch_size):
    verifier, d, make_sample = copy_model
    model = causal_drafter(make_task(d), k=5, seed=batch_size)
    sample = make_sample(batch_size, seed=70 + batch_size)
    expected = fairseq_greedy(verifier, d, sample, max_len_a=1.0, max_len_b=10)
    assert by_id(sample, expected) == by_id(sample, gad(verifier, model, d, k=5).generate([verifier], sample))


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_cached_gad_equals_greedy_trained_drafter(trained_causal_drafter, batch_size):
    verifier, model, task, make_sample, losses = trained_causal_drafter
    d = task.target_dictionary
    samples = pooled(make_sample, batch_size, first_seed=batch_size)
    expected = [fairseq_greedy(verifier, d, s, max_len_a=1.0, max_len_b=10) for s in samples]
    for adaptive in (False, True):  # fixed k, or each row's cap following its acceptance
        generator = gad(verifier, model, d, adaptive=adaptive)
        for sample, want in zip(samples, expected):
            assert by_id(sample, want) == by_id(sample, generator.generate([verifier], sample))
        # the drafts get accepted (over 64 sentences)
        assert generator.stats.tokens_per_iteration > CACHED_TPI


@pytest.mark.trains
def test_frozen_verifier_encoder_is_not_trained(trained_causal_drafter):
    verifier, model, *_ = trained_causal_drafter
    theirs = verifier.encoder.state_dict()
    # bitwise: the drafter's encoder is a copy of the verifier's, and training must not touch it
    assert all(torch.equal(v, theirs[k]) for k, v in model.encoder.state_dict().items())


@pytest.mark.trains
def test_drafter_of_another_verifier_is_refused(trained_causal_drafter):
    from fairseq_pardec.decoding.draft_verify.drafters.loading import _check_same_encoder

    verifier, model, *_ = trained_causal_drafter
    _check_same_encoder("d.pt", model, verifier)  # its own verifier: fine
    other = copy.deepcopy(verifier)
    with torch.no_grad():
        next(other.encoder.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="another verifier's encoder"):
        _check_same_encoder("d.pt", model, other)


@pytest.mark.trains
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_shortlisted_drafts_stay_lossless(trained_causal_drafter, batch_size):
    """--draft-vocab: the drafter scores a shortlist only; outputs stay fairseq greedy's and
    no draft token is outside the shortlist."""
    from fairseq_pardec.decoding.step.output_projection import frequent_types

    verifier, model, task, make_sample, _ = trained_causal_drafter
    d = task.target_dictionary
    sample = make_sample(batch_size, seed=90 + batch_size)
    expected = fairseq_greedy(verifier, d, sample, max_len_a=1.0, max_len_b=10)
    drafter = CachedNARDrafter(model, 4, d.eos(), d.pad(), adaptive=True, dictionary=d,
                               draft_vocab=12)
    drafted = []
    propose = drafter.propose

    def recording(state, view):
        drafts = propose(state, view)
        drafted.extend(t for draft in drafts for t in draft)
        return drafts

    drafter.propose = recording
    generator = DraftVerifyGenerator([verifier], d, drafter, ExactAcceptance(),
                                     max_len_a=1.0, max_len_b=10)
    assert by_id(sample, expected) == by_id(sample, generator.generate([verifier], sample))
    assert drafted and set(drafted) <= set(frequent_types(d, 12).tolist())


def test_frequent_types_follow_dictionary_counts():
    from fairseq.data import Dictionary
    from fairseq_pardec.decoding.step.output_projection import frequent_types

    d = Dictionary()
    for word, count in (("rare", 1), ("common", 50), ("mid", 7), ("tie1", 3), ("tie2", 3)):
        d.add_symbol(word, n=count)
    d.finalize(padding_factor=1)
    ids = frequent_types(d, 4).tolist()
    assert ids[0] == d.eos()  # EOS always, first
    assert [d[i] for i in ids[1:]] == ["common", "mid", "tie1"]
    assert d.pad() not in frequent_types(d, 100).tolist()
