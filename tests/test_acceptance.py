"""Relaxed acceptance rules read the engine's packed (N, V) log-probabilities exactly as they
read a (B, K, V) copy at the draft positions."""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.acceptance import (
    MinimumBlock,
    TopBetaTauAcceptance,
    TopKAcceptance,
)

RULES = [TopKAcceptance(2), TopKAcceptance(4), TopKAcceptance(50), TopBetaTauAcceptance(3, 1.5),
         TopBetaTauAcceptance(2, 0.2), MinimumBlock(TopKAcceptance(3), 2)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_packed_rows_decide_as_a_gathered_copy(rule):
    g = torch.Generator().manual_seed(0)
    b, k, v = 6, 5, 12
    # rounded scores: ties between the draft token and the k-th best are common
    packed = torch.log_softmax(torch.randint(0, 4, (b * (k + 2), v), generator=g).float(), -1)
    packed[3, 7] = float("-inf")
    positions = torch.randperm(packed.size(0), generator=g)[: b * k].view(b, k)
    draft = torch.randint(0, v, (b, k), generator=g)
    draft[0, 0] = 7
    positions[0, 0] = 3  # a draft token the verifier bars: never accepted by a relaxed rule
    valid = torch.rand(b, k, generator=g) < 0.9
    verifier = packed[positions].argmax(-1)
    gathered = rule.accept(draft, valid, packed[positions], verifier)
    assert torch.equal(rule.accept(draft, valid, packed, verifier, positions=positions), gathered)
    assert int(gathered[0]) == (1 if isinstance(rule, MinimumBlock) else 0)


@pytest.mark.parametrize("k", [2, 3, 12, 40])
def test_top_k_counts_the_tokens_scored_strictly_higher(k):
    """Blockwise decoding § 5.1's rule, counted out: fewer than k tokens score above the draft's."""
    g = torch.Generator().manual_seed(k)
    lprobs = torch.log_softmax(torch.randint(0, 3, (4, 6, 12), generator=g).float(), -1)
    draft = torch.randint(0, 12, (4, 6), generator=g)
    draft_lp = lprobs.gather(-1, draft.unsqueeze(-1))
    ok = (lprobs > draft_lp).sum(-1) < k
    expected = ok.long().cumprod(dim=1).sum(dim=1)
    valid = torch.ones(4, 6, dtype=torch.bool)
    assert torch.equal(TopKAcceptance(k).accept(draft, valid, lprobs, lprobs.argmax(-1)), expected)
