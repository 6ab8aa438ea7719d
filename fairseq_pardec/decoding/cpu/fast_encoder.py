"""The fast encoder: fairseq's Transformer encoder in the fast step's operations.

The engine encodes every batch once, and once the decoder step is fast, fairseq's modules
make the encoder a large share of a batch's time (at batch 1 their Python between small
products costs more than the products). :class:`FastEncoder`
computes the same function as :class:`~fairseq.models.transformer.TransformerEncoderBase` with
the fast decoder step's means (cpu/fast.py): one product for queries, keys and values per layer
with the query scaling folded into its weight, each product on the kernel measured faster for its
row count (cpu/products.py, the decoder's own choice), ReLU fused into the first feed-forward
product, and attention over the unpadded keys, on the native kernel where it loads (each real
position's query reads its own sentence's keys: a batch of sentences far apart in length costs
its real positions, not its padded square), else ``F.scaled_dot_product_attention``; where its
products run on the native kernel, all its layers run as one native call (cpu/layer_stack.py).

It rounds differently from fairseq's modules, as the fast decoder step does; the margin guard
(cpu/fast.py, DEFAULT_MARGIN) covers the two together: tests/test_fast_step.py measures the
log-probabilities of fast encoder and fast step against fairseq's encoder and decoder.
The output is fairseq's encoder output dictionary, so everything downstream (drafters, reordering
when rows finish, fairseq's own search deciding close calls) reads it unchanged.
"""

import ctypes
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from fairseq_pardec.decoding.cpu.layer_stack import NativeLayerStack
from fairseq_pardec.native.library import ATTENTION_DIMS, ENCODER_SELF, native_kernel
from fairseq_pardec.decoding.cpu.products import (NATIVE, PACK_BELOW, FeedForward, KernelChoice,
                                                  Linear, query_key_value)
from fairseq_pardec.decoding.step.lean import _plain_attention
from fairseq_pardec.decoding.step.weights_key import PREPARE_LOCK, WeightsKey


def _plain_self_attention(attn) -> bool:
    return (_plain_attention(attn) and attn.self_attention and attn.qkv_same_dim
            and attn.k_proj.bias is not None and attn.v_proj.bias is not None)


def fast_encoder_supported(encoder) -> bool:
    """True when :class:`FastEncoder` computes what ``encoder.forward_torchscript`` computes:
    fairseq's Transformer encoder with plain layers, float32 on the CPU."""
    if not isinstance(encoder, TransformerEncoderBase):
        return False
    cls = type(encoder)
    for name in ("forward", "forward_scriptable", "forward_torchscript"):
        if getattr(cls, name) is not getattr(TransformerEncoderBase, name):
            return False
    if len(encoder.layers) == 0:
        return False
    for layer in encoder.layers:
        if type(layer).forward is not TransformerEncoderLayerBase.forward:
            return False
        if not _plain_self_attention(layer.self_attn):
            return False
    weight = encoder.embed_tokens.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class _EncoderLayer:
    """One encoder layer's weights in the layout the fast encoder multiplies with."""

    def __init__(self, layer):
        attn = layer.self_attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.qkv = query_key_value(attn)
        self.out = Linear(attn.out_proj.weight, attn.out_proj.bias)
        self.ffn = FeedForward(layer)
        self.pre_norm = layer.normalize_before
        self.norm_attn = layer.self_attn_layer_norm


class _EncoderWeights:
    """The encoder layers' weights in the fast layout and their native call (or None), built
    together at ``key`` and never changed afterwards (``held``: weights_key.WeightsKey.hold)."""

    def __init__(self, key, held, layers: List[_EncoderLayer], stack: Optional[NativeLayerStack]):
        self.key, self.held, self.layers, self.stack = key, held, layers, stack


