"""Blockwise parallel decoding's drafter: the model's own proposal heads."""

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import Drafter, DraftState
from fairseq_pardec.decoding.draft_verify.drafters.schedule import DraftSchedule
from fairseq_pardec.decoding.step.output_projection import (
    ShortlistProjection,
    base_projection,
    draft_projection,
)
from fairseq_pardec.errors import UsageError


BLOCKWISE = "blockwise"  # the kind of draft the heads make (schedule.py, auto.py)


class HeadsState(DraftState):
    """One batch's values of the proposal heads: per row the next draft (on the device) and
    its length (on the host), with --sampling the distributions drawn from, and the batch's
    schedule."""

    def __init__(self):
        super().__init__()
        self.next_draft = self.next_len = self.next_probs = None
        self.schedule = None


class HeadsDrafter(Drafter):
    """Blockwise parallel decoding: the proposal heads p_2..p_k, read at the last kept position
    of the previous verification (merged invocation, § 4), are the next draft.

    The first iteration has no proposals yet: it verifies nothing and takes p_1's token (and
    the heads' first proposals) from the same call.

    ``adaptive``: each row drafts at most twice its recent mean of accepted draft tokens, plus
    one (as iad's and GAD's drafters), so a row whose proposals keep being rejected verifies
    short blocks; heads no row will use are not computed.
    """

    def __init__(self, decoder, pad: int, block_size: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        self.decoder, self.pad = decoder, pad
        self.width = block_size - 1  # heads 2..block_size
        self.adaptive = adaptive
        # the heads share the base's vocabulary projection (p_1's own output layer may differ)
        self.project = draft_projection(base_projection(decoder), dictionary, draft_vocab)

    def start(self, sample, encoder_out, bos: int, schedule=None) -> HeadsState:
        src = sample["net_input"]["src_tokens"]
        rows = src.size(0)
        state = HeadsState()
        state.next_draft = src.new_full((rows, max(self.width, 0)), self.pad)
        state.next_len = [0] * rows
        state.next_probs = None
        state.schedule = schedule if schedule is not None else DraftSchedule(rows)
        if self._adaptive():
            # the heads propose from every verification: they are asked in every iteration
            state.schedule.plan_drafts([BLOCKWISE], {}, None, None, adaptive=True,
                                       sees_every_verification=True)
        return state

    def _adaptive(self) -> bool:
        return self.adaptive and self.sampler is None

    def propose(self, state, view):
        drafts = self.draft(state, view, view.room)
        if self._adaptive():
            state.schedule.chose(view.rows, [BLOCKWISE if d else None for d in drafts], drafts)
        return drafts

    def draft(self, state, view, caps):
        """Per active row of ``view`` the heads' proposal, at most ``caps`` tokens (a list per
        row; ``--generator auto`` gives its own caps, 0 for the rows that take another draft)."""
        lengths = [min(state.next_len[row], cap) for row, cap in zip(view.rows, caps)]
        width = max(lengths, default=0)
        state.draft_probs = None
        if width == 0:  # nothing proposed yet (the first iteration), or no room
            return [[] for _ in lengths]
        rows = view.rows_on_device()
        if self.sampler is not None and state.next_probs is not None:
            state.draft_probs = state.next_probs[rows, :width]  # what the drafts were drawn from
        return view.read(state.next_draft[rows, :width], lengths)

    def observe(self, state, outcome):
        if self.width <= 0:
            return
        caps = None
        if self._adaptive():
            schedule = state.schedule
            schedule.verified(outcome.rows, outcome.accepted)
            caps = [plan[0][2] if plan else 0
                    for plan in schedule.plan(outcome.rows, [self.width] * len(outcome.rows),
                                              may_rest=False)]
        tokens = outcome.newest() if self.decoder.proposals_read_tokens else None
        self.propose_next(state, outcome, outcome.features(), tokens, caps)

    def propose_next(self, state: HeadsState, outcome, features, tokens, caps=None,
                     at=None):
        """The heads' next drafts of the rows of ``outcome`` (those at ``at``, their places in
        it, where given) from the verifier's ``features`` after each row's last kept token and
        that token (``tokens``, read by recurrent heads), at most ``caps`` tokens each (None:
        every head); heads no row uses are not computed."""
        rows = outcome.rows if at is None else [outcome.rows[i] for i in at]
        n = self.width if caps is None else max(1, min(self.width, max(caps, default=0)))
        if self.decoder.proposals_read_tokens:
            drafted, probs = self._recurrent(features, tokens, n)
        else:
            drafted, probs = self._choose(self._project(self.decoder.proposal_features(features, n)))
        on_device = outcome.on_device(rows) if at is not None else outcome.rows_on_device()
        state.next_draft[on_device, :n] = drafted
        if probs is not None:  # speculative sampling: keep the distributions drawn from
            if state.next_probs is None:
                state.next_probs = probs.new_zeros((state.next_draft.size(0),) + probs.shape[1:])
            state.next_probs[on_device] = probs
        for i, row in enumerate(rows):
            state.next_len[row] = n if caps is None else min(caps[i], n)

    def _project(self, hidden):
        """(..., d) head outputs -> (..., V) logits, padding never proposed."""
        if self.project is None:
            logits = self.decoder.base_logits(hidden)
        else:
            flat = self.project(hidden.reshape(-1, hidden.size(-1)))
            logits = flat.view(hidden.shape[:-1] + (-1,))
        logits[..., self.pad] = float("-inf")
        return logits

    def _choose(self, logits):
        """Proposals from (..., V) logits: the best tokens, or drawn ones with the
        distributions drawn from (speculative sampling)."""
        if self.sampler is None:
            return logits.argmax(dim=-1), None
        return self._draw(logits)

    def _recurrent(self, features, tokens, n):
        """Recurrent heads: each proposal from the state and token of the one before it,
        starting at the verifier's features and its token. (B, n) proposals, (B, n, V) or
        None."""
        if tokens is None:
            raise UsageError("recurrent proposal heads need the verifier's newest tokens")
        state, token, chosen, dists = features, tokens, [], []
        shortlist = self.sampler is None and isinstance(self.project, ShortlistProjection)
        for _ in range(n):
            state = self.decoder.proposal_step(state, token)
            if shortlist:  # padding is never shortlisted
                token, probs = self.project.best(state), None
            else:
                token, probs = self._choose(self._project(state))
            chosen.append(token)
            dists.append(probs)
        return torch.stack(chosen, 1), None if self.sampler is None else torch.stack(dists, 1)
