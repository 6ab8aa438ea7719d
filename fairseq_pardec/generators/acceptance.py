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


class AcceptanceRule:
    lossless = False

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
            lprobs: (B, K, V) verifier log-probabilities at the K draft positions.
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

    def token_ok(self, draft, lprobs, verifier_tokens):
        return draft.eq(verifier_tokens)
