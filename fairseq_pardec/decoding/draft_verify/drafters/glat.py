"""Generalized aggressive decoding's drafters: a GLAT block drafter (``glat_drafter``) predicts
the next k tokens at once, re-reading the prefix (bidirectional) or from its own cache
(block-causal)."""

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import Drafter, DraftState
from fairseq_pardec.decoding.draft_verify.drafters.schedule import DraftSchedule
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step_factory import block_decoder_for
from fairseq_pardec.decoding.step.interface import DrafterStep
from fairseq_pardec.decoding.step.lean import lean_supported
from fairseq_pardec.decoding.step.output_projection import draft_projection, plain_output_projection
from fairseq_pardec.errors import UsageError


GAD = "gad"  # the kind of draft a GLAT drafter makes (schedule.py, auto.py)


class NARState(DraftState):
    """One batch's values of a GAD drafter: its encoder output (all rows, and the active
    rows'), the rows it last drafted for (a list; on the device, ``rows_on_device``), and with
    the block-causal drafter its cache, each row's cached length and the batch's schedule."""

    def __init__(self):
        super().__init__()
        self.encoder_out = self.active_encoder_out = None
        self.rows = self.rows_on_device = None
        self.cache = self.n_cached = None
        self.cached_host = None  # n_cached on the host, per active row
        self.schedule = None


class NARDrafter(Drafter):
    """GAD: a non-autoregressive block drafter (``glat_drafter``) predicts the next k tokens
    from [BOS, accepted prefix, MASK x k]; its encoder runs once per batch (none at all when it
    reads the verifier's encoder output, ``--drafter-encoder verifier``).

    The bidirectional drafter re-reads the prefix every iteration (nothing can be cached); see
    :class:`CachedNARDrafter` for the block-causal one. A draft stops after its first EOS.
    """

    def __init__(self, model, block_size: int, eos: int, pad: int, dictionary=None,
                 draft_vocab=None):
        self.model, self.k, self.eos, self.pad = model, block_size, eos, pad
        # --draft-vocab: the slots score a shortlist of frequent types only
        self.project = draft_projection(plain_output_projection(model.decoder), dictionary,
                                        draft_vocab)

    def _slot_logits(self, features):
        """(B, k, d) slot features -> (B, k, V) logits."""
        if self.project is None:
            return self.model.decoder.output_layer(features)
        flat = self.project(features.reshape(-1, features.size(-1)))
        return flat.view(features.shape[:-1] + (-1,))

    def _encoder_out(self, sample, verifier_encoder_out):
        if self.model.reads_verifier_encoder:
            return verifier_encoder_out
        net = sample["net_input"]
        return self.model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])

    def start(self, sample, encoder_out, bos: int, schedule=None) -> NARState:
        state = NARState()
        state.encoder_out = self._encoder_out(sample, encoder_out)
        state.active_encoder_out = state.encoder_out
        return state

    def propose(self, state, view):
        return self.draft(state, view, view.room)

    def draft(self, state, view, caps):
        """Per active row of ``view`` its draft of at most ``caps`` tokens (a list per row;
        ``--generator auto`` gives its own caps, 0 for the rows that take another draft)."""
        if state.rows != view.rows:  # (compared on the host: no read of the device)
            state.active_encoder_out = self.model.encoder.reorder_encoder_out(
                state.encoder_out, view.rows_on_device())
            state.rows = view.rows
        inputs, slots = self.model.draft_inputs(view.tokens_on_device(), view.n_out_on_device(),
                                                self.k, view.longest)
        logits = self._slot_logits(
            self.model.slot_features(inputs, slots, state.active_encoder_out))
        draft, lengths = self._finish(state, logits, view.on_device(caps))
        return view.read(draft, lengths)

    def _finish(self, state: NARState, logits, max_len):
        """(B, k, V) slot logits -> drafts cut after their first EOS and at ``max_len``."""
        logits[..., self.pad] = float("-inf")
        if self.sampler is None:
            draft = logits.argmax(dim=-1)
        else:  # speculative sampling: draw every slot from the drafter's own distribution
            draft, state.draft_probs = self._draw(logits)
        width = draft.size(1)
        cols = torch.arange(width, device=draft.device).unsqueeze(0)
        first_eos = torch.where(draft.eq(self.eos), cols, width).min(dim=1).values
        lengths = torch.minimum(torch.clamp(first_eos + 1, max=width), max_len)
        draft = draft.masked_fill(cols >= lengths.unsqueeze(1), self.pad)
        if state.draft_probs is not None:
            state.draft_probs = state.draft_probs[:, : int(lengths.max()) if lengths.numel() else 0]
            draft = draft[:, : state.draft_probs.size(1)]
        return draft, lengths


