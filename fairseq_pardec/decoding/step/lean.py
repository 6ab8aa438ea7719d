"""A lean block step for plain fairseq Transformer decoders: fairseq's arithmetic, less Python.

:class:`~fairseq_pardec.decoding.step.block_decoder.BlockDecoder` runs a block through fairseq's own
modules. Per decoder layer that is a few dozen ``nn.Module`` calls, incremental-state dictionary
lookups, float padding masks concatenated and converted per layer, head-averaged attention
weights nobody reads; at batch 1 on a CPU this framework work costs more than the matrix
products (docs/results.md, "Where an iteration's time goes").

:class:`LeanBlockDecoder` performs, for the layers it supports, the *same* tensor operations with
the same shapes and in the same order as ``TransformerDecoderLayerBase.forward`` and
``MultiheadAttention.forward`` in incremental mode (projections, in-place scaling, ``bmm``,
additive causal mask, ``masked_fill`` of padded keys, float32 softmax, ``bmm``, output
projection, residual, layer norm), so its features are bit for bit those of the module path
(tests/test_lean_decoder.py). What it drops is only bookkeeping:

* the cache is one object (:class:`LeanCache`) with per-layer key/value tensors in the layout
  ``MultiheadAttention`` uses for its ``bmm`` (batch x heads, time, head dim), one boolean
  padding mask shared by all layers, and the encoder keys/values projected once per batch;
* padding masks are applied only when a row has masked cache entries or a ragged block
  (``masked_fill`` with nothing to fill changes nothing), the causal mask only for blocks longer
  than one token (a single query sees the whole cache);
* no attention weights are averaged for output.

Layers with options it does not replicate (NormFormer's extra norms and head scales, bias_kv,
zero attention, xformers, subclasses overriding ``forward``) keep the module path:
:func:`lean_supported` says which.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.block_decoder import (BlockDecoder, check_supported_decoder,
                                                      keep_bounds)
from fairseq_pardec.decoding.step.output_projection import OutputProjection, plain_output_projection
from fairseq_pardec.models.decoder_inputs import encoder_states


def _same(t: Tensor) -> Tensor:
    return t


def _plain_attention(attn) -> bool:
    return (
        type(attn).forward is MultiheadAttention.forward
        and attn.bias_k is None
        and attn.bias_v is None
        and not attn.add_zero_attn
        and not getattr(attn, "use_xformers", False)
        and not attn.onnx_trace
        and attn.q_proj.bias is not None
    )


def lean_supported(decoder) -> bool:
    """True when every layer of ``decoder`` is a plain Transformer decoder layer."""
    if len(decoder.layers) == 0:
        return False
    for layer in decoder.layers:
        if type(layer).forward is not TransformerDecoderLayerBase.forward:
            return False
        if any(
            getattr(layer, name, None) is not None
            for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid")
        ):
            return False
        if layer.cross_self_attention or layer.encoder_attn is None:
            return False
        if not (_plain_attention(layer.self_attn) and _plain_attention(layer.encoder_attn)):
            return False
    return True


def padded_to(t: Tensor, length: int, dim: int) -> Tensor:
    """``t`` with zeros after its end along ``dim`` up to ``length``."""
    if t.size(dim) == length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.size(dim)
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def cat_padded(a: Tensor, b: Tensor, source_dim: int, rows_dim: int) -> Tensor:
    """Two batches' tensors one after the other along ``rows_dim``; the shorter source (along
    ``source_dim``) is padded at its end."""
    source = max(a.size(source_dim), b.size(source_dim))
    return torch.cat([padded_to(a, source, source_dim), padded_to(b, source, source_dim)],
                     dim=rows_dim)


def joined_padding(pad_a: Optional[Tensor], pad_b: Optional[Tensor], rows_a: int, rows_b: int,
                   length_a: int, length_b: int, device) -> Optional[Tensor]:
    """The (B, S) source padding of two batches one after the other (True: not a source
    position), the shorter source padded at its end; None where neither batch has any and
    their sources are as long."""
    if pad_a is None and pad_b is None and length_a == length_b:
        return None
    source = max(length_a, length_b)

    def whole(pad: Optional[Tensor], rows: int, length: int) -> Tensor:
        out = torch.ones(rows, source, dtype=torch.bool, device=device)
        out[:, :length] = False if pad is None else pad.view(rows, length)
        return out

    return torch.cat([whole(pad_a, rows_a, length_a), whole(pad_b, rows_b, length_b)], dim=0)


def join_sources(keys_a: List[Tensor], values_a: List[Tensor], pad_a: Optional[Tensor],
                 keys_b: List[Tensor], values_b: List[Tensor], pad_b: Optional[Tensor],
                 rows_a: int, rows_b: int, source_dim: int, rows_dim: int):
    """Two batches' projected encoder keys and values per layer, one batch after the other;
    the shorter source is padded at its end. Returns the keys, the values and the (B, S) source
    padding (True: not a source position; None: no row has any)."""
    keys = [cat_padded(a, b, source_dim, rows_dim) for a, b in zip(keys_a, keys_b)]
    values = [cat_padded(a, b, source_dim, rows_dim) for a, b in zip(values_a, values_b)]
    pad = joined_padding(pad_a, pad_b, rows_a, rows_b, keys_a[0].size(source_dim),
                         keys_b[0].size(source_dim), keys[0].device)
    return keys, values, pad


class LeanCache:
    """Decoder state of one batch for :class:`LeanBlockDecoder`.

    keys/values[i]: (B * heads, T, head_dim) of layer i's self-attention, T = cached steps.
    masked: (B, T) True for entries a row must not attend to (rolled-back holes), or None when
    no row has any. enc_keys/enc_values[i]: layer i's projected encoder output (B * heads, S,
    head_dim); enc_pad: (B, S) source padding or None.
    """

    def __init__(self):
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.masked: Optional[Tensor] = None
        self.enc_keys: List[Tensor] = []
        self.enc_values: List[Tensor] = []
        self.enc_pad: Optional[Tensor] = None
        self.batch = 0

    @property
    def length(self) -> int:
        return self.keys[0].size(1) if self.keys else 0


class LeanBlockDecoder(BlockDecoder):
    """:class:`BlockDecoder` with the lean step; same interface, a :class:`LeanCache` as state."""

    def __init__(self, decoder):
        super().__init__(decoder)
        self.layers = list(decoder.layers)
        self.heads = self.layers[0].self_attn.num_heads if self.layers else 1
        self._projection = None

    def new_state(self, max_len: Optional[int] = None) -> LeanCache:  # grows as rows do
        return LeanCache()

    @property
    def one_position_exact(self) -> bool:
        """On the CPU the vocabulary projection runs through its own kernel (output_projection.py),
        which rounds otherwise than fairseq's ``F.linear``; elsewhere the layers and the output
        layer are fairseq's operations."""
        return (plain_output_projection(self.decoder) is None
                or self.decoder.embed_tokens.weight.device.type != "cpu")

    def logits(self, features: Tensor) -> Tensor:
        """The output layer; a block's rows on the CPU go through a transposed copy of the
        output embedding (output_projection.py). Checked per call: an output layer replaced
        after this step was built is honoured."""
        proj = plain_output_projection(self.decoder)
        if proj is None:
            return super().logits(features)
        projection = self._projection  # read once: another thread may replace it
        if projection is None or projection.projection is not proj:
            projection = self._projection = OutputProjection(proj)
        return projection(features)

    # ------------------------------------------------------------------ forward
    def _project_encoder(self, cache: LeanCache, encoder_out, bsz: int):
        enc, enc_pad = encoder_states(encoder_out)  # (S, B, C), (B, S)
        # fairseq's encoder mask is applied only where it masks something (same values)
        cache.enc_pad = enc_pad.bool() if enc_pad is not None and bool(enc_pad.any()) else None
        for layer in self.layers:
            attn = layer.encoder_attn
            k = attn.k_proj(enc)
            v = attn.v_proj(enc)
            cache.enc_keys.append(k.contiguous().view(-1, bsz * attn.num_heads, attn.head_dim).transpose(0, 1))
            cache.enc_values.append(v.contiguous().view(-1, bsz * attn.num_heads, attn.head_dim).transpose(0, 1))
        cache.batch = bsz

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, bsz: int, length: int, embed_dim: int,
                causal: Optional[Tensor], masked: Optional[Tensor]) -> Tensor:
        """Scaled dot-product attention exactly as ``MultiheadAttention.forward`` computes it,
        up to (not including) the output projection: (L, B, embed_dim)."""
        src_len = k.size(1)
        weights = torch.bmm(q, k.transpose(1, 2))
        if causal is not None:
            weights += causal.unsqueeze(0)
        if masked is not None:
            weights = weights.view(bsz, -1, length, src_len).masked_fill(
                masked.unsqueeze(1).unsqueeze(2), float("-inf")
            ).view(-1, length, src_len)
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).type_as(weights)
        out = torch.bmm(probs, v)
        return out.transpose(0, 1).contiguous().view(length, bsz, embed_dim)

    def forward_packed(self, tokens, start, layout: BlockLayout, encoder_out, cache: LeanCache,
                       steps: Optional[Tensor] = None, block_mask: Optional[Tensor] = None,
                       cache_only: bool = False):
        """Features (N, d) at the block's real positions, packed as ``layout`` says.

        Position-wise work (projections, feed-forward, layer norms) runs on the real positions
        only; attention runs on the (L, B) grid, with padding masked as a key and its query
        outputs dropped. A block without padding runs exactly the module path's shapes.

        By default block position i of row b is decoder step ``start[b] + i`` and the block is
        causal. A block-causal drafter (``glat_drafter`` with block-causal attention) gives its
        own (B, L) ``steps`` and an additive (L, L) ``block_mask`` for attention inside the block
        (the cache stays visible to every position).

        ``cache_only``: only what later calls read is computed, every layer's keys and values
        (the last layer's query, attention and feed-forward are skipped), and None is returned.
        """
        dec = self.decoder
        bsz, length = tokens.size()
        block_pad = layout.block_pad
        if not cache.enc_keys:
            self._project_encoder(cache, encoder_out, bsz)
        if steps is None:
            steps = start.unsqueeze(1) + torch.arange(length, device=tokens.device)
        positions = steps + self.padding_idx + 1
        if not layout.dense:
            positions = positions.masked_fill(block_pad, self.padding_idx + 1)
            tokens = tokens.masked_fill(block_pad, self.padding_idx)
        x = self.embed(tokens, positions).transpose(0, 1)
        if not layout.dense:
            x = layout.pack_time_major(x)
        grid, ungrid = layout.unpack_time_major, layout.pack_time_major
        if layout.dense:
            grid = ungrid = _same

        cached = cache.length
        causal = None
        if block_mask is not None:
            causal = x.new_zeros(length, cached + length)
            causal[:, cached:] = block_mask
        elif length > 1:
            causal = x.new_zeros(length, cached + length)
            causal[:, cached:] = torch.triu(x.new_full((length, length), float("-inf")), diagonal=1)
        masked = cache.masked
        if not layout.dense or masked is not None:
            if masked is None:
                masked = block_pad.new_zeros(bsz, cached)
            masked = torch.cat([masked, block_pad], dim=1)
        cache.masked = masked

        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            heads, head_dim = attn.num_heads, attn.head_dim
            residual = x
            if layer.normalize_before:
                x = layer.self_attn_layer_norm(x)
            if cache_only and i == last:
                self._append_keys_values(cache, i, grid(attn.k_proj(x)), grid(attn.v_proj(x)),
                                         bsz, heads, head_dim, cached)
                return None
            q = grid(attn.q_proj(x))
            k = grid(attn.k_proj(x))
            v = grid(attn.v_proj(x))
            q *= attn.scaling
            q = q.contiguous().view(length, bsz * heads, head_dim).transpose(0, 1)
            k, v = self._append_keys_values(cache, i, k, v, bsz, heads, head_dim, cached)
            x = attn.out_proj(ungrid(self._attend(q, k, v, bsz, length, attn.embed_dim, causal, masked)))
            x = residual + x
            if not layer.normalize_before:
                x = layer.self_attn_layer_norm(x)

            cross = layer.encoder_attn
            residual = x
            if layer.normalize_before:
                x = layer.encoder_attn_layer_norm(x)
            q = grid(cross.q_proj(x))
            q *= cross.scaling
            q = q.contiguous().view(length, bsz * cross.num_heads, cross.head_dim).transpose(0, 1)
            x = self._attend(q, cache.enc_keys[i], cache.enc_values[i], bsz, length,
                             cross.embed_dim, None, cache.enc_pad)
            x = residual + cross.out_proj(ungrid(x))
            if not layer.normalize_before:
                x = layer.encoder_attn_layer_norm(x)

            residual = x
            if layer.normalize_before:
                x = layer.final_layer_norm(x)
            x = layer.fc2(layer.activation_fn(layer.fc1(x)))
            x = residual + x
            if not layer.normalize_before:
                x = layer.final_layer_norm(x)
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        if layout.dense:
            x = x.reshape(length * bsz, -1)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        return x

    @staticmethod
    def _append_keys_values(cache: LeanCache, i: int, k: Tensor, v: Tensor, bsz: int, heads: int,
                            head_dim: int, cached: int) -> Tuple[Tensor, Tensor]:
        """Layer ``i``'s keys and values (L, B, C) appended to its cache (as fairseq's
        incremental attention concatenates them); returns the layer's whole keys and values."""
        k = k.contiguous().view(-1, bsz * heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * heads, head_dim).transpose(0, 1)
        if cached:
            k = torch.cat([cache.keys[i], k], dim=1)
            v = torch.cat([cache.values[i], v], dim=1)
            cache.keys[i], cache.values[i] = k, v
        else:
            cache.keys.append(k)
            cache.values.append(v)
        return k, v

    def forward_block(self, tokens, start, block_pad, encoder_out, cache: LeanCache):
        layout = BlockLayout(block_pad)
        return layout.unpack(self.forward_packed(tokens, start, layout, encoder_out, cache))

    def reads_encoder_out(self, cache: LeanCache) -> bool:
        # the encoder's keys and values are projected into the cache by the batch's first call
        return not cache.enc_keys

    # ------------------------------------------------------------------ cache surgery
    def cache_length(self, cache: LeanCache) -> int:
        return cache.length

    def valid_mask(self, cache: LeanCache) -> Optional[Tensor]:
        if not cache.keys:
            return None
        if cache.masked is None:
            return torch.ones(cache.batch, cache.length, dtype=torch.bool, device=cache.keys[0].device)
        # (the fast step's mask has room past the entries in use)
        return ~cache.masked[:, : cache.length]

    def rollback(self, cache: LeanCache, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None):
        total = cache.length
        first = total - block_len
        fewest, kept_cols = keep_bounds(keep, keep_range)
        new_total = first + kept_cols
        if fewest < kept_cols:  # rows keeping fewer entries leave masked holes
            cols = torch.arange(block_len, device=keep.device)
            drop = cols.unsqueeze(0) >= keep.unsqueeze(1)
            masked = cache.masked
            if masked is None:
                masked = drop.new_zeros(keep.size(0), total)
            else:
                masked = masked.clone()
            masked[:, first:] |= drop
            cache.masked = masked
        if cache.masked is not None:
            cache.masked = cache.masked[:, :new_total]
        cache.keys = [k[:, :new_total] for k in cache.keys]
        cache.values = [v[:, :new_total] for v in cache.values]

    def drop_columns(self, cache: LeanCache, first: int, count: int):
        """Remove cache entries ``first .. first + count - 1`` of every row (a block-causal
        drafter's mask slots: no later position may attend to them)."""
        def cut(t: Tensor) -> Tensor:
            return torch.cat([t[:, :first], t[:, first + count:]], dim=1)

        cache.keys = [cut(k) for k in cache.keys]
        cache.values = [cut(v) for v in cache.values]
        if cache.masked is not None:
            masked = cut(cache.masked)
            cache.masked = masked if bool(masked.any()) else None

    def compact(self, cache: LeanCache, min_holes: float = 0.5):
        if cache.masked is None:
            return
        valid = ~cache.masked
        total = valid.size(1)
        counts = valid.sum(1)
        longest = int(counts.max()) if counts.numel() else 0
        if bool((counts == total).all()):
            cache.masked = None  # holes all cut off by rollbacks
            return
        if total - longest < max(1, min_holes * total):
            return
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        bh = order.size(0) * self.heads
        index = order.repeat_interleave(self.heads, dim=0).unsqueeze(-1)
        for i in range(len(cache.keys)):
            key, value = cache.keys[i], cache.values[i]
            idx = index.expand(bh, longest, key.size(2))
            cache.keys[i] = key.gather(1, idx)
            cache.values[i] = value.gather(1, idx)
        masked = cache.masked.gather(1, order)
        cache.masked = masked if bool(masked.any()) else None

    joins_rows = True

    def join_rows(self, cache: LeanCache, encoder_out, rows: int, sources=None):
        """``rows`` rows join the batch of ``cache`` (a batch that has run), after its rows:
        their encoder keys and values are projected, and the entries before their first are
        masked (holes: each row's positions are its own length, never the cache's)."""
        new = LeanCache()
        self._project_encoder(new, encoder_out, rows)
        old, heads, length = cache.batch, self.heads, cache.length
        cache.enc_keys, cache.enc_values, cache.enc_pad = join_sources(
            cache.enc_keys, cache.enc_values, cache.enc_pad, new.enc_keys, new.enc_values,
            new.enc_pad, old, rows, source_dim=1, rows_dim=0)

        def grown(t: Tensor) -> Tensor:
            return torch.cat([t, t.new_zeros(rows * heads, length, t.size(2))], dim=0)

        cache.keys = [grown(k) for k in cache.keys]
        cache.values = [grown(v) for v in cache.values]
        if length:
            masked = cache.masked
            if masked is None:
                masked = torch.zeros(old, length, dtype=torch.bool, device=cache.keys[0].device)
            cache.masked = torch.cat([masked, masked.new_ones(rows, length)], dim=0)
        cache.batch = old + rows

    def reorder(self, cache: LeanCache, new_order: Tensor):
        """Keep (and reorder) batch rows; used when finished rows leave the batch."""
        heads = self.heads
        old = cache.batch

        def pick(t: Tensor) -> Tensor:
            return t.view(old, heads, t.size(1), t.size(2)).index_select(0, new_order).view(
                -1, t.size(1), t.size(2))

        cache.keys = [pick(k) for k in cache.keys]
        cache.values = [pick(v) for v in cache.values]
        cache.enc_keys = [pick(k) for k in cache.enc_keys]
        cache.enc_values = [pick(v) for v in cache.enc_values]
        if cache.masked is not None:
            cache.masked = cache.masked.index_select(0, new_order)
        if cache.enc_pad is not None:
            cache.enc_pad = cache.enc_pad.index_select(0, new_order)
        cache.batch = new_order.numel()
