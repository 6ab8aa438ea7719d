"""The margin guard: where a decoder step's choice of token is certain, and fairseq's where not.

A decoder step that computes fairseq's function in another order or at other shapes (a verified
block of several positions, fused products, another kernel for the vocabulary projection, on the
CPU or on CUDA) rounds otherwise than fairseq's one-position steps: its log-probabilities are
within its declared ``margin`` of fairseq's (step/margins.py). fairseq's beam-1 search continues
with the first of ``topk(cumulative score + log-probs, 2)``. Where the step's best candidate leads
its runner-up by more than twice the margin plus the rounding of adding the score, fairseq's
search takes the same token whatever the rounding: the step's choice is certain. At the rare
closer positions the engine asks :func:`fairseq_decision` for the decision
``fairseq-generate --batch-size 1`` makes: fairseq's beam-1 search at batch 1 on the model's
device, with the tokens decided so far forced as a prefix.

It first runs the lean step once over that prefix as one block (teacher-forced), whose
log-probabilities are within a far smaller margin of fairseq's (step/margins.py): where the
lead is certain at that margin, that pass decides. Each of its products runs once over the
prefix's rows, so it costs a few milliseconds where fairseq's steps cost one step per decided
token. Only a lead within that margin too is replayed step by step with fairseq's own
arithmetic, bit for bit.
"""

import math
from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.decoding.fairseq_rules import beam_one, token_rules
from fairseq_pardec.decoding.step.block_layout import BlockLayout
from fairseq_pardec.decoding.step.lean import LeanBlockDecoder, lean_supported
from fairseq_pardec.decoding.step.margins import MarginsInForce, teacher_forced_margin
from fairseq_pardec.decoding.step.one_row_steps import OneRowSteps, one_row_supported

# float32's unit roundoff, doubled: adding a score of magnitude s rounds by at most s * 2**-24,
# on each of the two candidates.
_ADD_ROUNDING = 2.0 ** -23


def lead_is_certain(first: float, second: float, score_bound: float, margin: float) -> bool:
    """Whether fairseq's beam-1 search surely takes the best candidate of log-probabilities
    computed within ``margin`` of fairseq's: ``first`` leads the runner-up's ``second`` by more
    than the two margins and the rounding of adding fairseq's hypothesis score, of size at most
    ``score_bound``, to each. The one test of certainty; native/decide.c's lead_is_certain is
    the same formula.

    fairseq compares fl(S + f1) with fl(S + f2) for its own f1 >= first - margin and
    f2 <= second + margin; each sum rounds by at most u |S + f| (u = 2**-24), so the order is
    surely f1's where f1 - f2 exceeds u (2 |S| + |f1| + |f2|), which
    ``_ADD_ROUNDING * (score_bound + margin + (|first| + |second|) / 2)`` bounds. A runner-up
    of -inf (one candidate left) never ties."""
    if second == -math.inf:
        return True
    rounding = _ADD_ROUNDING * (score_bound + margin + (abs(first) + abs(second)) / 2)
    return first - second > 2 * margin + rounding


class RowReplay:
    """What a row's replay leaves for the row's next close call in the same batch: fairseq's
    encoder output for the sentence and the one-row steps' cache over the tokens decided so
    far (step/one_row_steps.py). A later decision whose prefix extends those tokens feeds only
    the tokens decided since."""

    __slots__ = ("encoder_out", "steps")

    def __init__(self):
        self.encoder_out = None
        self.steps = None


def fairseq_decision(generator, src_tokens: Tensor, decided: Tensor,
                     bos_token: Optional[int] = None, score_bound: Optional[float] = None,
                     resume: Optional[RowReplay] = None,
                     margins: Optional[MarginsInForce] = None) -> int:
    """The token fairseq's beam-1 search takes after ``decided`` for one source sentence.

    Args:
        generator: the draft-and-verify generator (its model, dictionary and search options).
        src_tokens: (S,) the sentence's source tokens (padding is dropped).
        decided: (P,) the target tokens before the decision (BOS excluded).
        score_bound: a bound on the size of fairseq's score of ``decided`` where the caller
            has one (the fast step's score plus P margins); it spares the replay the prefix's
            features.
        resume: the row's :class:`RowReplay`, kept by the caller between the row's close calls
            of one batch (the same sentence, the same weights), or None.
        margins: the margins in force on the model (step/calibration.py); None: the declared
            ones for its device and dtype (step/margins.py).
    """
    # on the model's device, as fairseq-generate moves its batch there
    device = next(generator.model.parameters()).device
    src = src_tokens[src_tokens.ne(generator.src_pad)].unsqueeze(0).to(device)
    decided = decided.to(device)
    sample = {"net_input": {"src_tokens": src,
                            "src_lengths": torch.tensor([src.size(1)], device=device)}}
    replayed = _replayed_decision(generator, sample, decided, bos_token, score_bound, resume,
                                  margins)
    if replayed is not None:
        return replayed
    # the search must reach the decision's step, and fairseq refuses a length limit below
    # --min-len (the steps after the decision do not change it)
    search = SequenceGenerator(
        [generator.model], generator.tgt_dict, beam_size=1, max_len_a=0,
        max_len_b=max(decided.numel() + 1, generator.min_len), max_len=generator.max_len,
        min_len=generator.min_len,
        normalize_scores=generator.normalize_scores, len_penalty=generator.len_penalty,
        unk_penalty=generator.unk_penalty, temperature=generator.temperature, eos=generator.eos,
    )
    prefix = decided.unsqueeze(0) if decided.numel() else None
    hypo = search.generate([generator.model], sample, prefix_tokens=prefix, bos_token=bos_token)[0][0]
    return int(hypo["tokens"][decided.numel()])


