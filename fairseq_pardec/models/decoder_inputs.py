"""What a fairseq Transformer decoder reads besides its own states (its input embeddings at
explicit positions, the encoder's output), and how its features leave the last layer.

fairseq's decoder derives each token's position from its index (or, incrementally, from the
length of its cache). A block-causal drafter and the draft-and-verify engine feed tokens whose
positions are not their index (mask slots, ragged blocks, rows at different lengths), so they
give the positions explicitly; everything else is fairseq's own computation, in its order.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules import LearnedPositionalEmbedding


def position_embeddings(decoder, positions: Tensor) -> Optional[Tensor]:
    """Rows of the decoder's own position table for explicit (already offset) positions."""
    module = decoder.embed_positions
    if module is None:
        return None
    if isinstance(module, LearnedPositionalEmbedding):
        return F.embedding(positions, module.weight, module.padding_idx)
    needed = int(positions.max()) + 1
    if needed > module.weights.size(0):
        # Let fairseq grow its sinusoid table exactly as it would itself.
        module(positions.new_zeros(1, needed - module.padding_idx - 1))
    return module.weights.index_select(0, positions.reshape(-1)).view(
        positions.size() + (-1,)
    ).detach()


def plain_input(module) -> bool:
    """True when a decoder's :func:`embed_at` (or a Transformer encoder's embedding) is just the
    scaled token row plus the position row: a plain float32 ``nn.Embedding`` table, no input
    projection, layer norm, quantisation noise or active dropout on the way in (the fast step
    and encoder then read the two tables directly). An encoder has no input projection."""
    table = module.embed_tokens
    dropout = module.dropout_module
    return (type(table) is torch.nn.Embedding and table.max_norm is None
            and table.weight.dtype == torch.float32 and module.quant_noise is None
            and getattr(module, "project_in_dim", None) is None
            and module.layernorm_embedding is None
            and not dropout.training and not dropout.apply_during_inference)


def embed_at(decoder, tokens: Tensor, positions: Tensor) -> Tensor:
    """Same operations, in the same order, as ``extract_features_scriptable``'s embedding."""
    x = decoder.embed_scale * decoder.embed_tokens(tokens.contiguous())
    if decoder.quant_noise is not None:
        x = decoder.quant_noise(x)
    if decoder.project_in_dim is not None:
        x = decoder.project_in_dim(x)
    pos = position_embeddings(decoder, positions)
    if pos is not None:
        x += pos
    if decoder.layernorm_embedding is not None:
        x = decoder.layernorm_embedding(x)
    return decoder.dropout_module(x)


def residual_sublayer(x: Tensor, norm, pre_norm: bool, apply) -> Tensor:
    """One sublayer of a fairseq Transformer layer in fairseq's order: ``x + f(norm(x))`` with
    ``pre_norm``, else ``norm(x + f(x))``. ``apply(h, residual)`` computes ``f(h) + residual``
    itself, so that a step may fuse the addition into its last product."""
    out = apply(norm(x) if pre_norm else x, x)
    return out if pre_norm else norm(out)


def final_features(decoder, x: Tensor, time_major: bool) -> Tensor:
    """The end of fairseq's ``extract_features_scriptable`` on the last layer's output ``x``:
    the final layer norm, batch-first order (when ``x`` is time-major, (T, B, C)), and the
    projection out of the model dimension. Packed rows (N, C) pass with ``time_major=False``."""
    if decoder.layer_norm is not None:
        x = decoder.layer_norm(x)
    if time_major:
        x = x.transpose(0, 1)
    if decoder.project_out_dim is not None:
        x = decoder.project_out_dim(x)
    return x


def encoder_states(encoder_out) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(encoder states (S, B, C), padding mask (B, S)) of fairseq's encoder output dictionary;
    None for what it lacks (a decoder-only model, no padding)."""
    if not encoder_out:
        return None, None
    states, pad = encoder_out["encoder_out"], encoder_out["encoder_padding_mask"]
    return (states[0] if len(states) else None), (pad[0] if len(pad) else None)
