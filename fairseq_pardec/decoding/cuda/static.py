"""The static decoder step: fixed shapes, buffers written in place, no host sync inside a call.

It computes what :class:`~fairseq_pardec.decoding.cpu.fast.FastBlockDecoder` computes (fairseq's
decoder, fused and rounded differently), laid out for a GPU, where a step of a small model costs
its kernel launches and every host read of the device stalls the queue:

* **Buckets.** A call runs on a grid of ``rows x width`` positions, the batch and the block
  length rounded up to a bucket (:func:`batch_bucket`, :func:`block_bucket`); padding rows and
  columns are masked out of every real row's attention and their outputs are never read. The
  same code runs eagerly (on the CPU in the tests) and, on CUDA, recorded once per bucket as a
  CUDA graph and replayed (cuda/cuda_graphs.py).
* **The self-attention cache** is one buffer per layer, ``(rows, heads, capacity, head_dim)``,
  the capacity rounded up to a power of two, in a :class:`_Slot` reused by later batches of the
  same buckets (a graph reads fixed addresses). Each row has its own length, on the device: a
  block's keys and values are scattered at ``length[b] + i``; a rollback only sets the lengths
  (rejected entries are overwritten by the next block), so the cache never has holes and needs
  no compaction. Keys carry their position in their values (absolute position embeddings), so
  an entry's index in the buffer is not its decoder step. The last entry is never a real one:
  the bucket's padding columns past the capacity are written there (and never attended to), so
  the capacity follows the real entries (``capacity_for``), not the bucket, and a batch that
  reserves its length limit (``new_state(max_len)``, ``reserve``) never grows its buffers.
* **Slots are bounded** (cuda/slot_pool.py): a count, a share of the free memory, least
  recently used first; an evicted slot frees its buffers and its graphs.
* **The encoder's keys and values** are projected once per batch, into the slot's static buffers
  (the source length rounded up to a bucket, the padding masked).
* **Few, fused ops.** One product per layer for queries, keys and values, the query scaling
  folded into its weights (as the fast step); attention through
  ``F.scaled_dot_product_attention`` with one boolean mask per call built on the device from
  the rows' lengths (the cache, causal inside the block, ragged and bucket padding, or a
  block-causal drafter's own mask).
* **Scores in the same call.** The output projection and the log-softmax run inside the call
  (the engine reads them through :meth:`StaticBlockDecoder.log_probs`).

The host keeps only what sizes the buffers: an upper bound on the longest row (``bound``, moved
by block lengths and by the rollbacks' ``keep_range``, which the engine already has on the host).
Nothing inside a call reads the device or has a shape that depends on data.

It rounds differently from fairseq (fused products, folded scaling, another attention kernel), so
it declares a margin and the engine decides close calls with fairseq's arithmetic
(draft_verify/margin_guard.py), as for the fast step.
"""

import functools
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules import LearnedPositionalEmbedding

from fairseq_pardec.decoding.step.block_decoder import UnsupportedDecoder, keep_bounds
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.cuda.cuda_graphs import GraphSet, out_of_memory
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported
from fairseq_pardec.decoding.step.margins import rounding_margin
from fairseq_pardec.decoding.cuda.slot_pool import SlotBudget, SlotPool
from fairseq_pardec.decoding.step.weights_key import WeightsKey
from fairseq_pardec.models.decoder_inputs import (encoder_states, final_features,
                                                   residual_sublayer)

# The smallest self-attention capacity and source bucket: the memory-efficient attention kernel
# reads masks whose last dimension is a multiple of 16, and fewer, larger buckets mean fewer
# captures.
MIN_CAPACITY = 64
MIN_SOURCE = 16