class FastEncoder:
    """``encoder_out = FastEncoder(encoder, kernels)(net_input)``, fairseq's dictionary.

    ``kernels``: the decoder step's :class:`KernelChoice` (measured on the decoder's products,
    which have the encoder's shapes), or a choice of its own.
    """

    def __init__(self, encoder, kernels: Optional[KernelChoice] = None):
        self.encoder = encoder
        self.kernels = kernels if kernels is not None else KernelChoice()
        self._fingerprint = WeightsKey(encoder.layers)
        # the layers in the fast layout (and as one native call where its products run
        # natively: cpu/layer_stack.py), swapped whole when rebuilt: a batch reads one version
        self._weights: Optional[_EncoderWeights] = None
        self.native_stack = True
        # else the attention on the native kernel between library products, where it loads
        self.native_attention = True

    def _prepared(self) -> _EncoderWeights:
        """The layers' weights in the fast layout, rebuilt when any may have changed
        (weights_key.py says what that covers); called once per batch."""
        key = self._fingerprint.key()
        weights = self._weights
        if weights is not None and weights.key == key:
            return weights
        with PREPARE_LOCK:
            key = self._fingerprint.key()  # again: another thread may have rebuilt meanwhile
            weights = self._weights
            if weights is None or weights.key != key:
                held = self._fingerprint.hold()
                with torch.no_grad():
                    layers = [_EncoderLayer(layer) for layer in self.encoder.layers]
                    stack = None
                    if NativeLayerStack.supports(layers, encoder=True):
                        stack = NativeLayerStack(layers[0].qkv.native, layers, encoder=True)
                weights = _EncoderWeights(key, held, layers, stack)
                if self.kernels.stale():
                    self.kernels.measure([[layer.qkv, layer.out, layer.ffn.fc1, layer.ffn.fc2]
                                          for layer in layers])
                self._weights = weights
        return weights

    def __call__(self, net_input) -> Dict[str, List[Tensor]]:
        with torch.no_grad():
            return self._encode(net_input["src_tokens"])

    def _encode(self, src_tokens: Tensor) -> Dict[str, List[Tensor]]:
        enc = self.encoder
        weights = self._prepared()
        padding = src_tokens.eq(enc.padding_idx)
        # the real positions, in the one read of the source this encoder makes
        real = (~padding).view(-1).nonzero().view(-1)
        has_pads = real.numel() < padding.numel()
        x = None
        if not has_pads and src_tokens.size(0) == 1 and weights.stack is not None:
            x, embedding = self._one_sentence_embedding(weights.stack, src_tokens)
        if x is None:
            x, embedding = enc.forward_embedding(src_tokens)
        if has_pads:
            x = x * (1 - padding.unsqueeze(-1).type_as(x))
        bsz, length, dim = x.shape
        x = x.reshape(bsz * length, dim)
        if real.numel() >= PACK_BELOW * bsz * length:
            real = None  # little padding: left in, the products run on every position
        kernel = self.kernels.kernel_for(x.size(0) if real is None else real.numel())
        if weights.stack is not None and self.native_stack and kernel == NATIVE:
            x = weights.stack.encode(x, padding if has_pads else None, bsz, length)
            real = None
        else:
            # attention reads every real key; None lets the kernel skip the mask
            attend = (~padding).view(bsz, 1, 1, length) if has_pads else None
            native = native_kernel() if self.native_attention else None
            x = self._torch_layers(x, weights.layers, kernel, attend, bsz, length, real, native)
        if enc.layer_norm is not None:
            x = enc.layer_norm(x)
        if real is not None:  # back in place; padding positions hold zeros, read by no one
            x = x.new_zeros(bsz * length, dim).index_copy_(0, real, x)
        states = x.view(bsz, length, dim).transpose(0, 1).contiguous()  # (S, B, C), as fairseq
        src_lengths = (~padding).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [states],
            "encoder_padding_mask": [padding],
            "encoder_embedding": [embedding],
            "encoder_states": [],
            "fc_results": [],
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }

    def _one_sentence_embedding(self, stack: NativeLayerStack, src_tokens: Tensor):
        """``forward_embedding``'s (x, embed) for one unpadded sentence, x in one native call
        (layer_stack.block_input: the scaled token rows plus the position rows, at positions
        1, 2, ... after the padding index, as fairseq's ``make_positions`` numbers them), where
        the encoder's way in is just those two tables; (None, None) elsewhere. fairseq's module
        path numbers the positions and reads the tables in a dozen small torch operations."""
        enc = self.encoder
        if type(enc).forward_embedding is not TransformerEncoderBase.forward_embedding:
            return None, None
        length = src_tokens.size(1)
        tables = stack.input_tables(enc, length + enc.padding_idx + 1)
        if tables is None:
            return None, None
        x = stack.block_input(enc, src_tokens, src_tokens.new_zeros(1), None, length, 0, tables)
        if x is None:
            return None, None
        return x.view(1, length, -1), enc.embed_scale * F.embedding(src_tokens, tables[0])

    @staticmethod
    def _torch_layers(x: Tensor, layers: List[_EncoderLayer], kernel: str,
                      attend: Optional[Tensor], bsz: int, length: int,
                      real: Optional[Tensor] = None, native=None) -> Tensor:
        """The layers as torch operations around the products, on (bsz * length, C) rows;
        returns the rows at ``real`` (positions into them) only, where given: then every
        position-wise product runs on the real positions alone, and only attention sees the
        padded layout. ``native``: the native kernel whose attention runs (None: torch's)."""
        dim = x.size(1)
        attention = (_NativeEncoderAttention(native, layers[0], x, attend, bsz, length, real)
                     if native is not None else None)
        placed = None
        if real is not None:
            x = x.index_select(0, real)
            if attention is None:
                # the padded layout attention reads; its padding rows stay zero
                placed = x.new_zeros(bsz * length, 3 * dim)
        for layer in layers:
            norm_attn = layer.norm_attn
            residual = x
            if layer.pre_norm:
                x = norm_attn(x)
            qkv = layer.qkv(x, kernel)
            if attention is not None:
                out = attention(qkv)
            else:
                if placed is not None:
                    qkv = placed.index_copy_(0, real, qkv)
                qkv = qkv.view(bsz, length, 3, layer.heads, layer.head_dim)
                q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, S, head_dim)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=1.0)
                out = out.permute(0, 2, 1, 3).reshape(bsz * length, dim)
                if real is not None:
                    out = out.index_select(0, real)
            x = layer.out(out, kernel, add=residual)
            if not layer.pre_norm:
                x = norm_attn(x)
            x = layer.ffn(x, kernel)
        return x


