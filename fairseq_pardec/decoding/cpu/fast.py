"""The fast decoder step: a static key/value cache, fused projections, one attention kernel.

:class:`~fairseq_pardec.decoding.step.lean.LeanBlockDecoder` repeats fairseq's operations in
fairseq's order, so that its features are bit for bit the module path's. That order costs: the
cache grows by ``torch.cat`` in every layer of every step (the whole cache is copied each time),
three separate query/key/value products per layer, the query scaled after its product, attention
as ``bmm`` / mask / softmax / ``bmm``. :class:`FastBlockDecoder` computes the same function in
fewer, larger operations:

* the self-attention keys and values live in buffers allocated once per batch, ``(slots, heads,
  capacity, head_dim)`` per layer, one row a slot with a length of its own (:class:`FastCache`):
  a block is written in place after each row's entries, a rollback only sets the rows' lengths
  (rejected entries are overwritten by the next block), a finished row frees its slot and a
  joining row takes a free one, so no row's entries are ever copied, moved or compacted;
* one product per layer produces queries, keys and values together, from a concatenated weight
  with the query scaling folded in; each product runs on the kernel measured faster on this
  machine for its number of rows, MKL's ``addmm`` on a transposed weight, oneDNN's product on
  a packed one with ReLU fused, or the project's native kernel (cpu/products.py);
* where the products run on the native kernel, the whole call does: the block's input and every
  layer in one native call (cpu/layer_stack.py, native/layers.c), no torch operation between;
* otherwise the products run on a library kernel and the attention between them on the native
  kernel (the same code as the native call's, reading each row's slot); without the native
  kernel, or for a drafter's own block mask, attention is one fused kernel
  (``F.scaled_dot_product_attention``) for one row, and product / softmax / product with an
  additive mask for a batch (:func:`_attention`), on the rows' entries read in batch order;
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

import ctypes
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.block_decoder import keep_bounds, normalised
from fairseq_pardec.decoding.cpu.layer_stack import NativeLayerStack
from fairseq_pardec.native.library import (ATTENTION_DIMS, DECODER_CROSS, DECODER_SELF,
                                            native_kernel)
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported
from fairseq_pardec.decoding.step.margins import CPU_FP32_MARGIN
from fairseq_pardec.decoding.step.output_projection import plain_output_projection
from fairseq_pardec.decoding.cpu.products import (NATIVE, PACK_BELOW, FeedForward, KernelChoice,
                                                  Linear, query_key_value)
from fairseq_pardec.decoding.step.weights_key import PREPARE_LOCK, WeightsKey
from fairseq_pardec.models.decoder_inputs import (encoder_states, final_features, plain_input,
                                                   position_embeddings, residual_sublayer)

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
    """One batch's decoder state for :class:`FastBlockDecoder`: buffers of slots, one row a slot.

    keys/values[i]: (slots, heads, capacity, head_dim) buffers of layer i. Batch row b owns the
    slot ``slot_of[b]``, and its cache is that slot's entries ``[0, lengths[b])``: a row's
    entries are its own and contiguous, so a rollback sets its length (the next block
    overwrites the rejected entries), a row that leaves frees its slot, and a row that joins
    takes a free one. No entry of another row is copied or moved, and the cache has no holes.
    enc_keys/enc_values[i]: (slots, heads, S, head_dim); enc_attend: (slots, 1, 1, S) True
    where a source position is real, or None without source padding.

    Where buffers change (grown), their list is replaced, never an item of it: the native
    step's table of their addresses is kept while the lists are the same
    (cpu/layer_stack.py, ``NativeLayerStack._state_table``).
    """

    def __init__(self):
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.slot_of: List[int] = []
        self.free: List[int] = []  # slots no row owns
        self._lengths: List[int] = []
        # the latest block: each row's first entry, and its layout and length until the
        # lengths are read or a rollback sets them (a ragged block's counts are read only
        # where nothing rolls it back)
        self.block_first: Optional[List[int]] = None
        self._pending: Optional[Tuple[BlockLayout, int]] = None
        self._slots: Optional[Tensor] = None  # slot_of as a tensor, while slot_of is unchanged
        self.enc_keys: List[Tensor] = []
        self.enc_values: List[Tensor] = []
        self.enc_attend: Optional[Tensor] = None
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
    def batch(self) -> int:
        return len(self.slot_of)

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2) if self.keys else 0

    @property
    def slots(self) -> int:
        return self.keys[0].size(0) if self.keys else 0

    @property
    def lengths(self) -> List[int]:
        """Each row's cache entries."""
        if self._pending is not None:
            layout, length = self._pending
            if layout.dense:
                self._lengths = [first + length for first in self.block_first]
            else:
                counts = (~layout.block_pad).sum(1).tolist()
                self._lengths = [first + n for first, n in zip(self.block_first, counts)]
            self._pending = None
        return self._lengths

    def set_lengths(self, lengths: List[int]):
        self._lengths, self._pending = lengths, None

    def slot_tensor(self) -> Tensor:
        """``slot_of`` as an int64 tensor (the native calls read it)."""
        if self._slots is None:
            self._slots = torch.tensor(self.slot_of, dtype=torch.long)
        return self._slots

    def in_order(self) -> bool:
        """Whether row b owns slot b for every row (the buffers' first rows are the batch)."""
        return all(s == b for b, s in enumerate(self.slot_of))

    def rows_of(self, t: Tensor) -> Tensor:
        """The batch's rows of a (slots, ...) buffer, in batch order: a view where the rows own
        the first slots in order, else a copy."""
        if self.in_order():
            return t[: self.batch]
        return t.index_select(0, self.slot_tensor())


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
        # else the attention on the native kernel between library products, where it loads
        self.native_attention = True

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
        cache.slot_of = list(range(bsz))
        cache.set_lengths([0] * bsz)

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
        """Grow the buffers (doubling) so that ``needed`` entries fit in every slot."""
        capacity = cache.capacity
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2

        def grow(t: Tensor) -> Tensor:
            out = t.new_zeros(t.size(0), t.size(1), capacity, t.size(3))
            out[:, :, : t.size(2)] = t
            return out

        cache.keys = [grow(k) for k in cache.keys]
        cache.values = [grow(v) for v in cache.values]

    def _attention_kernel(self, block_mask: Optional[Tensor]):
        """The native kernel whose attention the torch path calls (None: torch's attention)."""
        if not self.native_attention or block_mask is not None:
            return None
        return native_kernel()

    def forward_packed(self, tokens, start, layout: BlockLayout, encoder_out, cache: FastCache,
                       steps: Optional[Tensor] = None, block_mask: Optional[Tensor] = None):
        """Features (N, d) at the block's real positions, packed as ``layout`` says (see
        :meth:`LeanBlockDecoder.forward_packed` for ``steps`` and ``block_mask``). Each row's
        block goes to its slot's entries from its own length on."""
        dec = self.decoder
        bsz, length = tokens.size()
        if not cache.keys:
            self._start(cache, encoder_out, bsz, tokens.device, dec.embed_tokens.weight.dtype)
        # the weights are checked once per batch, when it starts
        weights = cache.weights
        layers = weights.layers
        firsts = cache.lengths
        most = max(firsts)
        self._reserve(cache, most + length)
        cache.block_first = firsts
        cache._pending = (layout, length)
        row_first = torch.tensor(firsts, dtype=torch.long)
        stack = (weights.stack if weights.stack is not None and self.native_stack
                 and block_mask is None else None)
        if stack is not None and steps is None and self.kernels.kernel_for(layout.size) == NATIVE:
            # the whole call natively: the block's input, then the layers
            # the input's tables, looked up once per batch (again where positions outgrow them)
            needed = most + length + dec.padding_idx + 1
            tables = cache.input_tables
            if tables is None or (tables[1] is not None and tables[1].size(0) < needed):
                tables = cache.input_tables = stack.input_tables(dec, needed)
            x = None
            if tables is not None:
                x = stack.block_input(dec, tokens, start, layout.index, layout.size, most,
                                      tables)
            if x is not None:  # a new buffer of this call's: the layers write over it
                x = stack(x, cache, layout.index, layout.batch, row_first, length, owned=True)
                return final_features(dec, x, time_major=False)
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

        if stack is not None and kernel == NATIVE:
            x = stack(x, cache, layout.index, layout.batch, row_first, length)
            return final_features(dec, x, time_major=False)
        native = self._attention_kernel(block_mask)
        if native is not None:
            attend = _NativeAttention(native, cache, layout, row_first)
        else:
            attend = _TorchAttention(cache, layout, row_first, most + length, block_mask)
        for i, layer in enumerate(layers):
            norm_attn, norm_cross = layer.norms
            # self-attention: one product for queries, keys and values
            x = residual_sublayer(x, norm_attn, layer.pre_norm, lambda h, residual: layer.out(
                attend.self_attention(i, layer, layer.qkv(h, kernel)), kernel, add=residual))
            # encoder attention over keys and values projected once per batch
            x = residual_sublayer(x, norm_cross, layer.pre_norm, lambda h, residual: (
                layer.cross_out(attend.cross_attention(i, layer, layer.cross_q(h, kernel)),
                                kernel, add=residual)))
            x = layer.ffn(x, kernel)
        return final_features(dec, x, time_major=False)

    # ------------------------------------------------------------------ cache surgery
    def reads_encoder_out(self, cache: FastCache) -> bool:
        # the encoder's keys and values are projected into the cache when the batch starts
        return not cache.keys

    def cache_length(self, cache: FastCache) -> int:
        """The longest row's entries."""
        return max(cache.lengths, default=0)

    def rollback(self, cache: FastCache, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None):
        """Of the last block's ``block_len`` entries keep the first ``keep[b]`` per row: only
        the rows' lengths move (the next block overwrites the rest)."""
        firsts = cache.block_first
        if firsts is None:  # no block since the last rollback: the rows' own ends
            firsts = [n - block_len for n in cache.lengths]
        fewest, most = keep_bounds(keep, keep_range)
        if fewest == most:
            cache.set_lengths([first + most for first in firsts])
        else:
            cache.set_lengths([first + k for first, k in zip(firsts, keep.tolist())])
        cache.block_first = None

    def drop_columns(self, cache: FastCache, first: int, count: int):
        """Remove the first ``count`` positions of the block just decoded from every row (a
        block-causal drafter's mask slots), the row's later entries of that block moving
        forward to follow its cache. ``first``: :meth:`cache_length` before that block."""
        firsts, pending = cache.block_first, cache._pending
        if firsts is None or pending is None or first != max(firsts, default=0):
            raise ValueError("drop_columns removes columns of the block just decoded")
        layout, length = pending
        counts = ([length] * cache.batch if layout.dense
                  else (~layout.block_pad).sum(1).tolist())
        kept = length - count
        if kept > 0:
            start = torch.tensor(firsts, dtype=torch.long).unsqueeze(1)
            cols = torch.arange(kept).unsqueeze(0)
            target = start + cols
            source = (target + count).clamp_(max=cache.capacity - 1)
            slots = cache.slot_tensor().unsqueeze(1)
            for buffers in (cache.keys, cache.values):
                for t in buffers:
                    t[slots, :, target] = t[slots, :, source]
        cache.set_lengths([f + n - count for f, n in zip(firsts, counts)])
        cache.block_first = None

    def compact(self, cache: FastCache, min_holes: float = 0.5):
        """Nothing to do: rows have their own lengths, the cache has no holes."""

    joins_rows = True

    def _more_slots(self, cache: FastCache, needed: int):
        """Buffers with at least ``needed`` free slots: the slots so far keep their places
        (a copy of every buffer, with room for half as many rows again, so that rows joining
        one by one do not copy them each time)."""
        have = cache.slots
        total = max(have - len(cache.free) + needed, have + have // 2 + 1)

        def more(t: Tensor) -> Tensor:
            out = t.new_zeros((total,) + tuple(t.shape[1:]))
            out[:have] = t
            return out

        # new lists: the native step's table of the buffers is rebuilt (cpu/layer_stack.py)
        cache.keys = [more(k) for k in cache.keys]
        cache.values = [more(v) for v in cache.values]
        cache.enc_keys = [more(k) for k in cache.enc_keys]
        cache.enc_values = [more(v) for v in cache.enc_values]
        if cache.enc_attend is not None:
            attend = cache.enc_attend.new_ones((total,) + tuple(cache.enc_attend.shape[1:]))
            attend[:have] = cache.enc_attend
            cache.enc_attend = attend
        cache.free.extend(range(have, total))

    @staticmethod
    def _wider_sources(cache: FastCache, source: int):
        """Encoder buffers of ``source`` positions per slot, the added ones masked."""
        old = cache.enc_keys[0].size(2)

        def wider(t: Tensor) -> Tensor:
            out = t.new_zeros(t.size(0), t.size(1), source, t.size(3))
            out[:, :, :old] = t
            return out

        cache.enc_keys = [wider(k) for k in cache.enc_keys]
        cache.enc_values = [wider(v) for v in cache.enc_values]
        attend = torch.zeros(cache.slots, 1, 1, source, dtype=torch.bool,
                             device=cache.enc_keys[0].device)
        attend[..., :old] = True if cache.enc_attend is None else cache.enc_attend
        cache.enc_attend = attend

    def join_rows(self, cache: FastCache, encoder_out, rows: int,
                  sources: Optional[ProjectedSources] = None):
        """``rows`` rows join the batch of ``cache`` (a batch that has run), after its rows,
        decoding with the batch's weights: each takes a free slot (the buffers grow where none
        is left), and its encoder keys and values are projected into it (or taken from
        ``sources``, projected ahead with the same weights). No other row's entries move."""
        if (sources is not None and sources.weights is cache.weights
                and sources.enc_keys[0].size(0) == rows):
            new = sources
        else:
            new = FastCache()
            new.weights = cache.weights
            self._project_sources(new, encoder_out, rows)
        lengths = cache.lengths
        if len(cache.free) < rows:
            self._more_slots(cache, rows)
        cache.free.sort()
        taken, cache.free = cache.free[:rows], cache.free[rows:]
        theirs = new.enc_keys[0].size(2)
        if theirs > cache.enc_keys[0].size(2):  # a longer source: every slot's grow to it
            self._wider_sources(cache, theirs)
        source = cache.enc_keys[0].size(2)
        slots = torch.tensor(taken, dtype=torch.long)
        for mine, their in zip(cache.enc_keys + cache.enc_values, new.enc_keys + new.enc_values):
            mine[slots, :, :theirs] = their
        if new.enc_attend is not None or theirs < source:
            if cache.enc_attend is None:
                cache.enc_attend = torch.ones(cache.slots, 1, 1, source, dtype=torch.bool,
                                              device=cache.enc_keys[0].device)
            attend = torch.zeros(rows, 1, 1, source, dtype=torch.bool,
                                 device=cache.enc_attend.device)
            attend[..., :theirs] = True if new.enc_attend is None else new.enc_attend
            cache.enc_attend[slots] = attend
        elif cache.enc_attend is not None:
            cache.enc_attend[slots] = True
        cache.slot_of = cache.slot_of + taken
        cache._slots = None
        cache.set_lengths(lengths + [0] * rows)
        cache.block_first = None

    def reorder(self, cache: FastCache, new_order: Tensor):
        """Keep (and reorder) batch rows; used when finished rows leave the batch: their slots
        are free, and nothing is copied."""
        order = new_order.tolist()
        if len(set(order)) != len(order):
            raise ValueError("the fast step's rows own their slots: a row cannot be kept twice")
        lengths = cache.lengths
        kept = [cache.slot_of[i] for i in order]
        cache.free.extend(sorted(set(cache.slot_of) - set(kept)))
        cache.slot_of = kept
        cache._slots = None
        cache.set_lengths([lengths[i] for i in order])
        if cache.block_first is not None:
            cache.block_first = [cache.block_first[i] for i in order]


class _NativeAttention:
    """A call's attention on the native kernel (native/layers.c ``pardec_attention``), between
    products of a library kernel: the same slots, cache and arithmetic as the native layer
    stack."""

    def __init__(self, kernel, cache: FastCache, layout: BlockLayout, row_first: Tensor):
        self.kernel, self.cache = kernel, cache
        self.rows, self.batch = layout.size, layout.batch
        self.index = 0 if layout.index is None else layout.index.contiguous().data_ptr()
        self.row_first, self.slots = row_first, cache.slot_tensor()
        self.threads = torch.get_num_threads()

    def _call(self, heads, dim, entries, mode, keys, values, flags, x: Tensor) -> Tensor:
        x = x.contiguous()
        out = x.new_empty(self.rows, heads * dim)
        dims = (ctypes.c_int64 * ATTENTION_DIMS)(self.rows, self.batch, heads, dim, entries,
                                                 self.threads, mode)
        self.kernel.attention(ctypes.addressof(dims), self.index, self.row_first.data_ptr(),
                              self.slots.data_ptr(), keys.data_ptr(), values.data_ptr(),
                              0 if flags is None else flags.data_ptr(), x.data_ptr(),
                              out.data_ptr())
        return out

    def self_attention(self, i: int, layer, qkv: Tensor) -> Tensor:
        cache = self.cache
        return self._call(layer.heads, layer.head_dim, cache.capacity, DECODER_SELF,
                          cache.keys[i], cache.values[i], None, qkv)

    def cross_attention(self, i: int, layer, q: Tensor) -> Tensor:
        cache = self.cache
        return self._call(layer.cross_heads, layer.cross_head_dim, cache.enc_keys[i].size(2),
                          DECODER_CROSS, cache.enc_keys[i], cache.enc_values[i], cache.enc_attend,
                          q)


class _TorchAttention:
    """A call's attention in torch operations (the native kernel off, or a drafter's own block
    mask): the block's keys and values are written to each row's slot, and the rows' entries
    read back in batch order (a copy where the rows do not own the first slots in order)."""

    def __init__(self, cache: FastCache, layout: BlockLayout, row_first: Tensor, total: int,
                 block_mask: Optional[Tensor]):
        self.cache, self.layout, self.total = cache, layout, total
        bsz, length = layout.batch, layout.length
        place = (torch.arange(bsz * length) if layout.index is None else layout.index)
        row, time = place % bsz, place // bsz
        self.slot = cache.slot_tensor().index_select(0, row)
        self.at = row_first.index_select(0, row) + time
        # (B, L, total): may the block's position l of row b read entry j
        entry = torch.arange(total)
        relative = entry.unsqueeze(0) - row_first.unsqueeze(1)  # (B, total)
        if block_mask is None:
            allowed = relative.unsqueeze(1) <= torch.arange(length).view(1, length, 1)
        else:
            inside_block = (relative >= 0) & (relative < length)
            at = relative.clamp(0, length - 1)
            inside = (block_mask > float("-inf"))[:, at].permute(1, 0, 2)  # (B, L, total)
            real = (~layout.block_pad).gather(1, at)
            allowed = (relative < 0).unsqueeze(1) | (inside_block & real).unsqueeze(1) & inside
        self.mask = _additive(allowed.unsqueeze(1))
        self.enc_mask = (None if cache.enc_attend is None
                         else _additive(cache.rows_of(cache.enc_attend)))

    def self_attention(self, i: int, layer, qkv: Tensor) -> Tensor:
        cache, layout = self.cache, self.layout
        heads, head_dim = layer.heads, layer.head_dim
        parts = qkv.view(-1, 3, heads, head_dim)
        cache.keys[i][self.slot, :, self.at] = parts[:, 1]
        cache.values[i][self.slot, :, self.at] = parts[:, 2]
        q = layout.unpack_time_major(parts[:, 0]).permute(1, 2, 0, 3)  # (B, heads, L, dim)
        keys = cache.rows_of(cache.keys[i])[:, :, : self.total]
        values = cache.rows_of(cache.values[i])[:, :, : self.total]
        return self._pack(_attention(q, keys, values, self.mask))

    def cross_attention(self, i: int, layer, q: Tensor) -> Tensor:
        cache, layout = self.cache, self.layout
        q = layout.unpack_time_major(q.view(-1, layer.cross_heads, layer.cross_head_dim))
        keys = cache.rows_of(cache.enc_keys[i])
        values = cache.rows_of(cache.enc_values[i])
        return self._pack(_attention(q.permute(1, 2, 0, 3), keys, values, self.enc_mask))

    def _pack(self, out: Tensor) -> Tensor:
        """(B, heads, L, head_dim) attention output -> (N, heads * head_dim), packed rows."""
        bsz, heads, length, head_dim = out.shape
        return self.layout.pack_time_major(
            out.permute(2, 0, 1, 3).reshape(length, bsz, heads * head_dim))
