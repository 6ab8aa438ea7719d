"""The verifier chooses its token as fairseq's beam-1 search does, down to float rounding."""

import numpy as np
import pytest
import torch
from fairseq.search import BeamSearch

from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.fairseq_rules import beam_one

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer


def _choose(lprobs, score):
    """The engine's choice over one (1, V) row after a float32 score, from what the host reads
    of it (its best token and best two values), as decisions.py makes it."""
    values, indices = lprobs.topk(2, dim=-1)
    first, second = values[0].tolist()
    return beam_one(lprobs, 0, int(indices[0, 0]), first, second, np.float32(score))[0]


def test_choice_is_beam_search_step_on_near_ties():
    """Two log-probs within a few 1e-6 under a cumulative score of -30: argmax and fairseq differ."""
    d = make_dictionary(20)
    search = BeamSearch(d)
    vocab = len(d)
    g = torch.Generator().manual_seed(1)
    differs = 0
    for trial in range(200):
        lprobs = torch.log_softmax(torch.randn(1, 1, vocab, generator=g), dim=-1)
        top = int(lprobs.argmax())
        other = (top + 1 + trial % (vocab - 1)) % vocab
        lprobs[0, 0, other] = lprobs[0, 0, top] - float(torch.rand(1, generator=g)) * 4e-6
        score = -30 - 5 * torch.rand(1, 1, 1, generator=g)
        _, fairseq_tokens, _ = search.step(1, lprobs.clone(), score)
        ours = _choose(lprobs.view(1, vocab), float(score))
        assert ours == int(fairseq_tokens[0, 0]), trial
        differs += int(fairseq_tokens[0, 0]) != top
    assert differs > 0  # the crafted ties did separate the two rules


# Smallest lead of the chosen state over the next one that twin_vocabulary_model accepts: kernel
# rounding moves the raw scores by ~1e-6 at most, so a lead above this picks the same state on
# every CPU, and from there every logit is a constant of the table.
STATE_LEAD = 1e-5


def twin_vocabulary_model(seed, states=4):
    """A tiny transformer whose every token has a twin scoring 2**-21 below it.

    Adding a cumulative score below -8 (float32 spacing >= 2**-20) rounds the twins to a tie or
    keeps them apart, so fairseq's choice differs from ``argmax`` at many steps. That holds only
    if both sides see the same logits to the bit, and they compute them with other kernels (a
    verified block and fairseq's one-token step multiply matrices of other shapes, which round
    differently on each CPU). So the logits are rows of a fixed table (multiples of 2**-4, with
    their twins), and the decoder's features only choose the row: the argmax of their first
    ``states`` output scores. Rounding can change that choice only where two of those scores are
    within the rounding (~1e-6); ``model.closest_lead()`` is the smallest lead seen, and the tests
    check that it exceeds ``STATE_LEAD``: then every CPU picks the same rows, and the test sees
    the choice rule alone.
    """
    d = make_dictionary(40)
    model = tiny_transformer(make_task(d), seed=seed)
    decoder = model.decoder
    project = decoder.output_layer
    first = torch.arange(d.nspecial, len(d) - 1, 2)
    g = torch.Generator().manual_seed(seed)
    # |logit| < 4: there float32 holds x - 2**-21 exactly for every multiple x of 2**-4
    table = torch.round(torch.randn(states, len(d), generator=g).clamp(-3.5, 3.5) * 16) / 16
    table[:, first + 1] = table[:, first] - 2.0**-21
    leads = []

    def twin_logits(features):
        scores = project(features)[..., :states]
        top2 = scores.topk(2, dim=-1).values
        leads.append(float((top2[..., 0] - top2[..., 1]).min()))
        return table[scores.argmax(-1)]

    decoder.output_layer = twin_logits
    model.closest_lead = lambda: min(leads)
    return model, d


@pytest.mark.parametrize("batch_size", [1, 8])
def test_engine_equals_fairseq_on_near_ties(batch_size):
    model, d = twin_vocabulary_model(seed=batch_size)
    sample = random_batch(d, [3 + (7 * i) % 30 for i in range(batch_size)], seed=5)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.5, max_len_b=20)
    for block_size in (None, 1):  # long copy drafts, and one-token drafts
        # the lean step: fairseq's own operations, so that the choice rule alone is tested (the
        # fast step hands these ties to fairseq: test_margin_guard_decides_twin_ties)
        generator = DraftVerifyGenerator(
            [model], d, CopyDrafter(d, d, block_size), ExactAcceptance(), max_len_a=1.5, max_len_b=20,
            fast=False,
        )
        got = generator.generate([model], sample)
        assert model.closest_lead() > STATE_LEAD  # both sides saw the same logits, on any CPU
        assert by_id(sample, got) == by_id(sample, expected)
        # bitwise: both sides add the same float32 log-probs (table rows, through the same
        # row-wise log-softmax) in the same order, one addition per step as fairseq rounds them
        for e, o in zip(expected, got):
            assert torch.equal(e[0]["score"], o[0]["score"])
            assert torch.equal(e[0]["positional_scores"], o[0]["positional_scores"])


def test_margin_guard_decides_twin_ties():
    """Every twin tie is closer than the fast step's margin: the guard hands each to fairseq's
    own search, and the tokens are fairseq's."""
    model, d = twin_vocabulary_model(seed=3)
    sample = random_batch(d, [4, 11, 7], seed=6)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.0, max_len_b=6)
    generator = DraftVerifyGenerator(
        [model], d, CopyDrafter(d, d), ExactAcceptance(), max_len_a=1.0, max_len_b=6
    )
    got = generator.generate([model], sample)
    assert model.closest_lead() > STATE_LEAD  # every CPU picks the same table rows
    assert by_id(sample, got) == by_id(sample, expected)
    # every token past the specials has a twin 2**-21 below or above it (a special one, say BOS,
    # can top the table's row without one, and then nothing is close)
    twinned = sum(int((h[0]["tokens"] >= d.nspecial).sum()) for h in got)
    assert twinned > 0
    assert generator.stats.close_calls >= twinned


def _exact_ties(bsz, vocab, device, seed):
    """(bsz, vocab) log-probs whose every row has 2-4 exactly equal maxima at random places,
    and cumulative scores that keep them equal (multiples of 1/4)."""
    g = torch.Generator().manual_seed(seed)
    lprobs = -4 - 4 * torch.rand(bsz, vocab, generator=g)
    for row in range(bsz):
        at = torch.randperm(vocab, generator=g)[: 2 + row % 3]
        lprobs[row, at] = -1.0
    score = -torch.randint(0, 40, (bsz,), generator=g).float() / 4
    return lprobs.to(device), score.to(device)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [40, 30000])
def test_exact_ties_choose_as_fairseq_whatever_the_rows(device, vocab):
    """Exact ties: fairseq's beam-1 step over its (bsz, V) batch picks what the engine picks for
    the same row, redone alone (batch sizes cross the CUDA kernels' row-count thresholds: 1,
    10, 20, 21, 200)."""
    d = make_dictionary(vocab - 4)
    search = BeamSearch(d)
    for bsz in (1, 10, 20, 21, 200):
        lprobs, score = _exact_ties(bsz, vocab, device, seed=bsz)
        _, fairseq_tokens, _ = search.step(1, lprobs.view(bsz, 1, vocab).clone(),
                                           score.view(bsz, 1, 1))
        want = fairseq_tokens[:, 0]
        alone = [_choose(lprobs[r: r + 1], float(score[r])) for r in range(bsz)]
        assert alone == want.tolist()