def _replayed_decision(generator, sample, decided: Tensor, bos_token: Optional[int],
                       score_bound: Optional[float] = None, resume: Optional[RowReplay] = None,
                       margins: Optional[MarginsInForce] = None):
    """:func:`fairseq_decision` by replaying what fairseq's ``SequenceGenerator`` computes for
    it, without its search bookkeeping and with the one-row steps (step/one_row_steps.py) or the
    lean step for the decoder layers; None where the replay does not apply (the caller then runs
    ``SequenceGenerator`` itself).

    fairseq's search with the decided tokens as a forced prefix runs, per step: the decoder over
    one new token (its incremental path; the lean step's layers compute it bit for bit,
    tests/test_lean_decoder.py, and the one-row steps as the lean step), the decoder's own
    output layer, the division by the temperature and the model's own normalisation, fairseq's
    edits of the log-probabilities; at a forced step the hypothesis score becomes the previous one plus the forced token's log-probability
    (float32), and at the step after the prefix the choice is beam-1's first of
    ``topk(score + log-probs, 2)``. The prefix's exact score is computed only where its rounding
    could tie the best two (below): a decision then costs the lean steps alone, with no output
    layer per step. With a bound on the prefix's score from the caller (the engine's: the fast
    step's score plus a margin per token), the prefix steps only fill the cache
    (``cache_only``: the last layer's query, attention and feed-forward skipped). What each
    saves is measured in docs/results.md ("The close calls' replay").
    tests/test_fast_step.py compares the replay with ``SequenceGenerator``, with and without a
    bound, on models where every way is taken.
    """
    model, decoder = generator.model, generator.model.decoder
    steps = decided.numel()
    # SequenceGenerator's length limit for this search: step `steps` must lie below it
    if not lean_supported(decoder) or steps + 1 > generator.max_len - 1:
        return None
    if resume is not None and resume.encoder_out is not None:
        encoder_out = resume.encoder_out
    else:
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        if resume is not None:
            resume.encoder_out = encoder_out
    tokens = [generator.eos if bos_token is None else bos_token] + decided.tolist()

    def log_probs(features: Tensor) -> Tensor:
        """fairseq's adjusted log-probabilities after ``features`` (one row: as fairseq's step)."""
        logits = decoder.output_layer(features.unsqueeze(1))  # (N, 1, V), as fairseq's
        logits = logits[:, -1:, :].div_(generator.temperature)
        lprobs = model.get_normalized_probs((logits, None), log_probs=True)[:, -1, :]
        token_rules(lprobs, generator.pad, generator.unk, generator.unk_penalty)
        return lprobs

    def decision_log_probs(features: Tensor) -> Tensor:
        """:func:`log_probs` at the decision's step, with fairseq's bar on EOS below --min-len."""
        lprobs = log_probs(features)
        if steps < generator.min_len:
            lprobs[:, generator.eos] = -math.inf
        return lprobs

    # one pass over the whole prefix first, certain where its lead beats its own margin
    if score_bound is not None:
        certain = _teacher_forced_choice(decoder, encoder_out, tokens, decision_log_probs,
                                         score_bound, margins)
        if certain is not None:
            generator.stats.close_calls_in_one_pass += 1
            return certain
    # with a bound on the prefix's score, the prefix steps only fill the cache
    computed, steps_run = _fairseq_features(decoder, encoder_out, tokens,
                                            features_of_all=score_bound is None, resume=resume)
    *prefix, features = computed
    lprobs = decision_log_probs(features)
    if steps == 0:
        return _choice(lprobs, np.float32(0.0))
    # The prefix's score only matters where adding it could tie the best two log-probs. A bound
    # on its size comes from the caller, or from one product over all prefix positions (rounded
    # otherwise than fairseq's one-row products, by ~1e-6 per position: the bound adds 1e-3 per
    # position); the exact score, one output layer per position as fairseq computes it, only
    # where needed.
    if score_bound is None:
        tokens_after = torch.tensor(tokens[1:], device=features.device).unsqueeze(1)
        rough = log_probs(torch.cat(prefix)).gather(1, tokens_after).sum().abs().item()
        score_bound = rough + 1e-3 * (steps + 1)
    top = lprobs.topk(2, dim=-1).values[0].tolist()
    if lead_is_certain(top[0], top[1], score_bound, 0.0):  # fairseq's own log-probs
        return int(lprobs.argmax(dim=-1)[0])
    if not prefix:  # the prefix's features are needed after all
        if steps_run is None:  # the lean step's replay, again with them
            return _replayed_decision(generator, sample, decided, bos_token)
        # the one-row steps run their last layer again on what it read; the layers below
        # are not run again
        prefix = steps_run.features_of_fed()[:-1]
    score = None
    for t, features in enumerate(prefix):
        lp = log_probs(features)[:, tokens[t + 1]]
        score = lp if score is None else score + lp
    return _choice(lprobs, np.float32(score.item()))