def _power_of_two(n: int, minimum: int = 1) -> int:
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def batch_bucket(rows: int) -> int:
    """Rows of the grid a batch of ``rows`` runs on: powers of two up to 16, then multiples of 16
    (a batch of 64 that loses rows passes through 64, 48, 32, 16, 8, 4, 2, 1)."""
    if rows <= 16:
        return _power_of_two(rows)
    return -(-rows // 16) * 16


def block_bucket(length: int) -> int:
    """Columns of the grid a block of ``length`` positions runs on: a power of two."""
    return _power_of_two(length)


def draft_cap_for_bucket(limit: int) -> int:
    """The most draft tokens, at most ``limit``, whose verified block (the row's last token and
    its drafts) fills its block bucket: ``2**k - 1`` (16 drafts make a block of 17 that runs on
    32 columns; 15 fill 16). A drafter's ceiling on CUDA passes through this."""
    if limit < 1:
        return 0
    return (1 << (limit + 1).bit_length() - 1) - 1


def capacity_for(entries: int) -> int:
    """The self-attention capacity for rows of at most ``entries`` cache entries: a power of
    two, at least :data:`MIN_CAPACITY`, with one entry to spare (the padding columns' spill
    entry, never a real one)."""
    return _power_of_two(entries + 1, MIN_CAPACITY)


def static_supported(decoder) -> bool:
    """True when :class:`StaticBlockDecoder` computes what fairseq's decoder computes: the lean
    step's layers (step/lean.py), a plain embedding on the way in, no quantisation noise, no
    dropout at inference."""
    if not lean_supported(decoder):
        return False
    if decoder.quant_noise is not None or type(decoder.embed_tokens) is not torch.nn.Embedding:
        return False
    if decoder.embed_tokens.max_norm is not None:
        return False
    return not decoder.dropout_module.apply_during_inference


class _Layer:
    """One decoder layer's weights in the static step's layout (fused, scaling folded)."""

    def __init__(self, layer):
        attn, cross = layer.self_attn, layer.encoder_attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.cross_heads, self.cross_head_dim = cross.num_heads, cross.head_dim
        scale = attn.scaling
        self.qkv_weight = torch.cat([attn.q_proj.weight * scale, attn.k_proj.weight,
                                     attn.v_proj.weight]).contiguous()
        self.qkv_bias = torch.cat([attn.q_proj.bias * scale, attn.k_proj.bias, attn.v_proj.bias])
        self.out = attn.out_proj
        self.cross_q_weight = (cross.q_proj.weight * cross.scaling).contiguous()
        self.cross_q_bias = cross.q_proj.bias * cross.scaling
        self.cross_kv_weight = torch.cat([cross.k_proj.weight, cross.v_proj.weight]).contiguous()
        self.cross_kv_bias = torch.cat([cross.k_proj.bias, cross.v_proj.bias])
        self.cross_out = cross.out_proj
        self.fc1, self.fc2, self.activation = layer.fc1, layer.fc2, layer.activation_fn
        self.pre_norm = layer.normalize_before
        self.norm_attn = layer.self_attn_layer_norm
        self.norm_cross = layer.encoder_attn_layer_norm
        self.norm_ffn = layer.final_layer_norm


class _Block:
    """One block bucket's static inputs on a slot (what a recorded call reads).

    A call writes only its real ``rows x length`` corner (tokens, padding, first steps or
    explicit steps) and the two counts; the recorded call derives the bucket padding from the
    counts, so whatever an earlier call left outside the corner is never read as real.
    """

    def __init__(self, rows: int, width: int, device, pad: int):
        self.width = width
        self.tokens = torch.full((rows, width), pad, dtype=torch.long, device=device)
        self.block_pad = torch.ones(rows, width, dtype=torch.bool, device=device)
        self.start = torch.zeros(rows, dtype=torch.long, device=device)
        self.steps = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.counts = torch.zeros(2, dtype=torch.long, device=device)  # real rows, real columns
        self.filled = None  # the (rows, columns) the counts hold
        self.causal = torch.ones(width, width, dtype=torch.bool, device=device).tril_()
        self.inside = self.causal.clone()  # which block positions a block position sees
        self.own_mask = False  # ``inside`` holds a drafter's mask, not ``causal``
        self.query_index = torch.arange(width, device=device)
        self.row_index = torch.arange(rows, device=device)


class _Slot:
    """Static buffers of one (rows, capacity, source) bucket, and the graphs recorded on them.

    A slot belongs to one cache at a time (``owner``); it returns to its step's pool when that
    cache is gone or moves to another slot, and the pool evicts it when over budget.
    """

    @staticmethod
    def buffer_bytes(layers: List[_Layer], rows: int, capacity: int, source: int, dtype) -> int:
        """The bytes of a slot's cache buffers (what a new slot allocates, nearly all of it)."""
        size = torch.empty((), dtype=dtype).element_size()
        per_row = sum(2 * capacity * layer.heads * layer.head_dim
                      + 2 * source * layer.cross_heads * layer.cross_head_dim for layer in layers)
        return rows * per_row * size

    def __init__(self, step: "StaticBlockDecoder", rows: int, capacity: int, source: int,
                 device, dtype):
        self.rows, self.capacity, self.source = rows, capacity, source
        # the weights its graphs read: kept alive with them (graphs hold addresses, not tensors)
        self.layers, self.held = step._layers, step._held
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.enc_keys: List[Tensor] = []
        self.enc_values: List[Tensor] = []
        for layer in self.layers:
            shape = (rows, layer.heads, capacity, layer.head_dim)
            self.keys.append(torch.zeros(shape, device=device, dtype=dtype))
            self.values.append(torch.zeros(shape, device=device, dtype=dtype))
            shape = (rows, layer.cross_heads, source, layer.cross_head_dim)
            self.enc_keys.append(torch.zeros(shape, device=device, dtype=dtype))
            self.enc_values.append(torch.zeros(shape, device=device, dtype=dtype))
        self.enc_attend = torch.ones(rows, 1, 1, source, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.key_index = torch.arange(capacity, device=device)
        self.temperature = torch.ones((), device=device, dtype=dtype)
        self.temperature_value = 1.0
        self.blocks: Dict[int, _Block] = {}
        self._buffer_bytes = self.buffer_bytes(self.layers, rows, capacity, source, dtype)
        device = torch.device(device)
        self.graphs = step.graph_set(device, before_capture=step._room_for_graph,
                                     make_room=functools.partial(step._room_after_out_of_memory,
                                                                 device))
        self.graphs.enabled = self.graphs.enabled and step.graphs
        self.owner = None

    @property
    def nbytes(self) -> int:
        return self._buffer_bytes + self.graphs.nbytes

    def evict(self):
        """Free the buffers and the graphs (the slot is never used again)."""
        self.graphs.clear()
        self.graphs.enabled = False
        self.keys, self.values, self.enc_keys, self.enc_values = [], [], [], []
        self.blocks.clear()
        self._buffer_bytes = 0
        self.owner = None

    def block(self, width: int, pad: int) -> _Block:
        block = self.blocks.get(width)
        if block is None:
            block = self.blocks[width] = _Block(self.rows, width, self.lengths.device, pad)
        return block

    def free(self) -> bool:
        return self.owner is None or self.owner() is None

    def copy_rows(self, other: "_Slot", order: Optional[Tensor], count: int):
        """Rows ``order`` of ``other`` (all its first ``count`` when None) into rows ``0 ..
        count - 1`` of this slot; the rest of this slot's rows become padding rows."""
        def pick(t: Tensor) -> Tensor:
            return t[:count] if order is None else t.index_select(0, order)

        width = min(self.capacity, other.capacity)
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
            mine[:count, :, :width] = pick(theirs[:, :, :width])
        for mine, theirs in zip(self.enc_keys + self.enc_values,
                                other.enc_keys + other.enc_values):
            mine[:count] = pick(theirs)
        attend, lengths = pick(other.enc_attend), pick(other.lengths)
        self.enc_attend[:count] = attend
        self.enc_attend[count:] = True
        self.lengths[:count] = lengths
        self.lengths[count:] = 0


class StaticCache:
    """One batch's decoder state for :class:`StaticBlockDecoder`: a slot of static buffers and
    what the host knows about it.

    batch: real rows (the slot has ``slot.rows >= batch``). bound: an upper bound on the longest
    row's cache length (exact when every row keeps the same, e.g. at batch 1). The last block's
    length, padding and ``bound`` before it let a drafter drop its mask slots (drop_columns).
    """

    def __init__(self):
        self.slot: Optional[_Slot] = None
        self.batch = 0
        self.bound = 0
        self.block_first = 0
        self.block_len = 0
        self.block_pad: Optional[Tensor] = None
        self.reserved = 0  # entries per row asked for before the batch started (reserve)
        # the latest call's in-call scores until log_probs reads them, and the temperature
        # the calls compute them at
        self.scores: Optional["_Scores"] = None
        self.temperature = 1.0


class _Scores:
    """The scores of a call on a cache, until the caller reads them."""

    def __init__(self, features, lprobs, index, temperature):
        self.features, self.lprobs, self.index = features, lprobs, index
        self.temperature = temperature


class StaticBlockDecoder(LeanBlockDecoder):
    """The draft-and-verify engine's decoder step for CUDA (same interface as
    :class:`~fairseq_pardec.decoding.step.lean.LeanBlockDecoder`, a :class:`StaticCache` as state).

    ``graphs``: record each bucket's call as a CUDA graph where the model is on CUDA (default);
    False runs every call eagerly (the same operations). ``budget``: how many slots and graphs,
    and what share of the free device memory, the step keeps (cuda/slot_pool.py).
    """

    # its buffers are sized for the batch when it starts (cuda/slot_pool.py): no row joins later
    joins_rows = False
    fast = True
    one_position_exact = False  # not even a one-position call rounds as fairseq does
    kernels = None  # the fast encoder measures its own kernels

    graph_set = GraphSet  # what records a slot's calls (the tests substitute a stub)

    def __init__(self, decoder, graphs: bool = True, budget: SlotBudget = SlotBudget()):
        super().__init__(decoder)
        if not static_supported(decoder):
            raise UnsupportedDecoder(
                "the static decoder step does not reproduce %s's layers (NormFormer, bias_kv, "
                "quantisation noise, ...); decode with the lean step (--cpu, or build the "
                "generator's step with static=False)" % type(decoder).__name__)
        self.graphs = graphs
        self._layers: List[_Layer] = []
        self._held: list = []
        self._weights_key = None
        self._weights_fingerprint: Optional[WeightsKey] = None
        self._pool = SlotPool(budget)
        self._lock = threading.Lock()
        self._dense_index: Dict[tuple, Tensor] = {}
        # whether the calls compute the log-probabilities: a caller that never reads them
        # (a drafter reading its own slots' logits) stops paying for them after one call
        self.scores_in_call = True

    def new_state(self, max_len: Optional[int] = None) -> StaticCache:
        """A batch's state; ``max_len``: the most tokens a row outputs (the engine's length
        limit, EOS at the latest there), so that its buffers are allocated once, for BOS and
        ``max_len`` tokens, when the batch starts (without it they grow as rows do)."""
        cache = StaticCache()
        if max_len is not None:
            self.reserve(cache, max_len + 1)
        return cache

    @property
    def margin(self) -> Optional[float]:
        """It rounds differently from fairseq: the engine guards exact choices with this bound on
        |log-prob - fairseq's| (step/margins.py; None in half precision, where none is claimed).
        tests/test_static_step.py keeps the difference measured on the CPU under a tenth of it."""
        weight = self.decoder.embed_tokens.weight
        return rounding_margin(weight.device, weight.dtype)

    # ------------------------------------------------------------------ weights and slots
    def _prepared(self):
        """The fused weights, rebuilt (and every recorded graph dropped) when a parameter or the
        position table changed."""
        with self._lock:
            if self._weights_fingerprint is None:
                self._weights_fingerprint = WeightsKey(self.decoder)
            table = self._position_table()
            key = (self._weights_fingerprint.key(),
                   None if table is None else (table.data_ptr(), table.device, table.dtype))
            if key != self._weights_key:
                with torch.no_grad():
                    self._layers = [_Layer(layer) for layer in self.layers]
                # the parameters' storage, kept alive with the graphs that read its addresses
                self._held = self._weights_fingerprint.hold() + [table]
                self._pool.clear()
                self._weights_key = key

    def _position_table(self) -> Optional[Tensor]:
        module = self.decoder.embed_positions
        if module is None:
            return None
        return module.weight if isinstance(module, LearnedPositionalEmbedding) else module.weights

    def _acquire(self, cache: StaticCache, rows: int, capacity: int, source: int, device, dtype):
        """A free slot of these buckets for ``cache`` (a new one if all are taken, after
        evicting what the budget requires; out of memory evicts every unused slot and tries
        once more)."""
        device = torch.device(device)
        with self._lock:
            slot = self._pool.find(rows, capacity, source)
            if slot is None:
                self._pool.make_room(_Slot.buffer_bytes(self._layers, rows, capacity, source,
                                                        dtype), device)
                try:
                    slot = _Slot(self, rows, capacity, source, device, dtype)
                except RuntimeError as error:
                    if not out_of_memory(error):
                        raise
                    self._free_unused_memory(device)
                    slot = _Slot(self, rows, capacity, source, device, dtype)
                self._pool.add(slot)
            slot.owner = weakref.ref(cache)
            self._pool.touch(slot)
        return slot

    @staticmethod
    def _release(slot: _Slot):
        slot.owner = None

    def _free_unused_memory(self, device: torch.device):
        """Evict every slot no batch uses and return the cached memory to the device (the
        caller holds the lock)."""
        self._pool.evict_unused()
        if device.type == "cuda":
            # the evicted graphs' pools go back to the device only here; outside any capture
            torch.cuda.empty_cache()

    def _room_for_graph(self, graphs: GraphSet):
        """Before a slot's set records a call: the budget's graph count and memory share."""
        with self._lock:
            self._pool.make_room_for_graph(graphs)

    def _room_after_out_of_memory(self, device: torch.device):
        """A capture ran out of memory: evict every unused slot before its one retry."""
        with self._lock:
            self._free_unused_memory(device)

    def graph_count(self) -> int:
        """How many calls are recorded as CUDA graphs (benchmark, tests)."""
        return self._pool.graph_count()

    def slot_count(self) -> int:
        """How many slots the step keeps, in use or not (tests)."""
        return len(self._pool)

    def _start(self, cache: StaticCache, encoder_out, bsz: int, length: int):
        """Take a slot for the batch and project the encoder's keys and values into it."""
        self._prepared()
        enc, enc_pad = encoder_states(encoder_out)  # (S, B, C), (B, S)
        weight = self.decoder.embed_tokens.weight
        source = enc.size(0)
        slot = self._acquire(cache, batch_bucket(bsz), capacity_for(max(length, cache.reserved)),
                             _power_of_two(source, MIN_SOURCE), weight.device, weight.dtype)
        cache.slot, cache.batch, cache.bound = slot, bsz, 0
        flat = enc.reshape(source * bsz, -1)
        for i, layer in enumerate(slot.layers):
            kv = F.linear(flat, layer.cross_kv_weight, layer.cross_kv_bias)
            kv = kv.view(source, bsz, 2, layer.cross_heads, layer.cross_head_dim)
            kv = kv.permute(2, 1, 3, 0, 4)
            slot.enc_keys[i][:bsz, :, :source] = kv[0]
            slot.enc_values[i][:bsz, :, :source] = kv[1]
        attend = slot.enc_attend.view(slot.rows, slot.source)
        attend.fill_(True)
        attend[:bsz, source:] = False
        if enc_pad is not None:
            attend[:bsz, :source] = ~enc_pad.bool()
        slot.lengths.zero_()

    def reserve(self, cache: StaticCache, entries: int):
        """Make room for ``entries`` cache entries per row (a caller that knows the batch's
        length limit reserves it once, before the first block: no buffer grows later; see
        :meth:`new_state`)."""
        slot = cache.slot
        if slot is None:
            cache.reserved = max(cache.reserved, entries)
            return
        if capacity_for(entries) <= slot.capacity:
            return
        bigger = self._acquire(cache, slot.rows, capacity_for(entries),
                               slot.source, slot.lengths.device, slot.keys[0].dtype)
        bigger.copy_rows(slot, None, slot.rows)
        self._release(slot)
        cache.slot = bigger

    # ------------------------------------------------------------------ forward
    def forward_packed(self, tokens, start, layout: BlockLayout, encoder_out, cache: StaticCache,
                       steps: Optional[Tensor] = None, block_mask: Optional[Tensor] = None,
                       cache_only: bool = False):
        """Features (N, d) at the block's real positions, packed as ``layout`` says (see
        :meth:`LeanBlockDecoder.forward_packed` for ``steps``, ``block_mask`` and
        ``cache_only``). Row b's keys and values are written after its own cache entries."""
        bsz, length = tokens.size()
        width = block_bucket(length)
        with torch.no_grad():
            if cache.slot is None:
                self._start(cache, encoder_out, bsz, length)
            # the real entries must fit below the spill entry; the bucket's padding need not
            self.reserve(cache, cache.bound + length)
            slot = cache.slot
            with self._lock:
                self._pool.touch(slot)
            block = slot.block(width, self.padding_idx)
            self._fill(block, tokens, start, layout.block_pad, steps, block_mask)
            explicit = steps is not None
            pending = cache.scores
            if pending is not None and pending.lprobs is not None:
                self.scores_in_call = False  # the previous call's scores were never read
            scores = self.scores_in_call and not cache_only
            temperature = cache.temperature
            if scores and slot.temperature_value != temperature:
                slot.temperature.fill_(temperature)
                slot.temperature_value = temperature
            # the outputs are the slot's until its next call (a replay rewrites them, and the
            # graphs of a slot share one memory pool: cuda/cuda_graphs.py): the features are
            # copied out here (index_select), the scores when read (log_probs), before the
            # engine calls again on this cache; a new call drops unread ones
            outputs = slot.graphs.call((width, explicit, scores),
                                       lambda: self._call(slot, block, explicit, scores))
            # the lengths move outside the recorded call: a call must be repeatable
            slot.lengths[:bsz] += length
            cache.block_first, cache.block_len = cache.bound, length
            cache.block_pad = layout.block_pad
            cache.bound += length
            if cache_only:
                cache.scores = None
                return None
            index = self._pack_index(layout, bsz, length, slot.rows)
            features = outputs[0].index_select(0, index)
            cache.scores = _Scores(features, outputs[1] if scores else None, index, temperature)
        return features

    def _fill(self, block: _Block, tokens, start, block_pad, steps, block_mask):
        """The call's static inputs: its real corner and counts (a few copies, no host read)."""
        bsz, length = tokens.size()
        block.tokens[:bsz, :length] = tokens
        block.block_pad[:bsz, :length] = block_pad
        if steps is None:
            block.start[:bsz] = start
        else:
            block.steps[:bsz, :length] = steps
        if block.filled != (bsz, length):
            block.counts[0].fill_(bsz)
            block.counts[1].fill_(length)
            block.filled = (bsz, length)
        # outside the real corner ``inside`` is never read as real: columns past the block are
        # padding keys, rows past it padding queries
        if block_mask is not None:
            block.inside[:length, :length] = block_mask > float("-inf")
            block.own_mask = True
        elif block.own_mask:
            block.inside.copy_(block.causal)
            block.own_mask = False

    def _inputs(self, block: _Block, explicit_steps: bool):
        """Inside the call: the grid's tokens, positions and padding (ragged blocks, bucket rows
        and columns)."""
        pad = self.padding_idx
        real = ((block.row_index < block.counts[0]).unsqueeze(1)
                & (block.query_index < block.counts[1]).unsqueeze(0))
        grid_pad = block.block_pad | ~real
        tokens = block.tokens.masked_fill(grid_pad, pad)
        steps = block.steps if explicit_steps else block.start.unsqueeze(1) + block.query_index
        # fairseq numbers positions from padding_idx + 1; padded slots borrow a valid position
        # (their outputs are never read, their keys never seen); real positions never pass the
        # table's end (the engine stops at the model's limit), padding is kept inside it
        positions = (steps + pad + 1).masked_fill(grid_pad, pad + 1)
        table = self._position_table()
        if table is not None:
            positions = positions.clamp(max=table.size(0) - 1)
        return tokens, positions, grid_pad

    def _pack_index(self, layout: BlockLayout, bsz: int, length: int, rows: int) -> Tensor:
        """Grid rows (time-major, ``rows`` per block position) of the layout's packed rows."""
        device = layout.block_pad.device
        if layout.index is None:  # depends on the shapes only: kept
            key = (bsz, length, rows, device)
            index = self._dense_index.get(key)
            if index is None:
                cols = torch.arange(length, device=device).unsqueeze(1) * rows
                index = self._dense_index[key] = (cols + torch.arange(bsz, device=device)).reshape(-1)
            return index
        return torch.div(layout.index, bsz, rounding_mode="floor") * rows + layout.index % bsz

    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """embed_at's function (models/decoder_inputs.py) without its read of the largest
        position: the position table is looked up as it is."""
        dec = self.decoder
        x = dec.embed_scale * dec.embed_tokens(tokens)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        module = dec.embed_positions
        if module is not None:
            if isinstance(module, LearnedPositionalEmbedding):
                x = x + F.embedding(positions, module.weight, module.padding_idx)
            else:
                x = x + module.weights.index_select(0, positions.reshape(-1)).view(
                    positions.shape + (-1,))
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        return x

    def _self_mask(self, slot: _Slot, block: _Block, pad: Tensor) -> Tensor:
        """(rows, 1, width, capacity) True where a block position may attend: its row's cache
        entries, and the block positions ``inside`` allows that are not padding. A padded query
        sees at least itself (its output is never read; a row with nothing to attend to would
        be NaN)."""
        width = block.width
        relative = (slot.key_index.unsqueeze(0) - slot.lengths.unsqueeze(1)).unsqueeze(1)
        at = relative.clamp(0, width - 1)  # (rows, 1, capacity)
        rows = slot.rows
        inside = block.inside.unsqueeze(0).expand(rows, width, width).gather(
            2, at.expand(rows, width, slot.capacity))
        key_pad = pad.gather(1, at.squeeze(1)).unsqueeze(1)
        in_block = (relative >= 0) & (relative < width)
        allowed = (relative < 0) | (in_block & inside & ~key_pad)
        own = (relative == block.query_index.view(1, width, 1)) & pad.unsqueeze(2)
        return (allowed | own).unsqueeze(1)

    def _call(self, slot: _Slot, block: _Block, explicit_steps: bool,
              scores: bool) -> Tuple[Tensor, ...]:
        """The step on the slot's static buffers: the grid's features (width * rows, d),
        time-major, and with ``scores`` its log-probabilities. Writes the block's keys and
        values at each row's length; reads nothing back to the host."""
        dec = self.decoder
        rows, width = slot.rows, block.width
        tokens, positions, pad = self._inputs(block, explicit_steps)
        x = self._embed(tokens.t(), positions.t()).reshape(width * rows, -1)
        mask = self._self_mask(slot, block, pad)
        # padding columns past the capacity spill into its last entry, never a real one (the
        # real entries stay below it: capacity_for) and never attended to (relative to its row
        # it is a padding column or past the block)
        write = (slot.lengths.view(rows, 1, 1, 1) + block.query_index.view(1, 1, width, 1)
                 ).clamp(max=slot.capacity - 1)
        for i, layer in enumerate(slot.layers):
            x = residual_sublayer(x, layer.norm_attn, layer.pre_norm, lambda h, residual: (
                self._self_attention(slot, i, layer, h, write, mask) + residual))
            x = residual_sublayer(x, layer.norm_cross, layer.pre_norm, lambda h, residual: (
                self._cross_attention(slot, i, layer, h) + residual))
            x = residual_sublayer(x, layer.norm_ffn, layer.pre_norm, lambda h, residual: (
                layer.fc2(layer.activation(layer.fc1(h))) + residual))
        features = final_features(dec, x, time_major=False)
        if not scores:
            return (features,)
        logits = dec.output_layer(features) / slot.temperature
        return features, F.log_softmax(logits.float(), dim=-1)

    @staticmethod
    def _self_attention(slot: _Slot, i: int, layer, x: Tensor, write: Tensor,
                        mask: Tensor) -> Tensor:
        """Layer ``i``'s self-attention of the grid ``x`` (width * rows, d), time-major: its
        keys and values written into the slot's cache at ``write``, before its output
        projection's residual."""
        rows, heads, head_dim = slot.rows, layer.heads, layer.head_dim
        width = x.size(0) // rows
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias).view(width, rows, 3, heads, head_dim)
        qkv = qkv.permute(2, 1, 3, 0, 4)  # (3, rows, heads, width, head_dim)
        at = write.expand(rows, heads, width, head_dim)
        slot.keys[i].scatter_(2, at, qkv[1])
        slot.values[i].scatter_(2, at, qkv[2])
        out = F.scaled_dot_product_attention(qkv[0], slot.keys[i], slot.values[i],
                                             attn_mask=mask, scale=1.0)
        return layer.out(out.permute(2, 0, 1, 3).reshape(width * rows, -1))

    @staticmethod
    def _cross_attention(slot: _Slot, i: int, layer, x: Tensor) -> Tensor:
        """Layer ``i``'s attention of the grid ``x`` over the keys and values of the encoder's
        output, projected into the slot when its batch started."""
        rows = slot.rows
        width = x.size(0) // rows
        q = F.linear(x, layer.cross_q_weight, layer.cross_q_bias).view(
            width, rows, layer.cross_heads, layer.cross_head_dim).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(q, slot.enc_keys[i], slot.enc_values[i],
                                             attn_mask=slot.enc_attend, scale=1.0)
        return layer.cross_out(out.permute(2, 0, 1, 3).reshape(width * rows, -1))

    # ------------------------------------------------------------------ scores
    def log_probs(self, features: Tensor, temperature: float = 1.0,
                  state: Optional[StaticCache] = None) -> Tensor:
        """The log-probabilities of ``features``: those computed inside the call on ``state``
        that returned them, else computed here."""
        pending = state.scores if state is not None else None
        if pending is not None and pending.features is features:
            computed = pending.lprobs
            pending.lprobs = None  # read: the caller may edit it in place
            if computed is not None and pending.temperature == temperature:
                return computed.index_select(0, pending.index)
            # the next calls compute them (at this temperature) again
            self.scores_in_call = True
            state.temperature = temperature
        return super().log_probs(features, temperature)

    # ------------------------------------------------------------------ cache surgery
    def reads_encoder_out(self, cache: StaticCache) -> bool:
        return cache.slot is None

    def cache_length(self, cache: StaticCache) -> int:
        """An upper bound on the longest row's entries (exact when the rows keep as many)."""
        return cache.bound

    def valid_mask(self, cache: StaticCache) -> Optional[Tensor]:
        if cache.slot is None:
            return None
        lengths = cache.slot.lengths[: cache.batch]
        return cache.slot.key_index[: cache.bound].unsqueeze(0) < lengths.unsqueeze(1)

    def rollback(self, cache: StaticCache, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None):
        """Of the last block's ``block_len`` entries keep the first ``keep[b]`` per row: only the
        lengths move (the next block overwrites the rest)."""
        slot = cache.slot
        slot.lengths[: cache.batch] += keep - block_len
        kept_max = keep_bounds(keep, keep_range)[1]
        cache.bound = cache.bound - block_len + kept_max
        cache.block_pad = None

    def drop_columns(self, cache: StaticCache, first: int, count: int):
        """Remove the last block's first ``count`` columns in every row (a block-causal drafter's
        mask slots; ``first``: :meth:`cache_length` before that block), and its padding: each
        row's other real entries move forward to follow its cache."""
        if cache.block_pad is None or first != cache.block_first:
            raise ValueError("drop_columns removes columns of the block just decoded")
        slot, bsz, length = cache.slot, cache.batch, cache.block_len
        kept = length - count
        start = slot.lengths[:bsz] - length
        rest = cache.block_pad[:, count:]
        # each row's real columns first, in order (padding sorts last)
        order = torch.sort(rest.to(torch.int8), dim=1, stable=True).indices
        source = (start.unsqueeze(1) + count + order).view(bsz, 1, kept, 1)
        target = (start.unsqueeze(1) + torch.arange(kept, device=start.device)).view(bsz, 1, kept, 1)
        for buffers in (slot.keys, slot.values):
            for t in buffers:
                rows = t[:bsz]
                shape = (bsz, t.size(1), kept, t.size(3))
                moved = rows.gather(2, source.expand(shape))
                rows.scatter_(2, target.expand(shape), moved)
        slot.lengths[:bsz] = start + (~rest).sum(1)
        cache.bound = cache.block_first + kept
        cache.block_pad = None

    def compact(self, cache: StaticCache, min_holes: float = 0.5):
        """Nothing to do: rows have their own lengths, the cache has no holes."""

    def reorder(self, cache: StaticCache, new_order: Tensor):
        """Keep (and reorder) batch rows; rows past them become padding rows. A batch that fits
        a smaller bucket moves to a slot of that bucket (its calls are cheaper)."""
        slot = cache.slot
        count = new_order.numel()
        cache.block_pad = None
        if slot is None:
            return
        new_order = new_order.to(slot.lengths.device)
        rows = batch_bucket(count)
        target = slot
        if rows != slot.rows:
            target = self._acquire(cache, rows, slot.capacity, slot.source,
                                   slot.lengths.device, slot.keys[0].dtype)
        target.copy_rows(slot, new_order, count)
        if target is not slot:
            self._release(slot)
            cache.slot = target
        cache.batch = count
