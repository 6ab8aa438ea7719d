"""Speculative sampling: draft-and-verify that samples exactly from the verifier's distribution.

With ``--sampling`` the engine no longer compares a draft with the verifier's best token. For
draft token x at block position i, drawn by the drafter from q_i, it accepts x with probability
min(1, p_i(x) / q_i(x)), p_i being the verifier's distribution there after fairseq's own
adjustments (pad, --unkpen, --min-len, EOS at the length limit, --prefix-size) and its sampling
filters (--temperature, --sampling-topk, --sampling-topp, as fairseq's ``Sampling`` search
applies them). At the first rejection it draws from norm(max(0, p_i - q_i)); when a row's whole
draft is accepted it draws a bonus token from p after the last draft token. Every output token is
then distributed exactly as fairseq's ancestral sampling draws it (Leviathan et al. 2023, Chen et
al. 2023, Theorem 1 / Appendix A.1); the drafts only change how many tokens an iteration gains.

q per drafter: a deterministic draft (IAD's copy, a forced prefix) is one-hot, so x is accepted
with probability p_i(x) and the residual is p_i without x. GAD's drafter and the blockwise heads
*sample* their drafts from their own filtered distributions and report q; a draft that was not
drawn from the q it reports would break the guarantee.

All random draws come from one ``torch.Generator`` per generator, seeded from ``--seed``.
"""

from typing import Optional

import torch
from fairseq.search import Sampling
from torch import Tensor
from fairseq_pardec.errors import UsageError


class SamplingFilter:
    """fairseq ``Sampling`` search's top-k / top-p truncation, as normalised probabilities."""

    def __init__(self, topk: int = -1, topp: float = -1.0):
        if topk is not None and topk > 0 and topp is not None and topp > 0:
            # fairseq applies top-p and ignores top-k when both are given; so do we
            topk = -1
        self.topk = topk if topk is not None else -1
        self.topp = topp if topp is not None else -1.0
        if self.topp > 1:
            raise UsageError("--sampling-topp must be in (0, 1] (got %g)" % self.topp)

    @property
    def sampling_topp(self) -> float:
        # the one attribute fairseq's Sampling._sample_topp reads
        return self.topp

    def probs(self, lprobs: Tensor) -> Tensor:
        """(..., V) log-probabilities -> (..., V) float32 probabilities of fairseq's sampling
        distribution: ``exp`` of the log-probs, outside the top-k / top-p set zeroed, normalised
        (``torch.multinomial`` normalises the same way)."""
        shape = lprobs.shape
        lprobs = lprobs.float().reshape(-1, shape[-1])
        if lprobs.size(0) == 0:
            return lprobs.exp().view(shape)
        if self.topp > 0:
            # fairseq's own truncation, on (N, 1, V) as its search holds the beams
            kept, where = Sampling._sample_topp(self, lprobs.unsqueeze(1).clone())
            probs = torch.zeros_like(lprobs).scatter_(-1, where.squeeze(1), kept.squeeze(1))
        elif self.topk > 0 and self.topk < lprobs.size(-1):
            kept, where = lprobs.topk(self.topk, dim=-1)  # as fairseq's Sampling.step
            probs = torch.zeros_like(lprobs).scatter_(-1, where, kept.exp())
        else:
            probs = lprobs.exp()
        total = probs.sum(dim=-1, keepdim=True)
        return (probs / total.clamp(min=torch.finfo(probs.dtype).tiny)).view(shape)


