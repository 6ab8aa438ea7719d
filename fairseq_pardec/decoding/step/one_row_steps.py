"""fairseq's incremental decoder steps for one sentence, one token a call: the margin guard's
replay, with the least Python between the tensor operations.

The margin guard (draft_verify/margin_guard.py) decides a close call by replaying fairseq's own
arithmetic over the sentence at batch 1: one decoder step per decided token, each over one new
token on the cache of the steps before. That is tens to a hundred and more steps per close call,
and at batch 1 a step's tensor operations are small enough that calling ``nn.Module``\\ s,
reading their attributes and building the lean step's block layout cost more than the products
(docs/results.md, "The close calls' replay").

:class:`OneRowSteps` runs the *same* tensor operations on the same shapes in the same order as
the lean step (step/lean.py) does for one dense position of one row, and so as fairseq's
``TransformerDecoderLayerBase.forward`` in incremental mode: the projections through
``F.linear`` with the layers' own weights, read once per replay, the layer norms through the
modules' own ``forward``, attention through the lean step's :meth:`LeanBlockDecoder._attend`.
Its features are bit for bit the lean step's (tests/test_fast_step.py). It covers the decoders
whose linear maps are plain ``nn.Linear`` modules with no hooks; :func:`one_row_supported` says
which, and the guard takes the lean step for the others.

A replay's cache stays valid for the row's later close calls: their prefixes extend this one's
with the tokens decided since, which fairseq's search would have fed one by one the same way.
:meth:`OneRowSteps.run` therefore takes up where the last run stopped (``fed``), so that a row
with close calls after 115, 118 and 150 tokens costs 150 steps, not 383 (a long output has
several: docs/results.md, "The close calls' replay").
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported
from fairseq_pardec.models.decoder_inputs import (embed_at, encoder_states, plain_input,
                                                  position_embeddings)

_attend = LeanBlockDecoder._attend


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _plain_linear(module) -> bool:
    return type(module) is torch.nn.Linear and not _hooked(module)


def one_row_supported(decoder) -> bool:
    """Whether :class:`OneRowSteps` computes ``decoder``'s steps: the lean step's layers, with
    plain linear maps and no hooks on the modules it calls without ``nn.Module.__call__``, and
    no global module hooks (which ``__call__`` would run)."""
    from torch.nn.modules import module as torch_module

    if not lean_supported(decoder) or decoder.training:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    for layer in decoder.layers:
        attn, cross = layer.self_attn, layer.encoder_attn
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, cross.q_proj,
                   cross.k_proj, cross.v_proj, cross.out_proj, layer.fc1, layer.fc2)
        norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm,
                 layer.final_layer_norm)
        if not all(_plain_linear(m) for m in linears) or any(_hooked(m) for m in norms):
            return False
    return True


class _Layer:
    """One decoder layer's weights and settings, read once per replay."""

    __slots__ = ("q", "k", "v", "out", "heads", "head_dim", "embed_dim", "scaling", "norm1",
                 "cross_q", "cross_out", "cross_heads", "cross_head_dim", "cross_embed_dim",
                 "cross_scaling", "norm2", "fc1", "fc2", "activation", "norm3", "before")

    def __init__(self, layer):
        attn, cross = layer.self_attn, layer.encoder_attn
        self.q, self.k, self.v, self.out = (_weights(m) for m in (attn.q_proj, attn.k_proj,
                                                                   attn.v_proj, attn.out_proj))
        self.heads, self.head_dim, self.embed_dim = attn.num_heads, attn.head_dim, attn.embed_dim
        self.scaling = attn.scaling
        self.cross_q, self.cross_out = _weights(cross.q_proj), _weights(cross.out_proj)
        self.cross_heads, self.cross_head_dim = cross.num_heads, cross.head_dim
        self.cross_embed_dim, self.cross_scaling = cross.embed_dim, cross.scaling
        self.norm1 = layer.self_attn_layer_norm.forward
        self.norm2 = layer.encoder_attn_layer_norm.forward
        self.norm3 = layer.final_layer_norm.forward
        self.fc1, self.fc2 = _weights(layer.fc1), _weights(layer.fc2)
        self.activation = layer.activation_fn
        self.before = layer.normalize_before


