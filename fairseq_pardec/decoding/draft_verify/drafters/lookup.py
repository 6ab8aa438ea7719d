"""Lookup drafting: draft what followed the output's last tokens elsewhere, with no drafter model.

Where a continuation is looked up, in order:

1. the row's source and its own output so far (prompt lookup: names, numbers and identifiers
   that a translation carries over, and the verifier's own repetitions);
2. an n-gram table of target-side text (``--draft-corpus``: the training targets or, better, the
   verifier's own outputs from ``examples/distill.sh``): the most frequent next token after the
   longest known context, chained token by token.

Drafting costs a few dictionary lookups per row; nothing is trained. Verification is exact, so
the output stays identical to greedy decoding whatever is drafted.
"""

import logging
import os
import time
from array import array
from bisect import bisect_left
from typing import List, Optional, Tuple

import torch

from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.draft_verify.drafters.source_copy import COPY, CopyDrafter, CopyState

logger = logging.getLogger(__name__)

LOOKUP = "lookup"  # the kinds of draft: the source's or the output's own continuation of a match,
NGRAM = "ngram"  # and the n-gram table's


class NgramTable:
    """The most frequent next token after each context of 1..``order`` tokens of a corpus.

    Contexts are packed exactly into one int64 (``bits`` per token id), so the order is capped at
    what fits: 4 for vocabularies up to 32k types, 3 up to 1M. A sentence starts with ``start``
    (the decoder's BOS, fairseq's EOS) and ends with ``eos``; no context crosses sentences.
    Ties go to the smaller token id, so the table does not depend on the corpus order. Each
    order is a pair of int64 arrays (sorted contexts, their next tokens), searched by bisection:
    16 bytes per context.
    """

    def __init__(self, sentences: List[List[int]], vocab_size: int, start: int, eos: int,
                 order: int = 4):
        self.bits = max(1, (vocab_size - 1).bit_length())
        self.order = max(1, min(order, 62 // self.bits))
        self.eos = eos
        self.sentences = len(sentences)
        self.tables: List[Tuple[array, array]] = []
        if not sentences:
            return
        stream = torch.tensor([t for s in sentences for t in [start] + list(s) + [eos]],
                              dtype=torch.long)
        # offset of each position from its sentence's start: a context of n tokens before
        # position i exists only if i >= n within the sentence
        lengths = torch.tensor([len(s) + 2 for s in sentences])
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        offset = torch.arange(stream.numel()) - starts
        key = torch.zeros_like(stream)
        for n in range(1, self.order + 1):
            # context stream[i-n .. i-1] of the token at i: the older token in the higher bits
            key[n:] |= stream[:-n] << (self.bits * (n - 1))
            valid = offset >= n
            self.tables.append(self._most_frequent(key[valid], stream[valid]))

    @staticmethod
    def _most_frequent(contexts, nexts) -> Tuple[array, array]:
        # sorted by (context, next), equal pairs are runs: their lengths are the pairs' counts
        order = torch.argsort(nexts, stable=True)
        order = order[torch.argsort(contexts[order], stable=True)]
        contexts, nexts = contexts[order], nexts[order]
        new_pair = torch.ones_like(contexts, dtype=torch.bool)
        new_pair[1:] = (contexts[1:] != contexts[:-1]) | (nexts[1:] != nexts[:-1])
        starts = new_pair.nonzero().squeeze(1)
        counts = torch.diff(starts, append=starts.new_tensor([contexts.numel()]))
        contexts, nexts = contexts[starts], nexts[starts]
        # a stable sort by count (descending) then by context leaves each context's most
        # frequent next first, the smaller id first among ties
        order = torch.argsort(-counts, stable=True)
        order = order[torch.argsort(contexts[order], stable=True)]
        contexts, nexts = contexts[order], nexts[order]
        first = torch.ones_like(contexts, dtype=torch.bool)
        first[1:] = contexts[1:] != contexts[:-1]
        return (array("q", contexts[first].numpy().tobytes()),
                array("q", nexts[first].numpy().tobytes()))

    def contexts(self) -> int:
        """How many contexts the table knows, all orders together."""
        return sum(len(keys) for keys, _ in self.tables)

    def next_token(self, context: List[int]) -> Optional[int]:
        """The most frequent next token after the longest known suffix of ``context``."""
        keys, key = [], 0
        for n in range(1, min(self.order, len(context)) + 1):
            key |= context[-n] << (self.bits * (n - 1))
            keys.append(key)
        for n in range(len(keys), 0, -1):
            known, nexts = self.tables[n - 1]
            at = bisect_left(known, keys[n - 1])
            if at < len(known) and known[at] == keys[n - 1]:
                return nexts[at]
        return None

    def continuation(self, context: List[int], count: int) -> List[int]:
        """Up to ``count`` tokens, each the most frequent after the context and those before it;
        stops after EOS or where no suffix of the context is known."""
        context = list(context[-self.order:])
        out = []
        while len(out) < count:
            token = self.next_token(context)
            if token is None:
                break
            out.append(token)
            if token == self.eos:
                break
            context = (context + [token])[-self.order:]
        return out

    # Building the table sorts int64 copies of the corpus, a few hundred bytes per token at
    # order 4 while it builds: past this many tokens the rest of a corpus is not read, so a whole
    # training set cannot exhaust memory.
    MAX_TOKENS = 5_000_000

    @classmethod
    def from_file(cls, path: str, dictionary, order: int = 4) -> "NgramTable":
        """Table of a text file with one target-side sentence per line, in the model's subword
        units (as given to fairseq-preprocess); at most its first ``MAX_TOKENS`` tokens."""
        if not os.path.isfile(path):
            raise UsageError("--draft-corpus %s: no such file" % path)
        began = time.time()
        try:
            sentences, tokens, unknown = cls._read(path, dictionary)
        except UnicodeDecodeError as error:
            raise UsageError("--draft-corpus %s is not UTF-8 text (byte %d cannot be decoded): "
                             "give a text file of target-side sentences, one per line"
                             % (path, error.start)) from None
        if not sentences:
            raise UsageError("--draft-corpus %s has no sentences" % path)
        if unknown > tokens / 2:
            raise UsageError(
                "--draft-corpus %s: %d of its %d tokens are not in the target dictionary; give "
                "target-side text in the model's subword units (what fairseq-preprocess read)"
                % (path, unknown, tokens))
        table = cls(sentences, len(dictionary), dictionary.eos(), dictionary.eos(), order)
        logger.info("lookup drafter: n-gram table of %s (%d sentences, %d tokens, order %d, "
                    "%d contexts) built in %.1fs", path, len(sentences), tokens, table.order,
                    table.contexts(), time.time() - began)
        return table

    @classmethod
    def _read(cls, path, dictionary):
        """(token id lists, tokens, unknown tokens) of the file's first ``MAX_TOKENS`` tokens."""
        sentences, tokens, unknown = [], 0, 0
        unk, index = dictionary.unk(), dictionary.indices
        with open(path, encoding="utf-8") as text:
            for line in text:
                words = line.split()  # fairseq's tokenize_line: whitespace-separated units
                if not words:
                    continue
                if tokens + len(words) > cls.MAX_TOKENS:
                    logger.warning("lookup drafter: read the first %d sentences (%d tokens) of "
                                   "%s; the table's memory grows with the corpus, the rest is "
                                   "not used", len(sentences), tokens, path)
                    break
                ids = [index.get(word, unk) for word in words]
                sentences.append(ids)
                tokens += len(ids)
                unknown += sum(1 for t in ids if t == unk)
        return sentences, tokens, unknown


class LookupState(CopyState):
    """One batch's values of a lookup drafter: a copy drafter's, and per row its output's
    tokens by position (the first ``indexed`` of them), for local matches."""

    def __init__(self):
        super().__init__()
        self.output_positions, self.indexed = [], []

    ROW_FIELDS = CopyState.ROW_FIELDS + ("output_positions", "indexed")


class LookupDrafter(CopyDrafter):
    """Draft by lookup: the row's source and own output first, then the n-gram table.

    Local match: the longest suffix of the output (at most ``LOCAL_ORDER`` tokens) that occurs
    in [BOS] + source or earlier in the output; the draft is what follows its first occurrence
    (the source before the output at equal length). Without a local match the n-gram table
    (if any) continues the output. The caps (fixed ``block_size`` or adaptive, under the CPU
    ceiling) are the copy drafter's. What each source of drafts adds is measured in
    docs/results.md ("Lookup drafting: acceptance without a model").
    """

    LOCAL_ORDER = 4
    State = LookupState

    def __init__(self, src_dict, tgt_dict, table: Optional[NgramTable] = None, block_size=None,
                 adaptive=False, prices=None):
        super().__init__(src_dict, tgt_dict, block_size=block_size, adaptive=adaptive,
                         prices=prices)
        self.table = table
        # one kind of draft: a local match, else the table's continuation
        self.kinds = [LOOKUP]
        self.table_fallback = True

    def start(self, sample, encoder_out, bos: int, schedule=None) -> LookupState:
        state = super().start(sample, encoder_out, bos, schedule)
        state.output_positions = [{} for _ in range(state.rows)]
        state.indexed = [0] * state.rows
        return state

    @staticmethod
    def _index_output(state: LookupState, row: int):
        output, where = state.outputs[row], state.output_positions[row]
        for i in range(state.indexed[row], len(output)):
            where.setdefault(output[i], []).append(i)
        state.indexed[row] = len(output)

    @staticmethod
    def _first_match(sequence, positions, suffix, end):
        """First i with sequence[i-len(suffix)+1 .. i] == suffix and i < end, or None."""
        n = len(suffix)
        for i in positions.get(suffix[-1], ()):
            if i >= end:
                break
            if i >= n - 1 and sequence[i - n + 1: i + 1] == suffix:
                return i
        return None

    def _local(self, state: LookupState, row: int, cap: int) -> List[int]:
        output, source = state.outputs[row], state.source(row)
        self._index_output(state, row)
        for n in range(min(self.LOCAL_ORDER, len(output)), 0, -1):
            suffix = output[-n:]
            at = self._first_match(source, state.positions[row], suffix, len(source) - 1)
            if at is not None:
                return source[at + 1: at + 1 + cap]
            # an earlier occurrence in the output itself (ending before the last token)
            at = self._first_match(output, state.output_positions[row], suffix, len(output) - 1)
            if at is not None:
                return output[at + 1: at + 1 + cap]
        return []

    def cheap_draft(self, state: LookupState, kind: str, row: int, n: int,
                    length: int) -> List[int]:
        if kind == COPY:
            return super().cheap_draft(state, kind, row, n, length)
        if kind == LOOKUP:
            draft = self._local(state, row, length)
            if draft or not self.table_fallback or self.table is None:
                return draft
        return self.table.continuation(state.outputs[row], length)
