"""Rows encoded ahead of their join into a running batch.

A server at saturation has more texts waiting than places in its running batch. Encoding each
place's joiner as it frees up runs the encoder on one to three texts at a time, where the
products are far less efficient per token than on a batch of thirty (docs/results.md, "The
running batch at saturation"). :class:`EncodedRows` holds one encoder call's output for many
waiting texts; the server takes rows from it a few at a time as places free up, each take
trimmed to the source columns its rows use, so that a short text joins with no more source
padding than it would have had alone.

A row's encoder output then comes from a batch of other texts, as in any offline batch: it
rounds otherwise than alone, which the margin guard covers as it covers every batched product.
"""

from typing import Any, List, Tuple

import torch
from torch import Tensor

from fairseq.models.transformer import TransformerEncoderBase

# fairseq's encoder output keys, by where their source and row dimensions lie:
# (S, B, C) lists, (B, S[, C]) lists, and (B, 1) lists
_SOURCE_FIRST = ("encoder_out", "encoder_states")
_ROWS_FIRST = ("encoder_padding_mask", "encoder_embedding", "src_tokens")
_ROWS_ONLY = ("src_lengths",)


def encodes_ahead(model) -> bool:
    """Whether ``model``'s encoder output is fairseq's Transformer encoder dictionary, whose rows
    and source columns :class:`EncodedRows` knows how to take."""
    return isinstance(getattr(model, "encoder", None), TransformerEncoderBase)


class EncodedRows:
    """``sample``'s rows and their encoder output, from which rows are taken in any order."""

    def __init__(self, sample: dict, encoder_out: dict, pad: int, sources=None):
        unknown = [key for key, value in encoder_out.items()
                   if value and key not in _SOURCE_FIRST + _ROWS_FIRST + _ROWS_ONLY]
        if unknown:
            raise ValueError("encoder output with %s: rows cannot be taken from it"
                             % ", ".join(sorted(unknown)))
        self.sample, self.encoder_out, self.pad = sample, encoder_out, pad
        # what the decoder step projects of them at a join, projected now (or None):
        # step.project_sources
        self.sources = sources

    def __len__(self) -> int:
        return self.sample["net_input"]["src_tokens"].size(0)

    def take(self, positions: List[int]) -> Tuple[dict, dict, Any]:
        """The sample of the rows at ``positions`` (in that order; ids 0, 1, ...), their
        encoder output and their projected sources (or None), all cut to the source columns
        those rows use: ``generator.join(batch, *encoded.take(positions))``."""
        net_input = self.sample["net_input"]
        src_tokens = net_input["src_tokens"]
        order = torch.tensor(positions, dtype=torch.long, device=src_tokens.device)
        tokens = src_tokens.index_select(0, order)
        used = tokens.ne(self.pad).any(dim=0).nonzero().view(-1).tolist()
        columns = slice(used[0], used[-1] + 1) if used else slice(0, tokens.size(1))

        def rows_first(t: Tensor) -> Tensor:
            return t.index_select(0, order)[:, columns].contiguous()

        taken = {}
        for key, value in self.encoder_out.items():
            if not value:
                taken[key] = []
            elif key in _SOURCE_FIRST:
                taken[key] = [t.index_select(1, order)[columns] for t in value]
            elif key in _ROWS_FIRST:
                taken[key] = [rows_first(t) for t in value]
            else:
                taken[key] = [t.index_select(0, order) for t in value]
        sample = {
            "id": torch.arange(len(positions)),
            "nsentences": len(positions),
            "ntokens": int(tokens.ne(self.pad).sum()),
            "net_input": {"src_tokens": tokens[:, columns].contiguous(),
                          "src_lengths": net_input["src_lengths"].index_select(0, order)},
        }
        sources = None if self.sources is None else self.sources.take(order, columns)
        return sample, taken, sources
