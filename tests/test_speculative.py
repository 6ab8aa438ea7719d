"""Speculative sampling draws whole outputs from fairseq's own sampling distribution.

Each case samples thousands of outputs of one short source with fairseq's ``SequenceGenerator``
(``Sampling`` search) and with a draft-and-verify generator, and compares the two empirical
distributions of whole output sequences with a chi-square test of homogeneity (bins with fewer
than 10 samples pooled). A case fails when the test rejects at the 0.1% level: for a correct
sampler that happens once in 1000 cases; the seeds are fixed, so the outcome is deterministic.
The negative control shows the test has the power to see a biased acceptance.
"""

from collections import Counter

import pytest
import torch
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import CopyDrafter, HeadsDrafter, NARDrafter
from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler

from helpers import collate, make_dictionary, make_task, tiny_transformer
from test_blockwise import blockwise_model
from test_gad import drafter_model

def drafting_copier(d):
    """iad's adaptive drafter without the CPU's price of a draft position: these cases test
    the acceptance of drafts, so every draft the caps allow is made."""
    drafter = CopyDrafter(d, d, adaptive=True)
    drafter.CPU_PRICES = None
    return drafter


MAX_LEN_B = 3  # outputs of at most 3 tokens, then EOS: a few hundred possible sequences
ALPHA = 1e-3


def chi_square_pvalue(a: Counter, b: Counter) -> float:
    n1, n2 = sum(a.values()), sum(b.values())
    bins, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= 10:
            bins.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    if sum(pooled):
        bins.append(tuple(pooled))
    stat = 0.0
    for x, y in bins:
        e1 = (x + y) * n1 / (n1 + n2)
        e2 = (x + y) * n2 / (n1 + n2)
        stat += (x - e1) ** 2 / e1 + (y - e2) ** 2 / e2
    df = max(1, len(bins) - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def peaked(model):
    """Random models are nearly uniform; sharpen the output layer a little."""
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(3.0)
    return model


def draw(generate, sample, n):
    counts = Counter()
    with torch.no_grad():
        while sum(counts.values()) < n:
            for hypos in generate(sample):
                counts[tuple(hypos[0]["tokens"].tolist())] += 1
    return counts


def fairseq_counts(model, d, sample, n, temperature, topk, topp):
    torch.manual_seed(12345)
    generator = SequenceGenerator(
        [model], d, beam_size=1, max_len_a=0, max_len_b=MAX_LEN_B, temperature=temperature,
        search_strategy=search.Sampling(d, topk, topp),
    )
    return draw(lambda s: generator.generate([model], s), sample, n)


def ours_counts(model, d, drafter, sample, n, temperature, topk, topp, seed=7):
    sampler = SpeculativeSampler(SamplingFilter(topk, topp), seed)
    generator = DraftVerifyGenerator(
        [model], d, drafter, ExactAcceptance(), max_len_a=0, max_len_b=MAX_LEN_B,
        temperature=temperature, sampler=sampler,
    )
    counts = draw(lambda s: generator.generate([model], s), sample, n)
    return counts, generator.stats


def one_source(d, batch):
    src = torch.tensor([d.index(w) for w in ["w1", "w2", "w3", "w1"]] + [d.eos()])
    return collate(d, [src] * batch)


SETTINGS = [(1.0, -1, -1.0), (0.7, 3, -1.0), (1.0, -1, 0.8)]


@pytest.fixture(scope="module")
def setup():
    d = make_dictionary(5)
    task = make_task(d)
    verifier = peaked(tiny_transformer(task, seed=31))
    reference = {}
    for temperature, topk, topp in SETTINGS:
        reference[(temperature, topk, topp)] = fairseq_counts(
            verifier, d, one_source(d, 64), 4000, temperature, topk, topp)
    return d, task, verifier, reference


@pytest.mark.parametrize("setting, batch", [(s, 16) for s in SETTINGS] + [(SETTINGS[1], 1)])
def test_iad_samples_fairseqs_distribution(setup, setting, batch):
    d, task, verifier, reference = setup
    n = 2000 if batch == 16 else 300
    counts, stats = ours_counts(verifier, d, drafting_copier(d), one_source(d, batch),
                                n, *setting)
    assert chi_square_pvalue(reference[setting], counts) > ALPHA
    assert stats.tokens_per_iteration > 1.0  # drafts were accepted: the path was exercised


@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[2]])
def test_gad_with_a_disagreeing_drafter_still_samples_p(setup, setting):
    """A random (untrained) drafter: q far from p; the output distribution is still p's."""
    d, task, verifier, reference = setup
    drafter = NARDrafter(drafter_model(task, k=3, seed=5), 3, d.eos(), d.pad())
    counts, _ = ours_counts(verifier, d, drafter, one_source(d, 16), 2000, *setting)
    assert chi_square_pvalue(reference[setting], counts) > ALPHA


@pytest.mark.parametrize("setting, layer",
                         [(SETTINGS[0], "paper"), (SETTINGS[1], "paper"), (SETTINGS[0], "recurrent")])
def test_blockwise_heads_sample_their_proposals(setting, layer):
    """Recurrent heads draw each proposal in turn and feed the drawn token to the next one."""
    d = make_dictionary(5)
    task = make_task(d)
    model = peaked(blockwise_model(task, heads=3, seed=4, proposal_layer=layer))
    if layer == "recurrent":  # W2 = 0 would make every head p_1; give the step something to do
        with torch.no_grad():
            torch.nn.init.normal_(model.decoder.proposal.fc2.weight, std=0.3)
    reference = fairseq_counts(model, d, one_source(d, 64), 4000, *setting)
    counts, _ = ours_counts(model, d, HeadsDrafter(model.decoder, d.pad(), 3), one_source(d, 16),
                            2000, *setting)
    assert chi_square_pvalue(reference, counts) > ALPHA


def test_negative_control_biased_acceptance_is_detected(setup, monkeypatch):
    """Accepting a copied token with probability min(1, 2 p(x)) instead of p(x) skews the
    outputs toward the source: the chi-square test must reject it."""
    d, task, verifier, reference = setup
    original = SpeculativeSampler.accept

    def biased(self, draft, draft_valid, p_draft, q_draft):
        return original(self, draft, draft_valid, (2 * p_draft).clamp(max=1.0), q_draft)

    monkeypatch.setattr(SpeculativeSampler, "accept", biased)
    counts, _ = ours_counts(verifier, d, drafting_copier(d), one_source(d, 64), 2000,
                            *SETTINGS[0])
    assert chi_square_pvalue(reference[SETTINGS[0]], counts) < ALPHA


def test_same_seed_same_output_and_filters():
    d = make_dictionary(5)
    task = make_task(d)
    model = peaked(tiny_transformer(task, seed=32))
    sample = one_source(d, 8)
    a, _ = ours_counts(model, d, CopyDrafter(d, d), sample, 200, 1.0, -1, -1.0, seed=3)
    b, _ = ours_counts(model, d, CopyDrafter(d, d), sample, 200, 1.0, -1, -1.0, seed=3)
    assert a == b
    # top-k keeps k tokens; top-p keeps the smallest set reaching p, as fairseq's _sample_topp
    lprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(SamplingFilter(2, -1).probs(lprobs), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(SamplingFilter(-1, 0.7).probs(lprobs), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(SamplingFilter(-1, 0.85).probs(lprobs), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