def _teacher_forced_choice(decoder, encoder_out, tokens: List[int], decision_log_probs,
                           score_bound: float,
                           margins: Optional[MarginsInForce] = None) -> Optional[int]:
    """fairseq's choice after ``tokens`` (BOS first) where one teacher-forced pass of the lean
    step over all of them, a block of the whole prefix, certifies it (``decision_log_probs``:
    features -> fairseq's adjusted log-probabilities at the decision); None where its lead is
    within that pass's own margin (``margins.teacher_forced`` as measured on the model,
    step/calibration.py; without ``margins`` the declared one, step/margins.py,
    ``teacher_forced_margin``) and the rounding of adding a score of size up to ``score_bound``.

    The pass runs each product once over the prefix's rows, on every thread, where fairseq's
    steps run one row at a time, each product then bound by reading its weights on one thread:
    a few milliseconds against a step per decided token. Its
    log-probabilities are within 1.6e-5 of fairseq's on the README models (margins.py), its
    margin a third of the fast step's, so close calls whose lead is not too close end here;
    the rest are replayed step by step."""
    weight = decoder.embed_tokens.weight
    if margins is not None:
        margin = margins.teacher_forced
    else:
        margin = teacher_forced_margin(weight.device, weight.dtype)
    if margin is None:
        return None
    device = weight.device
    step = LeanBlockDecoder(decoder)
    block = torch.tensor([tokens], device=device)
    layout = BlockLayout(torch.zeros(1, len(tokens), dtype=torch.bool, device=device), dense=True)
    features = step.forward_packed(block, torch.zeros(1, dtype=torch.long, device=device), layout,
                                   encoder_out, step.new_state())
    lprobs = decision_log_probs(features[-1:])
    if lprobs.size(-1) < 2:
        return 0
    values, indices = lprobs.topk(2, dim=-1)
    first, second = values[0].tolist()
    # fairseq's log-probs are each within the pass's margin of these
    if lead_is_certain(first, second, score_bound, margin):
        return int(indices[0, 0])
    return None


def _fairseq_features(decoder, encoder_out, tokens, features_of_all: bool,
                      resume: Optional[RowReplay] = None):
    """The decoder's features after the last of ``tokens`` (BOS first) as fairseq's incremental
    steps compute them, at batch 1, one token a step; after every token with
    ``features_of_all``. :class:`OneRowSteps` where it covers the decoder (from where the row's
    last replay stopped, with ``resume``), else the lean step. Returns the features and the
    :class:`OneRowSteps` that computed them (None: the lean step did)."""
    if one_row_supported(decoder):
        steps = resume.steps if resume is not None else None
        if steps is None:
            steps = OneRowSteps(decoder, encoder_out)
            if resume is not None:
                resume.steps = steps
        return steps.run(tokens, features_of_all), steps
    device = decoder.embed_tokens.weight.device
    step = LeanBlockDecoder(decoder)
    cache = step.new_state()
    one = BlockLayout(torch.zeros(1, 1, dtype=torch.bool, device=device), dense=True)
    features = []
    for t, token in enumerate(tokens):
        last = t + 1 == len(tokens)
        out = step.forward_packed(torch.tensor([[token]], device=device),
                                  torch.tensor([t], device=device), one, encoder_out, cache,
                                  cache_only=not (last or features_of_all))
        if out is not None:
            features.append(out)
    return features, None


def _choice(lprobs: Tensor, score: np.float32) -> int:
    """fairseq's beam-1 choice over one row of adjusted log-probabilities (1, V)."""
    if lprobs.size(-1) < 2:
        return 0
    values, indices = lprobs.topk(2, dim=-1)
    first, second = values[0].tolist()
    return beam_one(lprobs, 0, int(indices[0, 0]), first, second, score)[0]
