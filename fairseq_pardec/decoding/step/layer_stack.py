"""The fast step's decoder layers as one native call (native_layers.c).

At batch 1 a decoder call's products are about half its time; the rest is dispatch: some thirty
torch operations per layer (layer norms, views, cache writes, packing) and an attention kernel
that costs 20 us for a block of 6 queries whose arithmetic takes 1 us. :class:`NativeLayerStack`
hands the whole stack to native_layers.c: one call per decoder call, the products on the native
kernel (native_linear.c), the rest plain loops. The fast step uses it wherever its products would
run on the native kernel anyway (products.KernelChoice measured it fastest for that many rows)
and the layers are ones it computes: fairseq decoder layers with ReLU feed-forward and affine
layer norms, the same shapes in every layer, no custom block mask.
"""

import ctypes
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_pardec.decoding.step.native import LAYER_DIMS, LAYER_STATE, LAYER_WEIGHTS


def _address(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _affine_norm(norm) -> bool:
    return (isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None
            and norm.bias is not None and norm.weight.dtype == torch.float32
            and norm.weight.is_contiguous() and norm.bias.is_contiguous())


class NativeLayerStack:
    """A decoder's layers (fast.py's ``_Layer``) for native_layers.c: the table of weight
    pointers is built once; the one of cache pointers again when the cache's buffers move."""

    def __init__(self, kernel, layers: List):
        self.kernel = kernel
        first = layers[0]
        self.shape = (len(layers), first.embed_dim, first.heads, first.head_dim,
                      first.cross_heads, first.cross_head_dim, first.ffn.fc1.out_features,
                      int(first.pre_norm))
        table = []
        eps = []
        for layer in layers:
            norms = (layer.norms[0], layer.norms[1], layer.ffn.norm)
            maps = (layer.qkv, layer.out, layer.cross_q, layer.cross_out, layer.ffn.fc1,
                    layer.ffn.fc2)
            for lin in maps:
                table += [lin.panels.data_ptr(), _address(lin.bias)]
            for norm in norms:
                table += [norm.weight.data_ptr(), norm.bias.data_ptr()]
                eps.append(norm.eps)
        assert len(table) == LAYER_WEIGHTS * len(layers)
        # the weights' tensors outlive this table: fast.py rebuilds both when a weight changes
        self._layers = layers
        self._weights = (ctypes.c_int64 * len(table))(*table)
        self._eps = (ctypes.c_double * len(eps))(*eps)
        self._state_key = None
        self._state = None

    @staticmethod
    def supports(layers: List) -> bool:
        """Whether native_layers.c computes these layers (else the torch path runs them)."""
        if not layers:
            return False
        first = layers[0]
        for layer in layers:
            maps = (layer.qkv, layer.out, layer.cross_q, layer.cross_out, layer.ffn.fc1,
                    layer.ffn.fc2)
            if any(lin.panels is None for lin in maps):
                return False
            if layer.ffn.activation is not None or not layer.ffn.fc1.relu:
                return False
            if not all(_affine_norm(n) for n in (layer.norms[0], layer.norms[1], layer.ffn.norm)):
                return False
            same = (layer.embed_dim, layer.heads, layer.head_dim, layer.cross_heads,
                    layer.cross_head_dim, layer.ffn.fc1.out_features, layer.pre_norm)
            if same != (first.embed_dim, first.heads, first.head_dim, first.cross_heads,
                        first.cross_head_dim, first.ffn.fc1.out_features, first.pre_norm):
                return False
            if layer.qkv.in_features != layer.embed_dim or layer.embed_dim != (
                    layer.heads * layer.head_dim):
                return False
        return True

    def _state_table(self, cache):
        buffers = [cache.keys, cache.values, cache.enc_keys, cache.enc_values]
        key = tuple(t.data_ptr() for group in buffers for t in group)
        if key != self._state_key:
            if not all(t.is_contiguous() and t.dtype == torch.float32
                       for group in buffers for t in group):
                raise ValueError("the fast step's cache buffers must be contiguous float32")
            table = [t.data_ptr() for layer in zip(*buffers) for t in layer]
            assert len(table) == LAYER_STATE * len(cache.keys)
            self._state = (ctypes.c_int64 * len(table))(*table)
            self._state_key = key
        return self._state

    def __call__(self, x: Tensor, cache, index: Optional[Tensor], batch: int, first: int,
                 length: int) -> Tensor:
        """The layers' output for the packed rows ``x`` (N, C), a new tensor; the rows' keys and
        values are written to the cache at ``[first, first + length)``. ``index``: the packed
        rows' places in the (length, batch) time-major grid (None: dense)."""
        layers, model, heads, head_dim, cross_heads, cross_dim, ffn, pre_norm = self.shape
        out = x.contiguous().clone()
        capacity = cache.keys[0].size(2)
        source = cache.enc_keys[0].size(2)
        dims = (ctypes.c_int64 * LAYER_DIMS)(
            layers, out.size(0), batch, length, first, capacity, model, heads, head_dim,
            cross_heads, cross_dim, ffn, source, pre_norm, torch.get_num_threads())
        self.kernel.decoder_layers(
            ctypes.addressof(dims), ctypes.addressof(self._weights), ctypes.addressof(self._eps),
            ctypes.addressof(self._state_table(cache)), _address(index),
            _address(cache.masked), _address(cache.enc_attend), out.data_ptr())
        return out
