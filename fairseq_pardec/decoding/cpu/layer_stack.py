"""The fast step's decoder layers, and the fast encoder's layers, as one native call each
(native/layers.c).

At batch 1 a decoder call's products are about half its time; the rest is dispatch: some thirty
torch operations per layer (layer norms, views, cache writes, packing) and an attention kernel
that costs 20 us for a block of 6 queries whose arithmetic takes 1 us. :class:`NativeLayerStack`
hands the whole stack to native/layers.c: one call per decoder call, the products on the native
kernel (native/linear.c), the rest plain loops. The fast step and the fast encoder use it
wherever their products would run on the native kernel anyway (products.KernelChoice measured it
fastest for that many rows) and the layers are ones it computes: fairseq layers with ReLU
feed-forward and affine layer norms, the same shapes in every layer (and, in the decoder, no
custom block mask).
"""

import ctypes
from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

from fairseq_pardec.native.library import LAYER_DIMS, LAYER_STATE, LAYER_WEIGHTS
from fairseq_pardec.models.decoder_inputs import plain_input


# the slots of native/layers.c's dims (its enum D_*) that change from call to call
_ROWS, _BATCH, _LENGTH, _FIRST, _CAPACITY, _SOURCE, _THREADS = 1, 2, 3, 4, 5, 12, 14


