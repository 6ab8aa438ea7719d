"""The fast decoder step: a static key/value cache, fused projections, one attention kernel.

:class:`~fairseq_pardec.decoding.step.lean.LeanBlockDecoder` repeats fairseq's operations in
fairseq's order, so that its features are bit for bit the module path's. That order costs: the
cache grows by ``torch.cat`` in every layer of every step (the whole cache is copied each time),
three separate query/key/value products per layer, the query scaled after its product, attention
as ``bmm`` / mask / softmax / ``bmm``. :class:`FastBlockDecoder` computes the same function in
fewer, larger operations:

* the self-attention keys and values live in buffers allocated once per batch, ``(B, heads,
  capacity, head_dim)`` per layer; a block is written in place at the cache's end, and a rollback
  only moves the end back (rejected entries are overwritten by the next block);
* one product per layer produces queries, keys and values together, from a concatenated weight
  with the query scaling folded in; each product runs on the kernel measured faster on this
  machine for its number of rows, MKL's ``addmm`` on a transposed weight, oneDNN's product on
  a packed one with ReLU fused, or the project's native kernel (cpu/products.py);
* where the products run on the native kernel, the whole call does: the block's input and every
  layer in one native call (cpu/layer_stack.py, native/layers.c), no torch operation between;
* otherwise attention is one fused kernel (``F.scaled_dot_product_attention``) for one row, and
  product / softmax / product with an additive mask for a batch (:func:`_attention`), with a mask
  only where one is needed (a block of several positions, rolled-back holes, a ragged block,
  padded sources);
* the encoder's keys and values are projected once per batch (and the encoder itself runs on the
  same kernels: cpu/fast_encoder.py).

The result is the same function rounded differently (folded scaling, fused products, another
softmax kernel): its log-probabilities differ from fairseq's by a few 1e-6 in float32 (measured
in tests/test_fast_step.py and docs/methods.md). The engine therefore trusts its choice of token
only where the best candidate leads the runner-up by more than :data:`DEFAULT_MARGIN` and decides
the rare closer calls with fairseq's own arithmetic (draft_verify/engine.py, "margin guard").

It covers what :func:`~fairseq_pardec.decoding.step.lean.lean_supported` covers, in float32
on the CPU; elsewhere the engine uses the lean step.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.block_decoder import keep_bounds, normalised
from fairseq_pardec.decoding.cpu.layer_stack import NativeLayerStack
from fairseq_pardec.decoding.step.lean import (LeanBlockDecoder, join_sources, joined_padding,
                                               lean_supported)
from fairseq_pardec.decoding.step.margins import CPU_FP32_MARGIN
from fairseq_pardec.decoding.step.output_projection import plain_output_projection
from fairseq_pardec.decoding.cpu.products import (NATIVE, PACK_BELOW, FeedForward, KernelChoice,
                                                  Linear, query_key_value)
from fairseq_pardec.decoding.step.weights_key import PREPARE_LOCK, WeightsKey
from fairseq_pardec.models.decoder_inputs import (encoder_states, final_features, plain_input,
                                                   position_embeddings)

# A bound on |fast log-prob - fairseq log-prob| in float32, with a wide safety factor. The fast
# encoder and step together, against fairseq's encoder and decoder, differed by at most 4.6e-5 on
# 160 UA-GEC and 1.2e-5 on 160 ddtp test sentences (d256 models, at the best five tokens of every
# position as at all; the step alone on fairseq's encoder output: 1.5e-5 and 8.6e-6);
# tests/test_fast_step.py asserts the measured difference stays under a tenth of the margin. It is
# the floor of the margin in force on a model (step/calibration.py).
DEFAULT_MARGIN = CPU_FP32_MARGIN

_INITIAL_CAPACITY = 64


def fast_supported(decoder) -> bool:
    """True when :class:`FastBlockDecoder` computes what fairseq's decoder computes."""
    if not lean_supported(decoder):
        return False
    if decoder.quant_noise is not None:
        return False
    weight = decoder.embed_tokens.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class _Layer:
    """One decoder layer's weights in the layout the fast step multiplies with."""

    def __init__(self, layer):
        attn, cross = layer.self_attn, layer.encoder_attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.embed_dim = attn.embed_dim
        self.qkv = query_key_value(attn)
        self.out = Linear(attn.out_proj.weight, attn.out_proj.bias)
        self.cross_heads, self.cross_head_dim = cross.num_heads, cross.head_dim
        self.cross_q = Linear(cross.q_proj.weight * cross.scaling, cross.q_proj.bias * cross.scaling)
        self.cross_out = Linear(cross.out_proj.weight, cross.out_proj.bias)
        # the encoder's keys and values in one product, once per batch
        self.cross_kv = Linear(torch.cat([cross.k_proj.weight, cross.v_proj.weight]),
                               torch.cat([cross.k_proj.bias, cross.v_proj.bias]))
        self.ffn = FeedForward(layer)
        self.pre_norm = layer.normalize_before
        self.norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm)

    def products(self) -> List[Linear]:
        """The layer's linear maps in the order a step calls them."""
        return [self.qkv, self.out, self.cross_q, self.cross_out, self.ffn.fc1, self.ffn.fc2]


