"""Acceptance rules: which prefix of a draft the verifier accepts.

The engine's decisions (decisions.py) walk each row's draft on the host: a draft token equal to
the verifier's choice is accepted by every rule; one that differs asks the rule (``host_ok``),
with the verdict the device computed for it where the rule reads log-probabilities
(``device_verdicts``, from :meth:`token_ok`); the run of accepted tokens from the left is kept,
or ``least_accepted`` tokens where that is more (--min-block-size). The verifier's own token
follows at the first rejected position, so every iteration gains at least one token.
:meth:`accept` asks the same parts for whole tensors (tests, tools).

``ExactAcceptance`` accepts a draft token only when it *is* the verifier's greedy choice: the
output is then identical to greedy decoding (lossless). Relaxed rules (GAD++'s top-beta within
tau, blockwise decoding's top-k / distance / minimum block) implement :meth:`token_ok` (on the
device, for a rule that reads log-probabilities) or :meth:`host_ok`, and declare
``lossless = False``.
"""

import torch
from torch import Tensor
from fairseq_pardec.errors import UsageError


class AcceptanceRule:
    lossless = False
    # False when the rule decides from the draft and the verifier's tokens alone: the engine
    # then hands it no log-probabilities.
    reads_log_probs = True

    def token_ok(self, draft: Tensor, scores: "DraftScores", verifier_tokens: Tensor) -> Tensor:
        """(B, K) bool, on the device: may each draft token stand in for the verifier's choice
        (a rule that reads log-probabilities)?"""
        raise NotImplementedError

    def accept(
        self, draft: Tensor, draft_valid: Tensor, lprobs: Tensor, verifier_tokens: Tensor,
        positions: Tensor = None,
    ) -> Tensor:
        """Number of leading draft tokens accepted per row, from the parts the engine's walk
        asks (decisions.walk_row): ``device_verdicts``, ``host_ok`` and ``least_accepted``.

        Args:
            draft: (B, K) draft tokens, padded.
            draft_valid: (B, K) True for real draft tokens (a prefix of each row).
            lprobs: the verifier's log-probabilities: (B, K, V) at the K draft positions, or
                packed (N, V) rows with ``positions`` (B, K) naming each draft position's row;
                None for a rule whose ``reads_log_probs`` is False.
            verifier_tokens: (B, K) the verifier's own choice at those positions.
        """
        rows, width = draft.shape
        verdicts = None
        if lprobs is not None and self.reads_log_probs and width:
            if positions is None:
                positions = torch.arange(rows * width).view(rows, width)
                lprobs = lprobs[:, :width].reshape(rows * width, -1)
            verdicts = self.device_verdicts(draft, lprobs, positions).float().tolist()
        accepted = []
        for r, (tokens, valid, chosen) in enumerate(zip(draft.tolist(), draft_valid.tolist(),
                                                        verifier_tokens.tolist())):
            length, run = sum(valid), 0
            for j in range(length):
                verdict = verdicts[r][j] if verdicts is not None else 0.0
                if tokens[j] != chosen[j] and not self.host_ok(tokens[j], chosen[j], verdict):
                    break
                run += 1
            accepted.append(max(run, self.least_accepted(length)))
        return torch.tensor(accepted, dtype=torch.long)

    def device_verdicts(self, draft: Tensor, lprobs: Tensor, positions: Tensor):
        """(B, K) bool, on the device, for a rule that reads log-probabilities (``token_ok``
        on the packed (N, V) rows, ``positions`` naming each draft position's row); None for a
        rule that decides from the tokens alone."""
        if not self.reads_log_probs:
            return None
        return self.token_ok(draft, DraftScores(lprobs, positions, draft), None)

    def host_ok(self, draft_token: int, verifier_token: int, verdict: float) -> bool:
        """Whether a draft token other than the verifier's may stand in for it (``verdict``:
        the device's, 1.0 or 0.0, for a rule that reads log-probabilities)."""
        return self.reads_log_probs and verdict > 0.5

    def least_accepted(self, drafted: int) -> int:
        """How many of a row's ``drafted`` tokens are kept whatever the verifier says."""
        return 0


class DraftScores:
    """The verifier's log-probabilities as relaxed rules read them: each draft token's own and
    the best few at its position, computed on whichever layout the caller holds."""

    def __init__(self, lprobs: Tensor, positions, draft: Tensor):
        self.lprobs, self.positions = lprobs, positions
        if positions is None:  # (B, K, V)
            self.draft = lprobs.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
        else:  # packed (N, V)
            self.draft = lprobs[positions, draft]

    def top(self, n: int) -> Tensor:
        """(B, K, n) the n best log-probabilities at each draft position, best first."""
        values = self.lprobs.topk(min(n, self.lprobs.size(-1)), dim=-1).values
        return values if self.positions is None else values[self.positions]


class ExactAcceptance(AcceptanceRule):
    """Accept while the draft equals the verifier's greedy token (lossless)."""

    lossless = True
    reads_log_probs = False


class TopKAcceptance(AcceptanceRule):
    """Blockwise decoding § 5.1: accept a draft token within the verifier's top-k."""

    def __init__(self, k: int):
        if k < 1:
            raise UsageError("--blockwise-topk must be >= 1 (got %d)" % k)
        self.k = k
        self.lossless = k == 1
        self.reads_log_probs = k != 1

    def token_ok(self, draft, scores, verifier_tokens):
        # fewer than k tokens score strictly higher <=> the k-th best is not above the draft's
        draft_lp = scores.draft
        return (draft_lp >= scores.top(self.k)[..., -1]) & torch.isfinite(draft_lp)


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
        self.host_values = ordinal_values(dictionary).tolist()  # the host's decisions read these
        self.eps = eps
        self.reads_log_probs = False

    def host_ok(self, draft_token, verifier_token, verdict):
        values = self.host_values
        return abs(values[draft_token] - values[verifier_token]) <= self.eps  # NaN: False


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

    def device_verdicts(self, draft, lprobs, positions):
        return self.rule.device_verdicts(draft, lprobs, positions)

    def host_ok(self, draft_token, verifier_token, verdict):
        return self.rule.host_ok(draft_token, verifier_token, verdict)

    def least_accepted(self, drafted):
        return min(drafted, self.min_block - 1)


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

    def token_ok(self, draft, scores, verifier_tokens):
        draft_lp = scores.draft
        top = scores.top(self.beta)
        within_beta = draft_lp >= top[..., -1]  # Eq. 6
        within_tau = top[..., 0] - draft_lp <= self.tau  # Eq. 7
        return within_beta & within_tau & torch.isfinite(draft_lp)
