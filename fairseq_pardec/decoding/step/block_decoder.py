"""Multi-token incremental decoding over a fairseq TransformerDecoder's KV cache.

fairseq's incremental decoding feeds one token per call. Draft-and-verify needs a *block* of tokens
per row on top of the cache, causal inside the block, and afterwards each row keeps only the cache
entries of the tokens it accepted. We get there without touching fairseq's layers:

* the block goes through the decoder's own modules (embeddings, ``TransformerDecoderLayer``s and
  their ``MultiheadAttention`` incremental state), with an explicit causal ``attn_mask`` and a key
  padding mask for ragged blocks (see :meth:`BlockDecoder.forward_block`);
* rollback marks rejected entries in the cache's saved ``prev_key_padding_mask``. Keys carry their
  position in their values (absolute positions are added to the embeddings), not in their index in
  the cache, so masked holes change nothing in the attention; :meth:`BlockDecoder.compact` drops
  them when they pile up.

Batch shrinking (finished rows leave) reuses fairseq's ``reorder_incremental_state``.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.step.margins import rounding_margin
from fairseq_pardec.models.decoder_inputs import embed_at, encoder_states, final_features

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
)

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class UnsupportedDecoder(UsageError):
    """A decoder whose forward the lean step would not reproduce exactly."""


def check_supported_decoder(decoder):
    """Refuse, with the reason, decoders whose forward we would not reproduce exactly."""
    if not isinstance(decoder, TransformerDecoderBase):
        raise UnsupportedDecoder(
            "draft-and-verify generators need a fairseq TransformerDecoder (got %s); "
            "use --generator greedy or beam" % type(decoder).__name__
        )
    if type(decoder).extract_features_scriptable is not TransformerDecoderBase.extract_features_scriptable:
        raise UnsupportedDecoder(
            "%s computes its own decoder inputs (an ibdecoder model?); draft-and-verify "
            "generators need a left-to-right decoder: use --generator interleaved for ibdecoder "
            "models" % type(decoder).__name__
        )
    if decoder.cross_self_attention:
        raise UnsupportedDecoder(
            "models trained with --cross-self-attention are not supported by draft-and-verify "
            "generators; use --generator greedy"
        )
    if decoder.adaptive_softmax is not None:
        raise UnsupportedDecoder(
            "models with --adaptive-softmax-cutoff are not supported by draft-and-verify "
            "generators; use --generator greedy"
        )
    positions = decoder.embed_positions
    if positions is not None and not isinstance(
        positions, (LearnedPositionalEmbedding, SinusoidalPositionalEmbedding)
    ):
        raise UnsupportedDecoder(
            "unsupported decoder positional embedding %s" % type(positions).__name__
        )


def keep_bounds(keep: Tensor, known: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """(min, max) of a rollback's ``keep``: ``known`` if given, else one read from the device."""
    if known is not None:
        return known
    if keep.numel() == 0:
        return 0, 0
    low, high = torch.aminmax(keep)
    low, high = torch.stack([low, high]).tolist()
    return low, high


