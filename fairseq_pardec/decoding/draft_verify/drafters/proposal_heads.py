"""Blockwise parallel decoding's drafter: the model's own proposal heads."""

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import AdaptiveCaps, Drafter, DraftState
from fairseq_pardec.decoding.step.output_projection import (
    ShortlistProjection,
    base_projection,
    draft_projection,
)
from fairseq_pardec.errors import UsageError


class HeadsState(DraftState):
    """One batch's values of the proposal heads: per row the next draft and its length (and
    with --sampling the distributions drawn from), its caps, and the lengths last drafted."""

    def __init__(self):
        super().__init__()
        self.next_draft = self.next_len = self.next_probs = None
        self.caps = None
        self.drafted = None


class HeadsDrafter(Drafter):
    """Blockwise parallel decoding: the proposal heads p_2..p_k, read at the last kept position
    of the previous verification (merged invocation, § 4), are the next draft.

    The first iteration has no proposals yet: it verifies nothing and takes p_1's token (and
    the heads' first proposals) from the same call.

    ``adaptive``: each row drafts at most twice its recent mean of accepted draft tokens, plus
    one (as iad's and GAD's drafters), so a row whose proposals keep being rejected verifies
    short blocks; heads no row will use are not computed.
    """

    on_device = True  # a drafter model: it drafts where the verifier runs
    reads_tokens = False  # the heads draft from the verifier's features


    def __init__(self, decoder, pad: int, block_size: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        self.decoder, self.pad = decoder, pad
        self.width = block_size - 1  # heads 2..block_size
        self.adaptive = adaptive
        # the heads share the base's vocabulary projection (p_1's own output layer may differ)
        self.project = draft_projection(base_projection(decoder), dictionary, draft_vocab)

    def start(self, sample, encoder_out, bos: int, schedule=None) -> HeadsState:
        src = sample["net_input"]["src_tokens"]
        state = HeadsState()
        state.next_draft = src.new_full((src.size(0), max(self.width, 0)), self.pad)
        state.next_len = src.new_zeros(src.size(0))
        state.next_probs = None
        state.caps = AdaptiveCaps(src.size(0), self.width, src.device)
        return state

    def propose(self, state, rows, tokens, n_out, max_len):
        lengths = torch.minimum(state.next_len[rows], max_len)
        # every head's column: the engine reads the lengths with the drafts and keeps each
        # row's own, so the widest row's length need not be read from the device first (with
        # --sampling the drafts' distributions are cut to it, as the block is)
        width = state.next_draft.size(1)
        if self.sampler is not None:
            width = int(lengths.max()) if lengths.numel() else 0
        draft = state.next_draft[rows, :width]
        cols = torch.arange(width, device=draft.device)
        draft = draft.masked_fill(cols.unsqueeze(0) >= lengths.unsqueeze(1), self.pad)
        if self.sampler is not None:
            if state.next_probs is None:  # nothing proposed yet: an empty draft
                state.draft_probs = None
            else:
                state.draft_probs = state.next_probs[rows, :width]
        state.drafted = lengths
        return draft, lengths

    def _width(self, state: HeadsState, rows):
        """How many heads to run (n) and each row's cap (None: not adaptive)."""
        n, caps = self.width, None
        if self.adaptive and self.sampler is None:
            caps = state.caps.caps(rows)
            n = max(1, min(self.width, int(caps.max())))
        return n, caps

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

    def observe(self, state, rows, features, last, tokens=None, caps=None):
        """``caps``: (B,) the most proposals each of ``rows`` may draft next, decided by the
        caller (``--generator auto``'s prices); heads no row uses are not computed."""
        if self.width <= 0:
            return
        if self.adaptive and state.drafted is not None:
            state.caps.update(rows, state.drafted, last)
        state.drafted = None
        if caps is None:
            n, caps = self._width(state, rows)
        else:
            n = max(1, min(self.width, int(caps.max())))
        if self.decoder.proposals_read_tokens:
            drafted, probs = self._recurrent(features, tokens, n)
        else:
            drafted, probs = self._choose(self._project(self.decoder.proposal_features(features, n)))
        state.next_draft[rows, :n] = drafted
        if probs is not None:  # speculative sampling: keep the distributions drawn from
            if state.next_probs is None:
                state.next_probs = probs.new_zeros((state.next_draft.size(0),) + probs.shape[1:])
            state.next_probs[rows] = probs
        state.next_len[rows] = n if caps is None else caps.clamp(max=n)