def _address(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _affine_norm(norm) -> bool:
    return (isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None
            and norm.bias is not None and norm.weight.dtype == torch.float32
            and norm.weight.is_contiguous() and norm.bias.is_contiguous())


def _parts(layer, encoder: bool):
    """A layer's products and layer norms in the tables' order (None: an encoder lacks it)."""
    if encoder:
        return ((layer.qkv, layer.out, None, None, layer.ffn.fc1, layer.ffn.fc2),
                (layer.norm_attn, None, layer.ffn.norm))
    return ((layer.qkv, layer.out, layer.cross_q, layer.cross_out, layer.ffn.fc1, layer.ffn.fc2),
            (layer.norms[0], layer.norms[1], layer.ffn.norm))


def _shape(layer, encoder: bool):
    cross = (0, 0) if encoder else (layer.cross_heads, layer.cross_head_dim)
    model = layer.qkv.in_features
    return (model, layer.heads, layer.head_dim) + cross + (layer.ffn.fc1.out_features,
                                                           int(layer.pre_norm))


def _position_table(decoder, needed: int):
    """The decoder's position embeddings as a table of at least ``needed`` rows where it can
    have them (a learned table, or fairseq's sinusoids grown as fairseq grows them); None
    without position embeddings; False for anything else."""
    module = decoder.embed_positions
    if module is None:
        return None
    if isinstance(module, LearnedPositionalEmbedding):
        table = module.weight
    elif isinstance(module, SinusoidalPositionalEmbedding):
        if module.weights.size(0) < needed:
            # let fairseq grow its sinusoid table exactly as it would itself
            module(torch.zeros(1, needed - module.padding_idx - 1, dtype=torch.long))
        table = module.weights
    else:
        return False
    if table.dtype != torch.float32 or not table.is_contiguous() or table.device.type != "cpu":
        return False
    return table


class NativeLayerStack:
    """A layer stack (cpu/fast.py's ``_Layer`` or cpu/fast_encoder.py's ``_EncoderLayer``) for
    native/layers.c: the table of weight pointers is built once, and the object never changes
    afterwards (threads share it); the table of a batch's cache pointers belongs to that
    batch's cache, rebuilt when its buffers move."""

    def __init__(self, kernel, layers: List, encoder: bool = False):
        self.kernel = kernel
        self.encoder = encoder
        self.shape = _shape(layers[0], encoder)
        table, eps = [], []
        for layer in layers:
            maps, norms = _parts(layer, encoder)
            for lin in maps:
                table += [0, 0] if lin is None else [lin.panels.data_ptr(), _address(lin.bias)]
            for norm in norms:
                table += [0, 0] if norm is None else [norm.weight.data_ptr(), norm.bias.data_ptr()]
                eps.append(0.0 if norm is None else norm.eps)
        assert len(table) == LAYER_WEIGHTS * len(layers)
        # the weights' tensors outlive this table: their owners rebuild both when a weight changes
        self._layers = layers
        self._weights = (ctypes.c_int64 * len(table))(*table)
        self._eps = (ctypes.c_double * len(eps))(*eps)

    @staticmethod
    def supports(layers: List, encoder: bool = False) -> bool:
        """Whether native/layers.c computes these layers (else the torch path runs them)."""
        if not layers:
            return False
        shape = _shape(layers[0], encoder)
        model, heads, head_dim = shape[:3]
        for layer in layers:
            maps, norms = _parts(layer, encoder)
            if any(lin is not None and lin.panels is None for lin in maps):
                return False
            if layer.ffn.activation is not None or not layer.ffn.fc1.relu:
                return False
            if not all(norm is None or _affine_norm(norm) for norm in norms):
                return False
            if _shape(layer, encoder) != shape or model != heads * head_dim:
                return False
        return True

    @staticmethod
    def _state_table(cache):
        """The per-layer pointers of ``cache``'s buffers (self keys, self values, encoder keys,
        encoder values), kept on the cache as ``native_state`` with the lists of buffers they
        were read from: a cache replaces a list where its buffers change (fast.FastCache), and
        it belongs to one batch, so no other batch can swap its table in."""
        known = cache.native_state
        if (known is not None and known[0] is cache.keys and known[1] is cache.values
                and known[2] is cache.enc_keys and known[3] is cache.enc_values):
            return known[4]
        buffers = (cache.keys, cache.values, cache.enc_keys, cache.enc_values)
        if not all(t.is_contiguous() and t.dtype == torch.float32
                   for group in buffers for t in group):
            raise ValueError("the fast step's cache buffers must be contiguous float32")
        table = [t.data_ptr() for layer in zip(*buffers) for t in layer]
        cache.native_state = (*buffers, (ctypes.c_int64 * len(table))(*table))
        return cache.native_state[4]

    def _dims(self, rows, batch, length, first, capacity, source, dims=None):
        """(address, table) of the call's table of sizes (native/layers.c's ``dims``): in
        ``dims``, a cache's own (int64 array, its address), filled where it changes, or in a
        new array."""
        threads = torch.get_num_threads()
        if dims is None:
            model, heads, head_dim, cross_heads, cross_dim, ffn, pre_norm = self.shape
            table = (ctypes.c_int64 * LAYER_DIMS)(
                len(self._layers), rows, batch, length, first, capacity, model, heads,
                head_dim, cross_heads, cross_dim, ffn, source, pre_norm, threads,
                int(self.encoder))
            return ctypes.addressof(table), table
        table, address = dims
        table[_ROWS], table[_BATCH], table[_LENGTH] = rows, batch, length
        table[_FIRST], table[_CAPACITY] = first, capacity
        table[_SOURCE], table[_THREADS] = source, threads
        return address, table

    def _run(self, x: Tensor, state, index, masked, enc_attend, batch, length, first, capacity,
             source, owned: bool = False, dims=None, row_first=None, slot_of=None) -> Tensor:
        """The layers on the rows ``x``, in place where ``owned`` (a buffer of the caller's
        that nobody else reads), else on a copy."""
        out = x if owned and x.is_contiguous() else x.contiguous().clone()
        address, dims = self._dims(out.size(0), batch, length, first, capacity, source, dims)
        self.kernel.decoder_layers(
            address, ctypes.addressof(self._weights), ctypes.addressof(self._eps),
            ctypes.addressof(state), _address(index), _address(masked), _address(enc_attend),
            _address(row_first), _address(slot_of), out.data_ptr())
        return out

    @staticmethod
    def input_tables(decoder, needed: int):
        """The two tables the decoder's (or encoder's) input adds up (its token embedding's
        weight, and its position table of at least ``needed`` rows or None), where its way in
        is just those; None where it is not or the position table is shorter (the torch path
        then runs, and says what is wrong)."""
        table = decoder.embed_tokens
        if not plain_input(decoder) or not table.weight.is_contiguous():
            return None
        positions = _position_table(decoder, needed)
        if positions is False or (positions is not None and positions.size(0) < needed):
            return None
        return table.weight, positions

    def block_input(self, decoder, tokens: Tensor, start: Tensor, index: Optional[Tensor],
                    rows: int, first: int, tables=None) -> Optional[Tensor]:
        """The decoder's input for a block's packed rows (embed_at's function: scaled token
        embedding plus position embedding, native/layers.c) where the decoder's way in is just
        those two tables; None where it is not, or a token or position is outside its table
        (the torch path then runs, and says what is wrong). ``tables``: :meth:`input_tables`
        for this block, if the caller has them."""
        batch, length = tokens.shape
        offset = decoder.padding_idx + 1
        if tables is None:
            tables = self.input_tables(decoder, first + length + offset)
            if tables is None:
                return None
        weight, positions = tables
        tokens, start = tokens.contiguous(), start.contiguous()
        out = torch.empty(rows, weight.size(1))
        failed = self.kernel.embed_block(
            tokens.data_ptr(), start.data_ptr(), _address(index), rows, batch, length, offset,
            decoder.embed_scale, weight.data_ptr(), weight.size(0),
            _address(positions), 0 if positions is None else positions.size(0),
            weight.size(1), out.data_ptr())
        return None if failed else out

    def __call__(self, x: Tensor, cache, index: Optional[Tensor], batch: int, row_first: Tensor,
                 length: int, owned: bool = False) -> Tensor:
        """The decoder layers' output for the packed rows ``x`` (N, C): ``x`` itself, written
        over, where ``owned`` (see :meth:`_run`), else a new tensor; each row's keys and values
        are written to its slot (``cache.slot_of``) at ``[row_first[b], row_first[b] +
        length)``. ``index``: the packed rows' places in the (length, batch) time-major grid
        (None: dense)."""
        state = self._state_table(cache)
        dims = cache.native_dims
        if dims is None:
            table = np.array(self._dims(x.size(0), batch, length, 0, cache.keys[0].size(2),
                                        cache.enc_keys[0].size(2))[1], dtype=np.int64)
            dims = cache.native_dims = (table, table.ctypes.data)
        return self._run(x, state, None if index is None else index.contiguous(), None,
                         cache.enc_attend, batch, length, 0, cache.keys[0].size(2),
                         cache.enc_keys[0].size(2), owned, dims, row_first.contiguous(),
                         cache.slot_tensor())

    def encode(self, x: Tensor, padding: Optional[Tensor], batch: int, length: int) -> Tensor:
        """The encoder layers' output for ``x`` (batch * length, C), batch-major rows, a new
        tensor; ``padding`` (batch, length) True at padded source positions, or None."""
        _, heads, head_dim = self.shape[:3]
        # the layers run one after the other: one keys and one values buffer serve them all
        keys = x.new_empty(batch, heads, length, head_dim)
        values = x.new_empty(batch, heads, length, head_dim)
        state = (ctypes.c_int64 * (LAYER_STATE * len(self._layers)))(
            *[keys.data_ptr(), values.data_ptr(), 0, 0] * len(self._layers))
        if padding is not None:
            padding = padding.contiguous()
        out = self._run(x, state, None, padding, None, batch, length, 0, length, 0)
        return out