class _NativeEncoderAttention:
    """An encoder layer's self-attention on the native kernel (native/layers.c
    ``pardec_attention``): the rows' keys and values go to one scratch buffer the layers share,
    and each query reads its own sentence's real keys."""

    def __init__(self, kernel, layer: _EncoderLayer, x: Tensor, attend: Optional[Tensor],
                 bsz: int, length: int, real: Optional[Tensor]):
        heads, head_dim = layer.heads, layer.head_dim
        self.kernel, self.width = kernel, heads * head_dim
        self.rows = x.size(0) if real is None else real.numel()
        self.keys = x.new_zeros(bsz, heads, length, head_dim)
        self.values = x.new_zeros(bsz, heads, length, head_dim)
        self.index = None if real is None else real.contiguous()
        # nonzero at padding: a key no query reads
        self.flags = None if attend is None else (~attend).reshape(bsz, length).contiguous()
        self.dims = (ctypes.c_int64 * ATTENTION_DIMS)(
            self.rows, bsz, heads, head_dim, length, torch.get_num_threads(), ENCODER_SELF)

    def __call__(self, qkv: Tensor) -> Tensor:
        qkv = qkv.contiguous()
        out = qkv.new_empty(self.rows, self.width)
        self.kernel.attention(ctypes.addressof(self.dims),
                              0 if self.index is None else self.index.data_ptr(), 0, 0,
                              self.keys.data_ptr(), self.values.data_ptr(),
                              0 if self.flags is None else self.flags.data_ptr(),
                              qkv.data_ptr(), out.data_ptr())
        return out