class FastCache:
    """One batch's decoder state for :class:`FastBlockDecoder`.

    keys/values[i]: (B, heads, capacity, head_dim) buffers of layer i; entries ``[0, length)``
    are the cache, the rest is scratch. masked: (B, capacity) True for entries a row must not
    attend to (rolled-back holes, padding of a ragged block), or None while no row has any.
    enc_keys/enc_values[i]: (B, heads, S, head_dim); enc_attend: (B, 1, 1, S) True where a
    source position is real, or None without source padding.

    Where buffers change (grown, reordered), their list is replaced, never an item of it: the
    native step's table of their addresses is kept while the lists are the same
    (cpu/layer_stack.py, ``NativeLayerStack._state_table``).
    """

    def __init__(self):
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.length = 0
        self.masked: Optional[Tensor] = None
        # per row, how many entries of ``masked[:, :length]`` are set, as the rollbacks left
        # them (None: to be counted): the engine's per-iteration bookkeeping of holes, kept on
        # the host where a few list operations cost less than the tensor operations
        self.holes: Optional[List[int]] = None
        self.enc_keys: List[Tensor] = []
        self.enc_values: List[Tensor] = []
        self.enc_attend: Optional[Tensor] = None
        self.batch = 0
        # the weights the batch decodes with (_Weights), taken when it starts: a batch never
        # mixes two versions of the weights, and another thread rebuilding them for its own
        # batch changes nothing in this one
        self.weights: Optional["_Weights"] = None
        # the decoder input's tables for the native step (NativeLayerStack.input_tables), looked
        # up when the batch starts, and the native call's table of this cache's buffers
        # (cpu/layer_stack.py)
        self.input_tables = None
        self.native_state = None
        # and its table of sizes with the table's address, filled per call
        # (NativeLayerStack.__call__)
        self.native_dims = None

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2) if self.keys else 0