class SpeculativeSampler:
    """The accept / residual / bonus draws of one engine iteration."""

    def __init__(self, filter: SamplingFilter, seed: int):
        self.filter = filter
        self.seed = seed
        self.generators = {}

    def generator(self, device) -> torch.Generator:
        device = torch.device(device)
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    def sample(self, probs: Tensor) -> Tensor:
        """One token per row of (R, V) probabilities."""
        if probs.size(0) == 0:
            return probs.new_zeros(0, dtype=torch.long)
        return torch.multinomial(probs, 1, generator=self.generator(probs.device)).squeeze(1)

    def accept(self, draft: Tensor, draft_valid: Tensor, p_draft: Tensor,
               q_draft: Optional[Tensor]) -> Tensor:
        """Number of leading draft tokens accepted per row.

        Args:
            draft: (B, K) draft tokens; draft_valid: (B, K) True for real ones.
            p_draft: (B, K) the verifier's sampling probability of each draft token (the
                engine reads it off its packed (N, V) rows: no (B, K, V) copy).
            q_draft: (B, K, V) the drafter's distribution the draft was drawn from, or None for
                a deterministic (one-hot) draft.
        """
        b, k = draft.shape
        if k == 0:
            return draft.new_zeros(b)
        p_x = p_draft
        u = torch.rand(b, k, generator=self.generator(draft.device), device=draft.device)
        if q_draft is None:
            ok = u < p_x  # q(x) = 1
        else:
            q_x = q_draft.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
            ok = (u * q_x < p_x) & (q_x > 0)  # u < min(1, p/q)
        ok &= draft_valid
        return ok.long().cumprod(dim=1).sum(dim=1)

    def decide(self, lprobs: Tensor, forced: Optional[Tensor], block):
        """Accept / residual / bonus for every row of an engine's block (batch_state.Block):
        ``lprobs`` (N, V) at its packed positions after fairseq's edits, ``forced`` the forced
        prefix tokens there (-1: none) or None.

        Returns the accepted draft lengths (B,) and a (B, L) token grid holding each row's
        draft tokens, and at its first non-accepted position the token drawn there (what
        follows is never kept): decisions.read_sampled reads both for decisions.walk_row.
        """
        probs = self.filter.probs(lprobs)  # (N, V): fairseq's sampling distribution
        if forced is not None:  # --prefix-size: the forced token has probability 1
            is_forced = forced >= 0
            one_hot = torch.zeros_like(probs).scatter_(1, forced.clamp(min=0).unsqueeze(1), 1.0)
            probs = torch.where(is_forced.unsqueeze(1), one_hot, probs)
        ar, layout, q, padded_draft = block.ar, block.layout, block.q, block.padded_draft
        n_acc = self.accept(block.draft, block.draft_valid, probs[block.draft_pos, block.draft], q)
        rejected = n_acc < block.draft_len
        q_next = None
        if q is not None and q.size(1) > 0:
            q_next = q[ar, n_acc.clamp(max=q.size(1) - 1)]
        own = self.next_tokens(probs[layout.at(ar, n_acc)], rejected, padded_draft[ar, n_acc],
                               q_next)
        grid = padded_draft.clone()
        grid[ar, n_acc] = own
        return n_acc, grid

    def next_tokens(self, p_next: Tensor, rejected: Tensor, draft_at: Tensor,
                    q_next: Optional[Tensor]) -> Tensor:
        """The token after each row's accepted draft prefix.

        Args:
            p_next: (B, V) the verifier's distribution at that position.
            rejected: (B,) True where the draft token there was rejected (else: bonus token).
            draft_at: (B,) the rejected draft token (any value where not rejected).
            q_next: (B, V) the drafter's distribution there, or None (one-hot drafts).
        """
        dist = p_next
        # on the CPU a read is free and spares the residual where no row was rejected; on a
        # device the residual is computed regardless (where() keeps p for accepted rows)
        if p_next.device.type != "cpu" or bool(rejected.any()):
            if q_next is None:
                residual = p_next.scatter(1, draft_at.unsqueeze(1), 0.0)
            else:
                residual = (p_next - q_next).clamp(min=0.0)
            mass = residual.sum(dim=1, keepdim=True)
            # p = q (or p one-hot at the rejected token) leaves no residual: p itself is exact
            usable = rejected.unsqueeze(1) & (mass > 0)
            dist = torch.where(usable, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
        return self.sample(dist)
