"""A decoder's output projection for a few rows at a time on the CPU.

For a block of a few rows the CPU BLAS runs ``x @ W.T`` (what ``F.linear`` does) markedly slower
than ``x @ W_t`` with ``W_t`` a contiguous transposed copy (256 x 8496, 2 threads: 4 rows 1.4 ms
against 0.6 ms; docs/results.md "Where an iteration's time goes"). :class:`OutputProjection`
keeps that copy, refreshed when the weight changes. A single row keeps ``F.linear``: fairseq's
own one-token step, bit for bit. Either way a block's products round as other kernels do
(methods.md, lossless contract).
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase

from ..errors import UsageError


def base_projection(decoder) -> Optional[torch.nn.Linear]:
    """The decoder's vocabulary projection (``output_projection``) when it is a plain linear
    map without bias and no adaptive softmax replaces it; None otherwise."""
    proj = getattr(decoder, "output_projection", None)
    if (type(proj) is not torch.nn.Linear or proj.bias is not None
            or getattr(decoder, "adaptive_softmax", None) is not None):
        return None
    return proj


def plain_output_projection(decoder) -> Optional[torch.nn.Linear]:
    """:func:`base_projection` when the decoder's output layer is that projection and nothing
    else (fairseq's ``TransformerDecoderBase.output_layer``, or a decoder that says its own
    output layer equals it: ``output_layer_is_projection``); None otherwise."""
    own = getattr(decoder.output_layer, "__func__", None) is TransformerDecoderBase.output_layer
    if not (own or getattr(decoder, "output_layer_is_projection", False)):
        return None
    return base_projection(decoder)


class OutputProjection:
    """``logits(features)`` through a contiguous transposed copy of the projection weight.

    ``projection``: the ``nn.Linear`` from :func:`plain_output_projection`. Rows that are not
    a 2-D CPU block of >= 2 rows go through the linear layer itself.
    """

    def __init__(self, projection: torch.nn.Linear):
        self.projection = projection
        self._key = None
        self._weight_t = None

    def weight_t(self) -> Tensor:
        weight = self.projection.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._key != key:
            self._weight_t = self._transposed(weight.detach())
            self._key = key
        return self._weight_t

    def _transposed(self, weight: Tensor) -> Tensor:
        return weight.t().contiguous()

    def __call__(self, features: Tensor) -> Tensor:
        if features.device.type != "cpu" or features.dim() != 2 or features.size(0) < 2:
            return self.projection(features)
        return features @ self.weight_t()


def frequent_types(dictionary, count: int) -> Tensor:
    """Ids of EOS and the ``count - 1`` most frequent other types of a fairseq dictionary, by
    its counts (``dict.txt``; a joined dictionary counts both languages), most frequent first.
    Padding and the other specials are left out; ties keep dictionary order."""
    specials = {dictionary.pad(), dictionary.bos(), dictionary.unk(), dictionary.eos()}
    counts = torch.tensor(dictionary.count[: len(dictionary)], dtype=torch.float64)
    order = [i for i in torch.sort(-counts, stable=True).indices.tolist() if i not in specials]
    return torch.tensor([dictionary.eos()] + order[: max(0, count - 1)], dtype=torch.long)


class ShortlistProjection(OutputProjection):
    """Drafters' logits over a shortlist of the vocabulary (``--draft-vocab N``), -inf elsewhere.

    A draft is only a proposal: the verifier still scores the whole vocabulary, so what a
    shortlist costs is the drafts it cannot make (a type outside it is never drafted), and what
    it saves is most of the drafter's vocabulary projection, which at batch 1 on the CPU streams
    the whole output embedding per call (8,180 x 256 floats for ddtp-de-en).
    """

    def __init__(self, projection: torch.nn.Linear, ids: Tensor, vocab_size: int):
        super().__init__(projection)
        self.ids = ids.to(projection.weight.device)
        self.vocab_size = vocab_size

    def _transposed(self, weight: Tensor) -> Tensor:
        self.ids = self.ids.to(weight.device)
        return weight[self.ids].t().contiguous()

    def best(self, features: Tensor) -> Tensor:
        """(R, d) -> (R,) the best shortlisted type of each row (no full-vocabulary logits)."""
        return self.ids[(features @ self.weight_t()).argmax(dim=-1)]

    def __call__(self, features: Tensor) -> Tensor:
        """(R, d) -> (R, V) logits, -inf outside the shortlist."""
        short = features @ self.weight_t()
        out = short.new_full((features.size(0), self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.ids, short)


def draft_projection(projection: Optional[torch.nn.Linear], dictionary, draft_vocab: Optional[int]):
    """The drafter's projection: a shortlist of ``draft_vocab`` frequent types, the whole
    vocabulary through a transposed copy, or None (the decoder's own output layer must run:
    adaptive softmax, a bias)."""
    if projection is None:
        if draft_vocab is not None:
            raise UsageError("--draft-vocab needs a drafter whose output layer is a plain "
                             "projection (no adaptive softmax, no bias); drop --draft-vocab")
        return None
    if draft_vocab is not None and draft_vocab < len(dictionary):
        return ShortlistProjection(projection, frequent_types(dictionary, draft_vocab),
                                   projection.weight.size(0))
    return OutputProjection(projection)
