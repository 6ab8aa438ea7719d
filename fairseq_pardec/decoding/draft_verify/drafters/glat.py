"""Generalized aggressive decoding's drafters: a GLAT block drafter (``glat_drafter``) predicts
the next k tokens at once, re-reading the prefix (bidirectional) or from its own cache
(block-causal)."""

import torch

from fairseq_pardec.decoding.draft_verify.drafters.base import AdaptiveCaps, Drafter, DraftState
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step_factory import block_decoder_for
from fairseq_pardec.decoding.step.interface import DrafterStep
from fairseq_pardec.decoding.step.lean import lean_supported
from fairseq_pardec.decoding.step.output_projection import draft_projection, plain_output_projection
from fairseq_pardec.errors import UsageError


class NARState(DraftState):
    """One batch's values of a GAD drafter: its encoder output (all rows, and the active
    rows'), the rows it last drafted for, and with the block-causal drafter its cache, each
    row's cached length, its caps and the lengths last drafted."""

    def __init__(self):
        super().__init__()
        self.encoder_out = self.active_encoder_out = None
        self.rows = None
        self.cache = self.n_cached = None
        self.caps = None
        self.drafted = None


class NARDrafter(Drafter):
    """GAD: a non-autoregressive block drafter (``glat_drafter``) predicts the next k tokens
    from [BOS, accepted prefix, MASK x k]; its encoder runs once per batch (none at all when it
    reads the verifier's encoder output, ``--drafter-encoder verifier``).

    The bidirectional drafter re-reads the prefix every iteration (nothing can be cached); see
    :class:`CachedNARDrafter` for the block-causal one. A draft stops after its first EOS.
    """

    on_device = True  # a drafter model: it drafts where the verifier runs


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

    def propose(self, state, rows, tokens, n_out, max_len):
        if state.rows is None or not torch.equal(rows, state.rows):
            state.active_encoder_out = self.model.encoder.reorder_encoder_out(
                state.encoder_out, rows)
            state.rows = rows
        inputs, slots = self.model.draft_inputs(tokens, n_out, self.k, state.longest)
        logits = self._slot_logits(
            self.model.slot_features(inputs, slots, state.active_encoder_out))
        return self._finish(state, logits, max_len)

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

    observes_features = False  # observe reads only how much of each draft was accepted

    def __init__(self, model, block_size: int, eos: int, pad: int, adaptive: bool = False,
                 dictionary=None, draft_vocab=None):
        super().__init__(model, block_size, eos, pad, dictionary, draft_vocab)
        # adaptive: a row drafts at most twice its recent mean of accepted draft tokens, plus
        # one (as iad's copy drafter); slots no row drafts are not computed at all
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
        state.rows = torch.arange(bsz, device=device)
        state.n_cached = torch.zeros(bsz, dtype=torch.long, device=device)  # BOS + tokens cached
        state.caps = AdaptiveCaps(bsz, self.k, device)
        return state

    @staticmethod
    def _follow(blocks, state: NARState, rows):
        """Drop the cache rows of sentences that left the batch (rows only ever shrink)."""
        if rows.numel() == state.rows.numel():
            return
        keep = torch.searchsorted(state.rows, rows)
        blocks.reorder(state.cache, keep)
        state.n_cached = state.n_cached[keep]
        state.rows = rows

    def propose(self, state, rows, tokens, n_out, max_len):
        self._follow(self.blocks, state, rows)
        device = tokens.device
        b = rows.numel()
        # adaptive: only the slots some row will draft are fed (k = the widest row's cap); the
        # drafter was trained with k slots, fewer mask slots are a shorter block of the same kind
        cap, k = max_len, self.k
        if self.adaptive and self.sampler is None:
            cap = torch.minimum(state.caps.caps(rows), max_len)
            k = max(1, min(self.k, int(cap.max())))
        new = n_out + 1 - state.n_cached  # >= 1: every iteration gains a token (BOS first)
        width = int(new.max())
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
        draft, lengths = self._finish(state, logits, cap)
        state.drafted = lengths
        return draft, lengths

    def observe(self, state, rows, features, last, tokens=None):
        if not self.adaptive or state.drafted is None:
            return
        state.caps.update(rows, state.drafted, last)
        state.drafted = None
