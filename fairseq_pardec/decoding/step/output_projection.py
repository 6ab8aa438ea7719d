"""A decoder's output projection for a few rows at a time on the CPU.

On the CPU the projection onto the vocabulary is the largest product of a decoding step, and
MKL, which ``F.linear`` calls, is slow at it for the row counts decoding has (1 to 64); oneDNN
with the weight packed once into its blocked layout is about twice as fast there (docs/results.md,
"A packed output projection"; ``examples/projection_cost.py``).
:class:`OutputProjection` keeps that packed copy, refreshed when the weight changes, and falls
back to a contiguous transposed copy (``x @ W_t``, faster than ``F.linear`` too) where oneDNN
cannot run.
Either way the products round differently from fairseq's ``F.linear`` (by about 1e-6 in
float32; methods.md, lossless contract).
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase

from fairseq_pardec.decoding.step import onednn
from fairseq_pardec.decoding.step.weights_key import WeightsKey
from fairseq_pardec.errors import UsageError


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
    """``logits(features)`` for 2-D CPU features through oneDNN's packed copy of the weight
    (float32) or a contiguous transposed copy (other dtypes, or no oneDNN); anything else goes
    through the linear layer itself.

    ``projection``: the ``nn.Linear`` from :func:`plain_output_projection`.
    """

    def __init__(self, projection: torch.nn.Linear):
        self.projection = projection
        self._fingerprint = WeightsKey(projection)
        # (key, held, copy, packed): replaced whole when rebuilt, so that threads sharing this
        # projection never read one version's copy with another's layout
        self._state = None

    def _weight(self, weight: Tensor) -> Tensor:
        """The rows this projection scores (all of them here)."""
        return weight

    def _prepared(self):
        """(the weight copy, whether it is oneDNN-packed), rebuilt when the weight may have
        changed (weights_key.py)."""
        key = self._fingerprint.key()
        state = self._state
        if state is None or state[0] != key:
            held = self._fingerprint.hold()
            with torch.no_grad():
                rows = self._weight(self.projection.weight.detach())
                packed = (rows.device.type == "cpu" and rows.dtype == torch.float32
                          and onednn.packs_on_onednn())
                if packed:
                    copy = onednn.pack(rows)
                else:
                    copy = rows.t().contiguous()
            state = self._state = (key, held, copy, packed)
        return state[2], state[3]

    def _product(self, features: Tensor) -> Tensor:
        """features (R, d) times the prepared weight: (R, rows of the weight)."""
        copy, packed = self._prepared()
        if packed:
            return onednn.linear(features, copy)
        return features @ copy

    def __call__(self, features: Tensor) -> Tensor:
        if (features.device.type != "cpu" or features.dim() != 2
                or features.dtype != self.projection.weight.dtype):
            return self.projection(features)
        return self._product(features)


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
    the whole output embedding per call.
    """

    def __init__(self, projection: torch.nn.Linear, ids: Tensor, vocab_size: int):
        super().__init__(projection)
        self.ids = ids.to(projection.weight.device)
        self.vocab_size = vocab_size

    def _weight(self, weight: Tensor) -> Tensor:
        self.ids = self.ids.to(weight.device)
        return weight[self.ids]

    def best(self, features: Tensor) -> Tensor:
        """(R, d) -> (R,) the best shortlisted type of each row (no full-vocabulary logits)."""
        return self.ids[self._product(features).argmax(dim=-1)]

    def __call__(self, features: Tensor) -> Tensor:
        """(R, d) -> (R, V) logits, -inf outside the shortlist."""
        short = self._product(features)
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