def _weights(linear) -> Tuple[Tensor, Optional[Tensor]]:
    return linear.weight, linear.bias


class OneRowSteps:
    """fairseq's incremental steps over one sentence's target tokens (see the module's text)."""

    def __init__(self, decoder, encoder_out):
        self.decoder = decoder
        self.layers = [_Layer(layer) for layer in decoder.layers]
        enc, enc_pad = encoder_states(encoder_out)  # (S, 1, C), (1, S)
        # the lean step's encoder keys and values, and its mask only where it masks something
        self.enc_pad = enc_pad.bool() if enc_pad is not None and bool(enc_pad.any()) else None
        self.enc_keys, self.enc_values = [], []
        for layer in decoder.layers:
            cross = layer.encoder_attn
            for proj, out in ((cross.k_proj, self.enc_keys), (cross.v_proj, self.enc_values)):
                states = F.linear(enc, proj.weight, proj.bias)
                out.append(states.contiguous().view(-1, cross.num_heads, cross.head_dim)
                           .transpose(0, 1))
        self.keys: List[Optional[Tensor]] = [None] * len(self.layers)
        self.values: List[Optional[Tensor]] = [None] * len(self.layers)
        # the last layer's input after each token fed: what its query, attention and
        # feed-forward read (``features_of_fed``), skipped while the steps only fill the cache
        self.last_inputs: List[Tensor] = []
        # the tokens whose keys and values the cache holds, in order (BOS first)
        self.fed: List[int] = []

    def continues(self, tokens: List[int]) -> bool:
        """Whether ``tokens`` extend what the cache holds by at least one token."""
        fed = self.fed
        return len(tokens) > len(fed) and tokens[: len(fed)] == fed

    def run(self, tokens: List[int], features_of_all: bool = False) -> List[Tensor]:
        """The decoder's features (1, d) after the last of ``tokens`` (the first is BOS), and
        after every one of them with ``features_of_all``; without it the steps before the last
        only fill the cache (the last layer's query, attention and feed-forward skipped, as the
        lean step's ``cache_only``). Where :meth:`continues` holds (and not all features are
        asked for), only the tokens past the cache's are fed: one feature is returned."""
        decoder = self.decoder
        device = decoder.embed_tokens.weight.device
        first = len(self.fed) if not features_of_all and self.continues(tokens) else 0
        self.fed = []  # until this run has fed every token: a run cut short leaves no cache
        if first == 0:
            self.keys = [None] * len(self.layers)
            self.values = [None] * len(self.layers)
            self.last_inputs = []
        steps = torch.tensor(tokens[first:], device=device).view(-1, 1, 1)
        offset = decoder.padding_idx + 1
        plain = plain_input(decoder)
        if plain:
            table, scale = decoder.embed_tokens.weight, decoder.embed_scale
            positions = position_embeddings(
                decoder, torch.arange(offset + first, offset + len(tokens), device=device))
        inputs = []
        for t in range(first, len(tokens)):
            if plain:  # embed_at's operations on one token
                x = scale * F.embedding(steps[t - first], table)
                if positions is not None:
                    x += positions[t - first]
            else:
                x = embed_at(decoder, steps[t - first],
                             torch.full((1, 1), t + offset, device=device))
            inputs.append(x.transpose(0, 1))
        outputs = self._layers(inputs, first, features_of_all)
        self.fed = list(tokens)
        return [self._features(x) for x in outputs]

    def features_of_fed(self) -> List[Tensor]:
        """The decoder's features (1, d) after each token the cache holds, bit for bit what
        :meth:`run` with ``features_of_all`` computes: the last layer is run again, step by step,
        on its inputs kept from the steps that only filled the cache (the layers below them are
        not), its keys and values rebuilt as those steps built them."""
        last = len(self.layers) - 1
        layer = self.layers[last]
        features, keys, values = [], None, None
        for t, x in enumerate(self.last_inputs):
            residual = x
            if layer.before:
                x = layer.norm1(x)
            k, v = self._keys_values(layer, x)
            k = keys = self._grown(keys, k, t)
            v = values = self._grown(values, v, t)
            features.append(self._features(self._rest_of_layer(last, layer, residual, x, k, v)))
        return features

    def _features(self, x: Tensor) -> Tensor:
        """The decoder's features after its layers' output ``x`` (1, 1, d)."""
        decoder = self.decoder
        if decoder.layer_norm is not None:
            x = decoder.layer_norm(x)
        x = x.reshape(1, -1)
        if decoder.project_out_dim is not None:
            x = decoder.project_out_dim(x)
        return x

    @staticmethod
    def _grown(cached: Optional[Tensor], new: Tensor, t: int) -> Tensor:
        """A layer's keys (or values) through step ``t``: the step's own at the first, else
        appended to the cached ones, as fairseq's incremental attention concatenates them."""
        return torch.cat([cached, new], dim=1) if t else new

    @staticmethod
    def _keys_values(layer: _Layer, x: Tensor) -> Tuple[Tensor, Tensor]:
        k = F.linear(x, *layer.k).view(-1, layer.heads, layer.head_dim).transpose(0, 1)
        v = F.linear(x, *layer.v).view(-1, layer.heads, layer.head_dim).transpose(0, 1)
        return k, v

    def _layers(self, inputs: List[Tensor], first: int, features_of_all: bool) -> List[Tensor]:
        """The layers over the steps ``first, first + 1, ...`` whose inputs (1, 1, d) are
        ``inputs``: the outputs after every step with ``features_of_all``, else after the
        last alone (the last layer's query, attention and feed-forward skipped before it).

        Layer by layer, each over every step, where fairseq runs step by step through every
        layer: each step's operations are the same, on the same shapes and inputs (a layer's
        step reads the layer below at that step and its own cache of the steps before), so the
        results are bit for bit fairseq's, while a layer's weights stay in the processor's
        caches across the steps instead of being read from memory at every step (what that
        saves: docs/results.md, "The close calls' replay, layer by layer")."""
        last = len(self.layers) - 1
        xs = list(inputs)
        for i, layer in enumerate(self.layers):
            for j, x in enumerate(xs):
                t = first + j
                if i == last:
                    self.last_inputs.append(x)
                residual = x
                if layer.before:
                    x = layer.norm1(x)
                k, v = self._keys_values(layer, x)
                k = self.keys[i] = self._grown(self.keys[i], k, t)
                v = self.values[i] = self._grown(self.values[i], v, t)
                if i == last and j + 1 < len(xs) and not features_of_all:
                    continue  # this step only fills the cache
                xs[j] = self._rest_of_layer(i, layer, residual, x, k, v)
        return xs if features_of_all else xs[-1:]

    def _rest_of_layer(self, i: int, layer: _Layer, residual: Tensor, x: Tensor, k: Tensor,
                       v: Tensor) -> Tensor:
        """Layer ``i`` after its keys and values ``k``, ``v`` (the cache's, this step's
        included): its query and self-attention from the input ``residual`` (``x``: as the
        keys' projections read it), then the encoder attention and the feed-forward."""
        q = F.linear(x, *layer.q)
        q *= layer.scaling
        q = q.view(1, layer.heads, layer.head_dim).transpose(0, 1)
        x = residual + F.linear(_attend(q, k, v, 1, 1, layer.embed_dim, None, None),
                                *layer.out)
        if not layer.before:
            x = layer.norm1(x)

        residual = x
        if layer.before:
            x = layer.norm2(x)
        q = F.linear(x, *layer.cross_q)
        q *= layer.cross_scaling
        q = q.view(1, layer.cross_heads, layer.cross_head_dim).transpose(0, 1)
        x = _attend(q, self.enc_keys[i], self.enc_values[i], 1, 1, layer.cross_embed_dim,
                    None, self.enc_pad)
        x = residual + F.linear(x, *layer.cross_out)
        if not layer.before:
            x = layer.norm2(x)

        residual = x
        if layer.before:
            x = layer.norm3(x)
        x = residual + F.linear(layer.activation(F.linear(x, *layer.fc1)), *layer.fc2)
        if not layer.before:
            x = layer.norm3(x)
        return x
