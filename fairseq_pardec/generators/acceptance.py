"""Acceptance rules: which prefix of a draft the verifier accepts.

Every rule sees, for each row, the draft tokens, which of them are real (ragged drafts are
padded), the verifier's (masked) log-probabilities at each draft position and the verifier's own
choice there. It returns the number of leading draft tokens accepted. The engine then appends the
verifier's own token at the first rejected position, so every iteration gains at least one token.

``ExactAcceptance`` accepts a draft token only when it *is* the verifier's greedy choice: the
output is then identical to greedy decoding (lossless). Relaxed rules (GAD++'s top-beta within
tau, blockwise decoding's top-k / distance / minimum block) implement :meth:`token_ok` or
override :meth:`accept` and declare ``lossless = False``.
"""

import torch
from torch import Tensor
from ..errors import UsageError


class AcceptanceRule:
    lossless = False
    # False when the rule decides from the draft and the verifier's tokens alone: the engine
    # then does not gather the (B, K, V) log-probabilities at the draft positions for it.
    reads_log_probs = True

    def token_ok(self, draft: Tensor, lprobs: Tensor, verifier_tokens: Tensor) -> Tensor:
        """(B, K) bool: may each draft token stand in for the verifier's choice?"""
        raise NotImplementedError

    def accept(
        self, draft: Tensor, draft_valid: Tensor, lprobs: Tensor, verifier_tokens: Tensor
    ) -> Tensor:
        """Number of leading draft tokens accepted per row.

        Args:
            draft: (B, K) draft tokens, padded.
            draft_valid: (B, K) True for real draft tokens.
            lprobs: (B, K, V) verifier log-probabilities at the K draft positions (None for a
                rule whose ``reads_log_probs`` is False).
            verifier_tokens: (B, K) the verifier's own choice at those positions.
        """
        if draft.size(1) == 0:
            return draft.new_zeros(draft.size(0))
        ok = self.token_ok(draft, lprobs, verifier_tokens) & draft_valid
        # Length of the run of True from the left.
        return ok.long().cumprod(dim=1).sum(dim=1)


class ExactAcceptance(AcceptanceRule):
    """Accept while the draft equals the verifier's greedy token (lossless)."""

    lossless = True
    reads_log_probs = False

    def token_ok(self, draft, lprobs, verifier_tokens):
        return draft.eq(verifier_tokens)


class TopKAcceptance(AcceptanceRule):
    """Blockwise decoding § 5.1: accept a draft token within the verifier's top-k."""

    def __init__(self, k: int):
        if k < 1:
            raise UsageError("--blockwise-topk must be >= 1 (got %d)" % k)
        self.k = k
        self.lossless = k == 1
        self.reads_log_probs = k != 1

    def token_ok(self, draft, lprobs, verifier_tokens):
        if self.k == 1:
            return draft.eq(verifier_tokens)
        draft_lp = lprobs.gather(-1, draft.unsqueeze(-1))
        better = (lprobs > draft_lp).sum(dim=-1)
        return (better < self.k) & torch.isfinite(draft_lp.squeeze(-1))


def ordinal_values(dictionary) -> Tensor:
    """Numeric value of every symbol of an ordinal vocabulary (specials: NaN).

    Raises ValueError naming a symbol that is not a number.
    """
    values = torch.full((len(dictionary),), float("nan"))
    for idx in range(dictionary.nspecial, len(dictionary)):
        symbol = dictionary[idx]
        if symbol.startswith("madeupword"):  # fairseq's padding-factor fillers
            continue
        try:
            values[idx] = float(symbol)
        except ValueError:
            raise UsageError(
                "--blockwise-distance needs an ordinal vocabulary (every symbol a number); "
                "symbol %r is not: use --blockwise-topk instead" % symbol
            )
    return values


class DistanceAcceptance(AcceptanceRule):
    """Blockwise decoding § 5.2: accept when |draft - argmax| <= eps on an ordinal vocabulary."""

    def __init__(self, dictionary, eps: float):
        if eps < 0:
            raise UsageError("--blockwise-distance must be >= 0 (got %g)" % eps)
        self.values = ordinal_values(dictionary)
        self.eps = eps
        self.reads_log_probs = False

    def token_ok(self, draft, lprobs, verifier_tokens):
        if self.values.device != draft.device:  # moved once, not every iteration
            self.values = self.values.to(draft.device)
        values = self.values
        distance = (values[draft] - values[verifier_tokens]).abs()
        exact = draft.eq(verifier_tokens)
        return exact | (distance <= self.eps)  # NaN distances (specials) compare False


class MinimumBlock(AcceptanceRule):
    """Blockwise decoding § 5.3: accept at least ``min_block - 1`` draft tokens (where there are
    that many), so every iteration gains at least ``min_block`` tokens."""

    lossless = False

    def __init__(self, rule: AcceptanceRule, min_block: int):
        if min_block < 1:
            raise UsageError("--min-block-size must be >= 1 (got %d)" % min_block)
        self.rule, self.min_block = rule, min_block
        self.lossless = rule.lossless and min_block == 1
        self.reads_log_probs = rule.reads_log_probs

    def accept(self, draft, draft_valid, lprobs, verifier_tokens):
        accepted = self.rule.accept(draft, draft_valid, lprobs, verifier_tokens)
        floor = torch.clamp(draft_valid.long().sum(dim=1), max=self.min_block - 1)
        return torch.maximum(accepted, floor)


class TopBetaTauAcceptance(AcceptanceRule):
    """GAD++ (Xia et al., Eq. 6-7 of the GAD paper): accept a draft token that is within the
    verifier's top-beta *and* whose log-probability is at most tau below the top-1's.

    beta = 1 and tau = 0 is exact verification (lossless).
    """

    def __init__(self, beta: int, tau: float):
        if beta < 1:
            raise UsageError("--gad-beta must be >= 1 (got %d)" % beta)
        if tau < 0:
            raise UsageError("--gad-tau must be >= 0 (got %g)" % tau)
        self.beta, self.tau = beta, tau
        self.lossless = beta == 1 and tau == 0
        self.reads_log_probs = not self.lossless

    def token_ok(self, draft, lprobs, verifier_tokens):
        if self.lossless:
            return draft.eq(verifier_tokens)
        draft_lp = lprobs.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
        top = lprobs.topk(self.beta, dim=-1).values
        within_beta = draft_lp >= top[..., -1]  # Eq. 6
        within_tau = top[..., 0] - draft_lp <= self.tau  # Eq. 7
        return within_beta & within_tau & torch.isfinite(draft_lp)
