"""What the draft-and-verify engine asks of a decoder step: the members it and its host decisions
read, declared once.

Every step (block_decoder.BlockDecoder, lean.LeanBlockDecoder, cpu/fast.FastBlockDecoder,
cuda/static.StaticBlockDecoder) has each member, with an honest default where it has nothing to say
(no native scores kernel, no kernel choice of its own, not fast), so that the engine never probes
a step for what it might have. Which step decodes a model is chosen per batch, from the model's
device and dtype at that moment (step_factory.StepChoice).
"""

from typing import Any, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from torch import Tensor

from fairseq_pardec.decoding.step.block_layout import BlockLayout


class BestTwoKernel(Protocol):
    """A native pass over log-probabilities (native/scores.c)."""

    def best_two(self, scores: Tensor, rules=None) -> Tuple[np.ndarray, np.ndarray, int, int]:
        """Per row of (N, V) contiguous float32 scores: ``values`` (N, 2) float32, its [best,
        second] values, ``best`` (N,) int64, the first column holding the largest, and the two
        arrays' addresses (the native decisions read them). ``rules`` (fairseq_rules.SearchRules
        or None): fairseq's token edits, made in ``scores`` in the same pass."""


@runtime_checkable
class DecoderStep(Protocol):
    """One decoder's block step over a cache of its own (the ``state``)."""

    @property
    def fast(self) -> bool:
        """Whether the step computes fairseq's function in its own, faster operations (the
        engine then encodes with the fast encoder where that covers the encoder)."""

    @property
    def kernels(self) -> Optional[Any]:
        """The product kernels measured on the decoder's shapes (cpu/products.KernelChoice),
        handed on to the fast encoder as they are; None: the step has no such choice (the
        encoder measures its own)."""

    @property
    def margin(self) -> Optional[float]:
        """A bound on |this step's log-probability - fairseq's| (step/margins.py); None where
        no bound is claimed (half precision)."""

    @property
    def one_position_exact(self) -> bool:
        """Whether a plain greedy step (one position per row, on a cache only such steps
        filled) rounds exactly as fairseq's does."""

    def new_state(self, max_len: Optional[int] = None) -> Any:
        """An empty cache for one batch whose rows output at most ``max_len`` tokens (EOS
        included); a step with fixed-size buffers (the static CUDA step) sizes them from it
        once, the others grow as rows do."""

    def reads_encoder_out(self, state: Any) -> bool:
        """Whether the next ``forward_packed`` on ``state`` reads its ``encoder_out``."""

    def forward_packed(self, tokens: Tensor, start: Tensor, layout: BlockLayout, encoder_out,
                       state: Any) -> Tensor:
        """(B, L) block tokens at decoder steps ``start[b] + i`` on top of ``state`` -> (N, d)
        features at the block's real positions, packed as ``layout`` says; the block's keys and
        values are appended to ``state``."""

    def log_probs(self, features: Tensor, temperature: float = 1.0, state: Any = None) -> Tensor:
        """(..., d) features -> (..., V) float32 log-probabilities, as fairseq normalises them.
        ``state``: the cache of the ``forward_packed`` call that returned ``features``, where
        the caller has it: the step may have computed their scores in that call, or holds
        there the output projection the batch started with."""

    def scores_kernel(self, state: Any = None) -> Optional[BestTwoKernel]:
        """The native kernel for the two best scores per position of the float32 (N, V)
        ``log_probs(features, temperature, state)`` of a call on ``state``; None where there
        is none (read them with ``topk``)."""

    def rollback(self, state: Any, block_len: int, keep: Tensor,
                 keep_range: Optional[Tuple[int, int]] = None) -> None:
        """Of the last ``block_len`` cache entries keep the first ``keep[b]`` per row
        (``keep_range``: their (min, max), when known on the host)."""

    def compact(self, state: Any, min_holes: float = 0.5) -> None:
        """Squeeze rolled-back holes out of the cache when they are ``min_holes`` of it."""

    @property
    def joins_rows(self) -> bool:
        """Whether rows may join a running batch of this step's (``join_rows``)."""

    def join_rows(self, state: Any, encoder_out, rows: int, sources: Any = None) -> None:
        """``rows`` rows join the batch of ``state``, after its rows, with ``encoder_out``
        their encoder's output; their cache starts empty, and no running row's changes.
        ``sources``: their sources as ``project_sources`` projected them ahead (rows taken
        from it), where the step made such a thing."""

    def project_sources(self, encoder_out) -> Any:
        """What ``join_rows`` reads of rows' encoder output, computed now for rows that join
        later: an object whose ``take(order, columns)`` gives some rows, cut to some source
        columns; None where the step computes it at the join."""

    def reorder(self, state: Any, new_order: Tensor) -> None:
        """Keep (and reorder) the batch's rows: finished rows leave."""


@runtime_checkable
class DrafterStep(DecoderStep, Protocol):
    """What a block-causal drafter model asks of the step over its own cache
    (drafters/glat.py): a decoder step whose call takes its own positions and mask, and whose
    cache can drop the columns of its mask slots. The lean and fast steps are such steps."""

    decoder: Any  # the fairseq decoder it runs

    def forward_packed(self, tokens: Tensor, start: Tensor, layout: BlockLayout, encoder_out,
                       state: Any, steps: Optional[Tensor] = None,
                       block_mask: Optional[Tensor] = None) -> Tensor:
        """As :meth:`DecoderStep.forward_packed`; ``steps`` (B, L): each position's decoder
        step where it is not ``start[b] + i``; ``block_mask`` (L, L) additive: attention inside
        the block where it is not causal (the cache stays visible to every position)."""

    def cache_length(self, state: Any) -> int:
        """The longest row's entries in ``state`` (holes included, where a step has them)."""

    def drop_columns(self, state: Any, first: int, count: int) -> None:
        """Remove the first ``count`` positions of the block just decoded from every row,
        moving the row's later entries forward; ``first``: :meth:`cache_length` before that
        block."""