class BlockDecoder:
    """Wraps one fairseq TransformerDecoder for block-wise incremental decoding."""

    def __init__(self, decoder):
        check_supported_decoder(decoder)
        self.decoder = decoder
        self.padding_idx = decoder.padding_idx
        self.self_attns = [layer.self_attn for layer in decoder.layers]

    # A plain greedy step (one position per row, on a cache that only such steps filled) runs
    # fairseq's own modules on fairseq's shapes: it rounds exactly as fairseq does
    # (step/margins.py). A block of several positions does not: other product shapes.
    one_position_exact = True
    # fairseq's own modules: the engine encodes with fairseq's encoder, and the step measures
    # no product kernels of its own (step/interface.py)
    fast = False
    kernels = None
    # fairseq's incremental state keeps no per-row holes for rows that join a running batch:
    # only the lean and fast steps take them (join_rows)
    joins_rows = False

    def project_sources(self, encoder_out):
        """Nothing computed ahead of a join: None (see the Protocol, step/interface.py)."""
        return None

    def join_rows(self, state, encoder_out, rows: int, sources=None) -> None:
        """``rows`` rows join the running batch of ``state`` after its rows (where
        ``joins_rows``)."""
        raise UsageError("the %s decoder step takes no rows into a running batch; the server "
                         "decodes this model in rounds" % type(self).__name__)

    @property
    def margin(self) -> Optional[float]:
        """A bound on |this step's log-probability - fairseq's| (step/margins.py); None where
        no bound is claimed (half precision)."""
        weight = self.decoder.embed_tokens.weight
        return rounding_margin(weight.device, weight.dtype)

    def scores_kernel(self, state=None):
        """No native kernel reads this step's scores: the engine reads them with ``topk``."""
        return None

    def new_state(self, max_len: Optional[int] = None) -> IncrementalState:
        """An empty decoder state for one batch (fairseq's incremental-state dictionary); it
        grows as rows do, so the batch's length limit ``max_len`` is not needed."""
        return {}

    # ------------------------------------------------------------------ embeddings
    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Token and position embeddings at explicit positions (models/decoder_inputs.py)."""
        return embed_at(self.decoder, tokens, positions)

    # ------------------------------------------------------------------ forward
    def forward_block(
        self,
        tokens: Tensor,
        start: Tensor,
        block_pad: Tensor,
        encoder_out,
        incremental_state: IncrementalState,
    ) -> Tensor:
        """Decode a block of ``L`` tokens per row on top of the cache.

        Args:
            tokens: (B, L) block tokens; row b's token i sits at decoder step ``start[b] + i``.
            start: (B,) number of tokens of each row already in the cache.
            block_pad: (B, L) True where a row's block is padding (ragged drafts).
        Returns:
            (B, L, d) decoder features (what ``output_layer`` takes) after each block position.
        The block's keys/values are appended to the cache, padded positions masked out.
        """
        dec = self.decoder
        bsz, length = tokens.size()
        steps = start.unsqueeze(1) + torch.arange(length, device=tokens.device)
        # fairseq numbers positions from padding_idx + 1 (make_positions); padded block slots
        # borrow a valid position, their outputs are never used and their keys are masked.
        positions = (steps + self.padding_idx + 1).masked_fill(block_pad, self.padding_idx + 1)
        x = self.embed(tokens.masked_fill(block_pad, self.padding_idx), positions)
        x = x.transpose(0, 1)

        cached = self.cache_length(incremental_state)
        # The cache is visible to every block position; inside the block, causal.
        attn_mask = x.new_zeros(length, cached + length)
        attn_mask[:, cached:] = torch.triu(
            x.new_full((length, length), float("-inf")), diagonal=1
        )

        enc, enc_pad = encoder_states(encoder_out)  # (S, B, C), (B, S)

        for layer in dec.layers:
            x, _, _ = layer(
                x,
                enc,
                enc_pad,
                incremental_state,
                self_attn_mask=attn_mask,
                self_attn_padding_mask=block_pad,
            )
        return final_features(dec, x, time_major=True)

    def forward_packed(self, tokens, start, layout, encoder_out, incremental_state) -> Tensor:
        """:meth:`forward_block` with the features packed as ``layout`` (a
        :class:`~fairseq_pardec.decoding.step.block_layout.BlockLayout`) says: (N, d)."""
        x = self.forward_block(tokens, start, layout.block_pad, encoder_out, incremental_state)
        return layout.pack(x)

    def logits(self, features: Tensor) -> Tensor:
        """The decoder's output layer."""
        return self.decoder.output_layer(features)

    def log_probs(self, features: Tensor, temperature: float = 1.0, state=None) -> Tensor:
        """(..., d) features -> (..., V) float32 log-probabilities, as fairseq normalises them
        (``state``: see the Protocol, step/interface.py; not needed here)."""
        return normalised(self.logits(features), temperature)

    # ------------------------------------------------------------------ cache surgery
    def _buffers(self, incremental_state):
        for attn in self.self_attns:
            yield attn, attn._get_input_buffer(incremental_state)

    def reads_encoder_out(self, state) -> bool:
        """Whether the next ``forward_packed`` on ``state`` reads its ``encoder_out`` (else the
        caller may pass None: the state holds what it needs)."""
        return True

    def cache_length(self, incremental_state: IncrementalState) -> int:
        buf = self.self_attns[0]._get_input_buffer(incremental_state)
        key = buf.get("prev_key")
        return 0 if key is None else key.size(2)

    def valid_mask(self, incremental_state: IncrementalState) -> Optional[Tensor]:
        """(B, T) True for cache entries a row attends to."""
        buf = self.self_attns[0]._get_input_buffer(incremental_state)
        mask = buf.get("prev_key_padding_mask")
        return None if mask is None else ~mask.bool()

    def rollback(self, incremental_state: IncrementalState, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None):
        """Roll back: of the last ``block_len`` cache entries keep the first ``keep[b]`` per row.

        ``keep_range``: (min, max) of ``keep`` when the caller has them on the host already (the
        engine reads them once per iteration); otherwise they are read from ``keep``."""
        total = self.cache_length(incremental_state)
        first = total - block_len
        cols = torch.arange(block_len, device=keep.device)
        drop = cols.unsqueeze(0) >= keep.unsqueeze(1)  # (B, block_len)
        # Columns no row keeps can go at once (always true for batch 1: no holes at all).
        kept_cols = keep_bounds(keep, keep_range)[1]
        new_total = first + kept_cols
        for attn, buf in self._buffers(incremental_state):
            mask = buf["prev_key_padding_mask"]
            mask = mask.clone()
            mask[:, first:] = torch.maximum(mask[:, first:], drop.to(mask.dtype))
            buf["prev_key_padding_mask"] = mask[:, :new_total]
            buf["prev_key"] = buf["prev_key"][:, :, :new_total]
            buf["prev_value"] = buf["prev_value"][:, :, :new_total]
            attn._set_input_buffer(incremental_state, buf)

    def compact(self, incremental_state: IncrementalState, min_holes: float = 0.5):
        """Squeeze masked holes out of the cache when they are at least ``min_holes`` of it.

        Valid entries move to the front of each row (stable order); the cache is cut to the
        longest row. Attention over a set of keys does not depend on their order.
        """
        valid = self.valid_mask(incremental_state)
        if valid is None or valid.numel() == 0:
            return
        total = valid.size(1)
        longest = int(valid.sum(1).max())
        if total - longest < max(1, min_holes * total):
            return
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for attn, buf in self._buffers(incremental_state):
            index = order.unsqueeze(1).unsqueeze(-1)
            key, value = buf["prev_key"], buf["prev_value"]
            index = index.expand(key.size(0), key.size(1), longest, key.size(3))
            buf["prev_key"] = key.gather(2, index)
            buf["prev_value"] = value.gather(2, index)
            buf["prev_key_padding_mask"] = buf["prev_key_padding_mask"].gather(1, order)
            attn._set_input_buffer(incremental_state, buf)

    def reorder(self, incremental_state: IncrementalState, new_order: Tensor):
        """Keep (and reorder) batch rows; used when finished rows leave the batch."""
        self.decoder.reorder_incremental_state_scripting(incremental_state, new_order)


def normalised(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """fairseq's log-probabilities of ``logits`` at ``temperature``, in float32 (``logits`` may
    be divided in place)."""
    if temperature != 1.0:
        logits = logits.div_(temperature)
    return F.log_softmax(logits.float(), dim=-1)