class CachedNARDrafter(NARDrafter):
    """GAD with a block-causal drafter (``--drafter-attention block-causal``): the prefix's
    keys/values are cached like the verifier's.

    Each iteration feeds ``[MASK x k, tokens accepted since the last call]`` on top of the
    drafter's cache (the slots attend to the cache, the new tokens and each other; the new
    tokens attend causally to the cache and each other, never to the slots), reads the k slots,
    then drops the slots' entries: the cache holds BOS and every accepted token. The block has
    the slot-first layout the drafter was trained on, so the drafts equal the full forward's
    (tests/test_gad_cached.py).
    """

    def __init__(self, model, block_size: int, eos: int, pad: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        super().__init__(model, block_size, eos, pad, dictionary, draft_vocab)
        # adaptive: a row drafts at most twice its recent mean of accepted draft tokens, plus
        # one (as iad's copy drafter; the batch's schedule keeps the means on the host); slots
        # no row drafts are not computed at all
        self.adaptive = adaptive
        if not lean_supported(model.decoder):
            raise UsageError(
                "the block-causal drafter's decoder layers use options its cached step does not "
                "reproduce (NormFormer, bias_kv, ...); train it without them")
        # the verifier's step: the fast one where it runs (float32 on the CPU), else the lean
        # one; a draft needs no guard, its tokens are verified
        self.blocks: DrafterStep = block_decoder_for(model.decoder, lean=True, fast=True)
        self.mask_token = model.mask_index()
        self.max_step = model.max_decoder_positions() - 1

    def start(self, sample, encoder_out, bos: int, schedule=None) -> NARState:
        state = NARState()
        state.encoder_out = self._encoder_out(sample, encoder_out)
        bsz = sample["net_input"]["src_tokens"].size(0)
        device = sample["net_input"]["src_tokens"].device
        state.cache = self.blocks.new_state()
        state.rows = list(range(bsz))
        state.rows_on_device = torch.arange(bsz, device=device)
        state.n_cached = torch.zeros(bsz, dtype=torch.long, device=device)  # BOS + tokens cached
        state.cached_host = [0] * bsz
        state.schedule = schedule if schedule is not None else DraftSchedule(bsz)
        if self.adaptive and self.sampler is None:
            state.schedule.plan_drafts([GAD], {}, None, None, adaptive=True)
        return state

    @staticmethod
    def _follow(blocks, state: NARState, view):
        """Drop the cache rows of sentences that left the batch (rows only ever shrink)."""
        if len(view.rows) == len(state.rows):
            return
        rows = view.rows_on_device()
        keep = torch.searchsorted(state.rows_on_device, rows)
        blocks.reorder(state.cache, keep)
        state.n_cached = state.n_cached[keep]
        place = {row: i for i, row in enumerate(state.rows)}
        state.cached_host = [state.cached_host[place[row]] for row in view.rows]
        state.rows, state.rows_on_device = view.rows, rows

    def propose(self, state, view):
        caps = view.room
        schedule = state.schedule
        adaptive = self.adaptive and self.sampler is None
        if adaptive:  # each row's cap from its recent acceptance
            caps = [plan[0][2] if plan else 0
                    for plan in schedule.plan(view.rows, view.room, may_rest=False)]
        drafts = self.draft(state, view, caps)
        if adaptive:
            schedule.chose(view.rows, [GAD if d else None for d in drafts], drafts)
        return drafts

    def draft(self, state, view, caps):
        self._follow(self.blocks, state, view)
        tokens, n_out = view.tokens_on_device(), view.n_out_on_device()
        device = tokens.device
        b = len(view.rows)
        # only the slots some row will draft are fed (k = the widest row's cap); the drafter
        # was trained with k slots, fewer mask slots are a shorter block of the same kind
        k = max(1, min(self.k, max(caps, default=0)))
        new = n_out + 1 - state.n_cached  # >= 1: every iteration gains a token (BOS first)
        width = max(n + 1 - cached for n, cached in zip(view.n_out, state.cached_host))
        cols = torch.arange(width, device=device).unsqueeze(0)
        fresh = tokens.gather(1, (state.n_cached.unsqueeze(1) + cols).clamp(max=tokens.size(1) - 1))
        fresh_pad = cols >= new.unsqueeze(1)
        block = torch.cat([tokens.new_full((b, k), self.mask_token),
                           fresh.masked_fill(fresh_pad, self.pad)], 1)
        block_pad = torch.cat([fresh_pad.new_zeros(b, k), fresh_pad], 1)
        slot_cols = torch.arange(k, device=device).unsqueeze(0)
        steps = torch.cat([n_out.unsqueeze(1) + 1 + slot_cols,
                           state.n_cached.unsqueeze(1) + cols], 1)
        # slots past the drafter's last position (drafts near max length) share that position
        steps = steps.clamp(max=self.max_step)
        layout = BlockLayout(block_pad)
        first = self.blocks.cache_length(state.cache)
        mask = self.model.block_causal_mask(k, k + width, self.blocks.decoder.embed_tokens.weight)
        features = self.blocks.forward_packed(block, state.n_cached, layout, state.encoder_out,
                                              state.cache, steps=steps, block_mask=mask)
        logits = self._slot_logits(features[layout.pos[:, :k].reshape(-1)].view(b, k, -1))
        self.blocks.drop_columns(state.cache, first, k)
        self.blocks.compact(state.cache)  # holes left by ragged new tokens
        state.n_cached = n_out + 1
        state.cached_host = [n + 1 for n in view.n_out]
        draft, lengths = self._finish(state, logits, view.on_device(caps))
        return view.read(draft, lengths)

    def observe(self, state, outcome):
        if self.adaptive and self.sampler is None:
            state.schedule.verified(outcome.rows, outcome.accepted)
