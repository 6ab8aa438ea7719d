"""Drafters: what proposes the next tokens of each row for the verifier to check.

One module per kind: ``base`` (the interface; no drafts), ``source_copy`` (iad), ``lookup``
(the source, the output itself and an n-gram table), ``proposal_heads`` (blockwise), ``glat``
(gad), ``auto`` (the one of them that pays, per row), ``pricing`` (what an iteration costs and
what a draft must gain) and ``loading`` (a drafter checkpoint next to its verifier).
"""

from fairseq_pardec.decoding.draft_verify.drafters.auto import AutoDrafter
from fairseq_pardec.decoding.draft_verify.drafters.base import (DraftOutcome, Drafter, DraftView,
                                                                NoDrafter, pad_drafts)
from fairseq_pardec.decoding.draft_verify.drafters.glat import CachedNARDrafter, NARDrafter
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable
from fairseq_pardec.decoding.draft_verify.drafters.pricing import (FixedPrices, IterationPrices,
                                                                  MeasuredPrices)
from fairseq_pardec.decoding.draft_verify.drafters.proposal_heads import HeadsDrafter
from fairseq_pardec.decoding.draft_verify.drafters.source_copy import CopyDrafter, SourceVocabularyMap

__all__ = ["Drafter", "DraftView", "DraftOutcome", "NoDrafter", "pad_drafts", "CopyDrafter", "SourceVocabularyMap",
           "LookupDrafter", "NgramTable", "HeadsDrafter", "NARDrafter", "CachedNARDrafter",
           "AutoDrafter", "IterationPrices", "FixedPrices", "MeasuredPrices"]