def _with_rows(t: Tensor, old: int, total: int) -> Tensor:
    """``t``'s ``old`` rows (dim 0) and ``total - old`` zero rows after them: in place where
    its storage has room past them (rows that left a running batch leave theirs), else in a
    buffer with room for half as many again, so that rows joining a running batch one by one
    do not copy every row's entries each time."""
    shape = (total,) + tuple(t.shape[1:])
    per_row = t[0].numel() if t.size(0) else math.prod(shape[1:])
    if (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() >= total * per_row * t.element_size()):
        out = t.new_empty(0).set_(t.untyped_storage(), 0, shape)
    else:
        out = t.new_empty((total + max(total // 2, 1),) + shape[1:])[:total]
        out[:old] = t[:old]
    out[old:].zero_()  # a masked entry's value is multiplied by 0: it must be finite
    return out


def _additive(allowed: Optional[Tensor]) -> Optional[Tensor]:
    """A boolean "may attend" mask as the additive float mask attention adds (0 / -inf)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=torch.float32,
                       device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    """softmax(q k^T + mask) v over (B, heads, L, head_dim) queries (already scaled).

    For one row the fused kernel (``scaled_dot_product_attention``) is as fast as the
    alternatives; for a batch of rows its CPU kernel is slower than two batched products and a
    softmax, which a step of many rows and short blocks feels (where longer blocks make the
    products dominate, it does not).
    """
    if q.size(0) == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    weights = torch.matmul(q, k.transpose(-1, -2))
    if mask is not None:
        weights.add_(mask)
    return torch.matmul(weights.softmax(dim=-1), v)




class ProjectedSources:
    """Rows' encoder keys and values of every layer, projected ahead of their join
    (:meth:`FastBlockDecoder.project_sources`) with ``weights``: enc_keys/enc_values[i] (B,
    heads, S, head_dim), enc_attend (B, 1, 1, S) or None, as :class:`FastCache` holds them."""

    def __init__(self, weights, enc_keys: List[Tensor], enc_values: List[Tensor],
                 enc_attend: Optional[Tensor]):
        self.weights, self.enc_keys, self.enc_values = weights, enc_keys, enc_values
        self.enc_attend = enc_attend

    def take(self, order: Tensor, columns: slice) -> "ProjectedSources":
        """Rows ``order``, cut to the source ``columns`` (encoded_rows.EncodedRows.take)."""
        def rows(t: Tensor) -> Tensor:
            return t.index_select(0, order)[:, :, columns].contiguous()

        attend = self.enc_attend
        if attend is not None:
            attend = attend.index_select(0, order)[..., columns]
            if bool(attend.all()):
                attend = None
            else:
                attend = attend.contiguous()
        return ProjectedSources(self.weights, [rows(k) for k in self.enc_keys],
                                [rows(v) for v in self.enc_values], attend)

class _Weights:
    """The weights in the fast layouts, built together and never changed afterwards: the
    layers, their native call (or None), the output projection (or None: the decoder's own
    output layer runs) and the module it was built from. ``key`` is the :class:`WeightsKey`
    they were built at; ``held`` keeps that key exact while they live (WeightsKey.hold)."""

    def __init__(self, key, held, layers: List[_Layer], stack: Optional[NativeLayerStack],
                 projection, vocab: Optional[Linear]):
        self.key, self.held = key, held
        self.layers, self.stack = layers, stack
        self.projection, self.vocab = projection, vocab


class FastBlockDecoder(LeanBlockDecoder):
    """The draft-and-verify engine's decoder step (same interface as :class:`LeanBlockDecoder`).

    ``exact`` is the step the engine falls back on to decide close calls: fairseq's arithmetic.
    """

    fast = True
    # fused, reordered products at every position (step/margins.py)
    margin = DEFAULT_MARGIN
    one_position_exact = False

    def __init__(self, decoder):
        super().__init__(decoder)
        # the layers' weights and the output projection's, one key for both (the projection's
        # module looked up per batch: an output layer replaced after this step was built is
        # honoured)
        self._layers_key = WeightsKey(self.decoder.layers)
        self._projection_keys = {}  # id(projection module) -> (module, its WeightsKey)
        self._weights: Optional[_Weights] = None
        # which kernel multiplies how many rows: measured on this decoder (cpu/products.py),
        # for the layers' products and for the output projection apart (another shape)
        self.kernels = KernelChoice()
        self.projection_kernels = KernelChoice()
        # what one thread's batch read last: the output projection its batch decodes with
        # (set by forward_packed, read by logits) and the one its latest logits came from
        # (read by scores_kernel); per thread, so that threads sharing this step each read
        # their own batch's
        # the layers as one native call, where native/layers.c computes them (cpu/layer_stack.py)
        self.native_stack = True

    def new_state(self, max_len: Optional[int] = None) -> FastCache:  # grows as rows do
        return FastCache()

    def _own_projection(self):
        """The decoder's output projection as an ``nn.Linear`` when the fast step computes the
        output layer itself (a plain projection, float32 on the CPU), else None."""
        proj = plain_output_projection(self.decoder)
        if proj is None or proj.weight.device.type != "cpu" or proj.weight.dtype != torch.float32:
            return None
        return proj

    def _projection_key(self, projection) -> Optional[WeightsKey]:
        if projection is None:
            return None
        known = self._projection_keys.get(id(projection))
        if known is None or known[0] is not projection:
            known = (projection, WeightsKey(projection))
            self._projection_keys = {id(projection): known}
        return known[1]

    def _key(self, projection_key: Optional[WeightsKey]):
        """The key of the layers' weights and the output projection's."""
        return (self._layers_key.key(),
                None if projection_key is None else projection_key.key())

    def _prepared(self) -> _Weights:
        """The weights in the fast layouts, rebuilt when any may have changed (weights_key.py
        says what that covers); called once per batch."""
        projection = self._own_projection()
        projection_key = self._projection_key(projection)
        key = self._key(projection_key)
        weights = self._weights
        if (weights is not None and weights.key == key and weights.projection is projection
                and not self.kernels.stale() and not self.projection_kernels.stale()):
            return weights
        with PREPARE_LOCK:
            key = self._key(projection_key)  # again: another thread may have rebuilt meanwhile
            weights = self._weights
            if weights is None or weights.key != key or weights.projection is not projection:
                held = self._layers_key.hold()
                if projection_key is not None:
                    held += projection_key.hold()
                with torch.no_grad():
                    layers = [_Layer(layer) for layer in self.layers]
                    stack = None
                    if NativeLayerStack.supports(layers):
                        stack = NativeLayerStack(layers[0].qkv.native, layers)
                    vocab = None if projection is None else Linear(projection.weight, None)
                weights = _Weights(key, held, layers, stack, projection, vocab)
            # measured on the first batch and again at another thread count, not when only
            # the weights' values changed (the kernels' speed depends on the shapes)
            if self.kernels.stale() or self.projection_kernels.stale():
                self._measure_kernels(weights.layers, weights.vocab)
            self._weights = weights
        return weights

    def _measure_kernels(self, layers: List[_Layer], vocab: Optional[Linear]):
        chain = [layer.products() for layer in layers]
        rows_of = {}

        def rows(count: int, width: int) -> Tensor:
            if (count, width) not in rows_of:
                rows_of[count, width] = torch.zeros(count, width)
            return rows_of[count, width]

        def project(count: int):
            if vocab is not None:
                vocab(rows(count, vocab.in_features),
                      self.projection_kernels.kernel_for(count))

        def layers(count: int):
            kernel = self.kernels.kernel_for(count)
            for layer in chain:
                for lin in layer:
                    lin(rows(count, lin.in_features), kernel)

        self.kernels.measure(chain, project)
        self.projection_kernels.measure([[vocab]] if vocab is not None else [], layers)

    def pin_kernel(self, kernel: str):
        """Run every product, the projection's included, on ``kernel`` (tests, comparisons)."""
        self.kernels.pin(kernel)
        self.projection_kernels.pin(kernel)

    def logits(self, features: Tensor, vocab=None) -> Tensor:
        """The output layer, on the kernel measured fastest for the projection at this many
        rows (an output layer replaced after this step was built is honoured). ``vocab``: the
        projection a batch started with (``FastCache.weights``), else the current one."""
        if vocab is None:
            vocab = self._prepared().vocab
        if vocab is None or features.dim() != 2 or features.dtype != torch.float32:
            return super().logits(features)
        return vocab(features, self.projection_kernels.kernel_for(features.size(0)))

    def log_probs(self, features: Tensor, temperature: float = 1.0,
                  state: Optional[FastCache] = None) -> Tensor:
        """fairseq's log-probabilities of ``features``; with the ``state`` they came from,
        through the projection its batch started with (weights do not change within one)."""
        weights = state.weights if state is not None else None
        if weights is not None and weights.vocab is None:  # the decoder's own output layer
            return normalised(super().logits(features), temperature)
        return normalised(self.logits(features, None if weights is None else weights.vocab),
                          temperature)

    def scores_kernel(self, state: Optional[FastCache] = None):
        """The native kernel for the best two scores per position (native/scores.c) of
        ``log_probs`` on ``state`` (without one: on a batch starting now), or None (a
        projection not this step's own, no native kernel, or products pinned to a library
        kernel)."""
        weights = state.weights if state is not None else None
        if weights is None:
            weights = self._prepared()
        if weights.vocab is None or self.projection_kernels.pinned_to_library():
            return None
        return weights.vocab.native

    # ------------------------------------------------------------------ forward
    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """embed_at's function (models/decoder_inputs.py) in fewer operations: the tables read
        with ``F.embedding`` / ``index_select`` rather than through their modules (a third of
        the time at batch 1), the same arithmetic in the same order. Decoders with anything
        else on the way in go through embed_at."""
        dec = self.decoder
        if not plain_input(dec):
            return super().embed(tokens, positions)
        x = dec.embed_scale * F.embedding(tokens, dec.embed_tokens.weight)
        pos = position_embeddings(dec, positions)
        if pos is not None:
            x += pos
        return x

    def _start(self, cache: FastCache, encoder_out, bsz: int, device, dtype):
        cache.weights = self._prepared()
        self._project_sources(cache, encoder_out, bsz)
        for layer in cache.weights.layers:
            shape = (bsz, layer.heads, _INITIAL_CAPACITY, layer.head_dim)
            cache.keys.append(torch.zeros(shape, device=device, dtype=dtype))
            cache.values.append(torch.zeros(shape, device=device, dtype=dtype))
        cache.batch = bsz

    def project_sources(self, encoder_out) -> ProjectedSources:
        """``encoder_out``'s keys and values of every layer, projected now with the current
        weights, for :meth:`join_rows` to take rows of (``ProjectedSources.take``): rows
        encoded ahead of their join are projected in one call, not a few at each join. A
        running batch on other weights projects its joiners again."""
        projected = FastCache()
        projected.weights = self._prepared()
        self._project_sources(projected, encoder_out, encoder_states(encoder_out)[0].size(1))
        return ProjectedSources(projected.weights, projected.enc_keys, projected.enc_values,
                                projected.enc_attend)

    def _project_sources(self, cache: FastCache, encoder_out, bsz: int):
        """The encoder's keys and values of every layer, with ``cache.weights``, into
        ``cache`` (and its source padding). Where the sources are mostly padding, the products
        run on their real positions alone, and the padding's keys and values are zeros (masked
        by ``enc_attend``)."""
        enc, enc_pad = encoder_states(encoder_out)  # (S, B, C), (B, S)
        cache.enc_attend = None
        real = None
        if enc_pad is not None:
            real = (~enc_pad.bool()).t().reshape(-1).nonzero().view(-1)  # time-major positions
            if real.numel() < enc_pad.numel():
                cache.enc_attend = (~enc_pad.bool()).view(bsz, 1, 1, -1)
            if real.numel() >= PACK_BELOW * enc_pad.numel():
                real = None
        source = enc.size(0)
        enc = enc.reshape(source * bsz, -1)
        if real is not None:
            enc = enc.index_select(0, real)
        for layer in cache.weights.layers:
            heads, head_dim = layer.cross_heads, layer.cross_head_dim
            kv = layer.cross_kv(enc, self.kernels.kernel_for(enc.size(0)))
            if real is not None:
                kv = kv.new_zeros(source * bsz, kv.size(1)).index_copy_(0, real, kv)
            kv = kv.view(source, bsz, 2, heads, head_dim).permute(2, 1, 3, 0, 4)
            cache.enc_keys.append(kv[0].contiguous())
            cache.enc_values.append(kv[1].contiguous())

    @staticmethod
    def _reserve(cache: FastCache, needed: int):
        """Grow the buffers (doubling) so that ``needed`` entries fit."""
        capacity = cache.capacity
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2

        def grow(t: Tensor) -> Tensor:
            out = t.new_zeros(t.size(0), t.size(1), capacity, t.size(3))
            out[:, :, : cache.length] = t[:, :, : cache.length]
            return out

        cache.keys = [grow(k) for k in cache.keys]
        cache.values = [grow(v) for v in cache.values]
        if cache.masked is not None:
            masked = cache.masked.new_zeros(cache.batch, capacity)
            masked[:, : cache.length] = cache.masked[:, : cache.length]
            cache.masked = masked

    @staticmethod
    def _mark_block(cache: FastCache, layout: BlockLayout, length: int):
        """Mark the padding of a ragged block in ``cache.masked`` (kept as None while no row
        has a masked entry)."""
        if not layout.dense or cache.masked is not None:
            if cache.masked is None:
                cache.masked = layout.block_pad.new_zeros(cache.batch, cache.capacity)
                cache.holes = [0] * cache.batch
            cache.masked[:, cache.length: cache.length + length] = layout.block_pad

    def _self_mask(self, cache: FastCache, layout: BlockLayout, length: int,
                   block_mask: Optional[Tensor]) -> Optional[Tensor]:
        """(B or 1, 1, L, T + L) True where a query may attend, or None for "everything"."""
        first = cache.length
        block_pad = layout.block_pad
        self._mark_block(cache, layout, length)
        total = first + length
        device = block_pad.device
        inside = None
        if block_mask is not None:
            inside = block_mask > float("-inf")
        elif length > 1:
            inside = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        if inside is None and cache.masked is None:
            return None
        mask = torch.ones(1, 1, length, total, dtype=torch.bool, device=device)
        if inside is not None:
            mask[..., first:] = inside
        if cache.masked is not None:
            mask = mask & ~cache.masked[:, :total].view(cache.batch, 1, 1, total)
        return mask

    def forward_packed(self, tokens, start, layout: BlockLayout, encoder_out, cache: FastCache,
                       steps: Optional[Tensor] = None, block_mask: Optional[Tensor] = None):
        """Features (N, d) at the block's real positions, packed as ``layout`` says (see
        :meth:`LeanBlockDecoder.forward_packed` for ``steps`` and ``block_mask``)."""
        dec = self.decoder
        bsz, length = tokens.size()
        if not cache.keys:
            self._start(cache, encoder_out, bsz, tokens.device, dec.embed_tokens.weight.dtype)
        # the weights are checked once per batch, when it starts
        weights = cache.weights
        layers = weights.layers
        first = cache.length
        total = first + length
        stack = (weights.stack if weights.stack is not None and self.native_stack
                 and block_mask is None else None)
        if stack is not None and steps is None and self.kernels.kernel_for(layout.size) == NATIVE:
            # the whole call natively: the block's input, then the layers
            # the input's tables, looked up once per batch (again where positions outgrow them)
            needed = first + length + dec.padding_idx + 1
            tables = cache.input_tables
            if tables is None or (tables[1] is not None and tables[1].size(0) < needed):
                tables = cache.input_tables = stack.input_tables(dec, needed)
            x = None
            if tables is not None:
                x = stack.block_input(dec, tokens, start, layout.index, layout.size, first,
                                      tables)
            if x is not None:  # a new buffer of this call's: the layers write over it
                self._reserve(cache, total)
                return self._native_layers(stack, x, cache, layout, length, owned=True)
        if steps is None:
            steps = start.unsqueeze(1) + torch.arange(length, device=tokens.device)
        positions = steps + self.padding_idx + 1
        if not layout.dense:
            positions = positions.masked_fill(layout.block_pad, self.padding_idx + 1)
            tokens = tokens.masked_fill(layout.block_pad, self.padding_idx)
        x = self.embed(tokens.t(), positions.t())  # (L, B, C): time-major, as the layout packs
        x = x.reshape(length * bsz, -1)
        if not layout.dense:
            x = x.index_select(0, layout.index)
        kernel = self.kernels.kernel_for(x.size(0))

        self._reserve(cache, total)
        if stack is not None and kernel == NATIVE:
            return self._native_layers(stack, x, cache, layout, length)
        mask = _additive(self._self_mask(cache, layout, length, block_mask))
        enc_mask = _additive(cache.enc_attend)
        grid = layout.unpack_time_major
        for i, layer in enumerate(layers):
            heads, head_dim = layer.heads, layer.head_dim
            norm_attn, norm_cross = layer.norms
            # self-attention: one product for queries, keys and values
            residual = x
            if layer.pre_norm:
                x = norm_attn(x)
            qkv = grid(layer.qkv(x, kernel)).view(length, bsz, 3, heads, head_dim)
            cache.keys[i][:, :, first:total] = qkv[:, :, 1].permute(1, 2, 0, 3)
            cache.values[i][:, :, first:total] = qkv[:, :, 2].permute(1, 2, 0, 3)
            q = qkv[:, :, 0].permute(1, 2, 0, 3)
            out = _attention(q, cache.keys[i][:, :, :total], cache.values[i][:, :, :total], mask)
            x = layer.out(self._pack(out, layout), kernel, add=residual)
            if not layer.pre_norm:
                x = norm_attn(x)
            # encoder attention over keys and values projected once per batch
            residual = x
            if layer.pre_norm:
                x = norm_cross(x)
            q = grid(layer.cross_q(x, kernel)).view(
                length, bsz, layer.cross_heads, layer.cross_head_dim).permute(1, 2, 0, 3)
            out = _attention(q, cache.enc_keys[i], cache.enc_values[i], enc_mask)
            x = layer.cross_out(self._pack(out, layout), kernel, add=residual)
            if not layer.pre_norm:
                x = norm_cross(x)
            x = layer.ffn(x, kernel)
        cache.length = total
        return final_features(dec, x, time_major=False)

    def _native_layers(self, stack: NativeLayerStack, x: Tensor, cache: FastCache,
                       layout: BlockLayout, length: int, owned: bool = False) -> Tensor:
        """The layers as one native call on the block's input rows ``x`` (the cache has room;
        ``owned``: ``x`` may be written over), then the decoder's final features."""
        first = cache.length
        self._mark_block(cache, layout, length)
        x = stack(x, cache, layout.index, layout.batch, first, length, owned)
        cache.length = first + length
        return final_features(self.decoder, x, time_major=False)

    @staticmethod
    def _pack(out: Tensor, layout: BlockLayout) -> Tensor:
        """(B, heads, L, head_dim) attention output -> (N, heads * head_dim), packed rows."""
        bsz, heads, length, head_dim = out.shape
        return layout.pack_time_major(out.permute(2, 0, 1, 3).reshape(length, bsz, heads * head_dim))

    # ------------------------------------------------------------------ cache surgery
    def reads_encoder_out(self, cache: FastCache) -> bool:
        # the encoder's keys and values are projected into the cache when the batch starts
        return not cache.keys

    def cache_length(self, cache: FastCache) -> int:
        return cache.length

    @staticmethod
    def _holes(cache: FastCache, end: int) -> List[int]:
        """Per row the masked entries before ``end``, as counted (or kept) on the host."""
        if cache.holes is None:
            cache.holes = cache.masked[:, :end].numpy().sum(1).tolist()
        return cache.holes

    def rollback(self, cache: FastCache, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None):
        """Of the last ``block_len`` entries keep the first ``keep[b]`` per row: the cache's
        end moves back to the longest kept row; shorter rows' rejected entries become holes."""
        first = cache.length - block_len
        fewest, kept_cols = keep_bounds(keep, keep_range)
        end = first + kept_cols
        if fewest < kept_cols:
            if cache.masked is None:
                cache.masked = torch.zeros(cache.batch, cache.capacity, dtype=torch.bool)
                cache.holes = [0] * cache.batch
            holes = self._holes(cache, first)
            # the block's entries up to the longest kept row: a row's first keep[b] are kept
            # (never padding: a ragged block pads a row after its real positions), the rest
            # are holes
            masked = cache.masked.numpy()
            for r, kept in enumerate(keep.tolist()):
                if kept < kept_cols:
                    masked[r, first + kept: end] = True
                    holes[r] += kept_cols - kept
        elif cache.masked is not None:  # every row keeps the block's entries up to the end
            self._holes(cache, first)
        cache.length = end
        if cache.masked is not None and not any(cache.holes):
            cache.masked = cache.holes = None

    def drop_columns(self, cache: FastCache, first: int, count: int):
        """Remove entries ``first .. first + count - 1`` of every row (a block-causal drafter's
        mask slots), moving the later entries forward."""
        end = cache.length
        for buffers in (cache.keys, cache.values):
            for t in buffers:
                t[:, :, first: end - count] = t[:, :, first + count: end].clone()
        if cache.masked is not None:
            cache.masked[:, first: end - count] = cache.masked[:, first + count: end].clone()
            cache.holes = None  # counted again when next needed
        cache.length = end - count
        if cache.masked is not None and not any(self._holes(cache, cache.length)):
            cache.masked = cache.holes = None

    def compact(self, cache: FastCache, min_holes: float = 0.5):
        if cache.masked is None:
            return
        total = cache.length
        # every row's entries but its holes: the longest row's count is what compaction keeps
        if min(self._holes(cache, total), default=0) < max(1, min_holes * total):
            return
        valid = ~cache.masked[:, :total]
        counts = valid.sum(1)
        longest = int(counts.max()) if counts.numel() else 0
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for buffers in (cache.keys, cache.values):
            for t in buffers:
                index = order.view(cache.batch, 1, longest, 1).expand(-1, t.size(1), -1, t.size(3))
                t[:, :, :longest] = t.gather(2, index)
        masked = cache.masked[:, :total].gather(1, order)
        cache.length = longest
        cache.masked[:, :longest] = masked
        cache.holes = None  # counted again when next needed
        if not bool(masked.any()):
            cache.masked = None

    joins_rows = True

    def join_rows(self, cache: FastCache, encoder_out, rows: int,
                  sources: Optional[ProjectedSources] = None):
        """``rows`` rows join the batch of ``cache`` (a batch that has run), after its rows,
        decoding with the batch's weights: their encoder keys and values are projected (or
        taken from ``sources``, projected ahead with the same weights), and the entries before
        their first are masked (holes)."""
        keys = cache.keys[0]
        if (sources is not None and sources.weights is cache.weights
                and sources.enc_keys[0].size(0) == rows):
            new = sources
        else:
            new = FastCache()
            new.weights = cache.weights
            self._project_sources(new, encoder_out, rows)
        old, length = cache.batch, cache.length
        source, theirs = cache.enc_keys[0].size(2), new.enc_keys[0].size(2)
        pad_a = None if cache.enc_attend is None else ~cache.enc_attend.view(old, -1)
        pad_b = None if new.enc_attend is None else ~new.enc_attend.view(rows, -1)
        if theirs <= source:  # their sources fit: written into the rows' room, padded
            def placed(mine: Tensor, their: Tensor) -> Tensor:
                out = _with_rows(mine, old, old + rows)
                out[old:, :, :theirs] = their
                return out

            cache.enc_keys = [placed(a, b) for a, b in zip(cache.enc_keys, new.enc_keys)]
            cache.enc_values = [placed(a, b) for a, b in zip(cache.enc_values, new.enc_values)]
            pad = joined_padding(pad_a, pad_b, old, rows, source, theirs, keys.device)
        else:  # a longer source: every row's are padded to it
            cache.enc_keys, cache.enc_values, pad = join_sources(
                cache.enc_keys, cache.enc_values, pad_a, new.enc_keys, new.enc_values, pad_b,
                old, rows, source_dim=2, rows_dim=0)
        cache.enc_attend = None if pad is None else (~pad).view(old + rows, 1, 1, -1)

        # new lists: the native step's table of the buffers is rebuilt (cpu/layer_stack.py)
        cache.keys = [_with_rows(k, old, old + rows) for k in cache.keys]
        cache.values = [_with_rows(v, old, old + rows) for v in cache.values]
        if length:
            if cache.masked is None:
                cache.masked = torch.zeros(old, cache.capacity, dtype=torch.bool,
                                           device=keys.device)
                cache.holes = [0] * old
            holes = self._holes(cache, length)
            fresh = cache.masked.new_zeros(rows, cache.capacity)
            fresh[:, :length] = True
            cache.masked = torch.cat([cache.masked[:old], fresh], dim=0)
            cache.holes = holes + [length] * rows
        elif cache.masked is not None:
            cache.masked = torch.cat([cache.masked[:old],
                                      cache.masked.new_zeros(rows, cache.capacity)], dim=0)
            if cache.holes is not None:
                cache.holes = cache.holes + [0] * rows
        cache.batch = old + rows

    def reorder(self, cache: FastCache, new_order: Tensor):
        """Keep (and reorder) batch rows; used when finished rows leave the batch.

        Rows leaving keep the others in order: then the rows before the first one leaving stay
        where they are, the later ones move up in place, and of the self-attention buffers only
        the entries in use move (a copy of whole buffers, capacity included, was a visible
        share of an iteration at batch 32)."""
        def pick(t: Tensor) -> Tensor:
            return t.index_select(0, new_order)

        order = new_order.tolist() if new_order.device.type == "cpu" else None
        kept = len(order) if order is not None else 0
        if order is not None and all(r == i or r >= kept for i, r in enumerate(order)):
            # rows from past the kept ones fill the places of rows that left (a running batch's
            # way: engine.Batch.keep): only those rows move
            places = [(i, r) for i, r in enumerate(order) if r != i]
            if places:
                def fill(t: Tensor, end: int) -> Tensor:
                    for to, come in places:  # a few rows: a copy each costs least
                        t[to, :, :end].copy_(t[come, :, :end])
                    return t[:kept]
            else:
                def fill(t: Tensor, end: int) -> Tensor:
                    return t[:kept]

            cache.keys = [fill(k, cache.length) for k in cache.keys]
            cache.values = [fill(v, cache.length) for v in cache.values]
            cache.enc_keys = [fill(k, k.size(2)) for k in cache.enc_keys]
            cache.enc_values = [fill(v, v.size(2)) for v in cache.enc_values]
        elif order is not None and all(a < b for a, b in zip(order, order[1:])):
            first = next((i for i, r in enumerate(order) if r != i), len(order))
            moved = new_order[first:]
            used = cache.length

            def keep(t: Tensor, end: int) -> Tensor:
                if first < len(order):
                    t[first: len(order), :, :end] = t[:, :, :end].index_select(0, moved)
                return t[: len(order)]

            cache.keys = [keep(k, used) for k in cache.keys]
            cache.values = [keep(v, used) for v in cache.values]
            cache.enc_keys = [keep(k, k.size(2)) for k in cache.enc_keys]
            cache.enc_values = [keep(v, v.size(2)) for v in cache.enc_values]
        else:
            cache.keys = [pick(k) for k in cache.keys]
            cache.values = [pick(v) for v in cache.values]
            cache.enc_keys = [pick(k) for k in cache.enc_keys]
            cache.enc_values = [pick(v) for v in cache.enc_values]
        if cache.masked is not None:
            cache.masked = pick(cache.masked)
            if cache.holes is not None:
                cache.holes = [cache.holes[i] for i in new_order.tolist()]
        if cache.enc_attend is not None:
            cache.enc_attend = pick(cache.enc_attend)
        cache.batch = new_order.numel()
