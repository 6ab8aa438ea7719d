"""The margin guard: where the fast step's choice of token is certain, and fairseq's where not.

The fast decoder step (step/fast.py) rounds differently from fairseq's op order: its
log-probabilities are within ``margin`` of fairseq's (a bound measured with a wide safety factor,
fast_step.DEFAULT_MARGIN). fairseq's beam-1 search continues with the first of
``topk(cumulative score + log-probs, 2)``. Where the fast step's best candidate leads its runner-up
by more than twice the margin plus the rounding of adding the score, fairseq's search takes the
same token whatever the rounding: the fast choice is certain. At the rare closer positions the
engine asks :func:`fairseq_decision`, which runs fairseq's own ``SequenceGenerator`` over the
sentence with the tokens decided so far forced as a prefix: the decision of fairseq's arithmetic,
as ``fairseq-generate --batch-size 1`` makes it.
"""

from typing import Optional

import torch
from torch import Tensor

from fairseq.sequence_generator import SequenceGenerator

# float32's unit roundoff, doubled: adding a score of magnitude s rounds by at most s * 2**-24,
# on each of the two candidates.
_ADD_ROUNDING = 2.0 ** -23


def close_calls(top: Tensor, scores_before: Tensor, margin: float) -> Tensor:
    """(N,) True where rounding within ``margin`` could change fairseq's choice of token.

    Args:
        top: (N, 2) the two best adjusted log-probabilities from the fast step, best first
            (``beam_one_choice``'s); (N, 1) when the vocabulary has one word.
        scores_before: (N,) cumulative score of each position's hypothesis.
    """
    if top.size(-1) < 2:
        return torch.zeros(top.shape[:-1], dtype=torch.bool, device=top.device)
    lead = top[:, 0] - top[:, 1]  # +inf where only one candidate is left (EOS forced)
    slack = 2 * margin + _ADD_ROUNDING * (scores_before.abs() + top[:, 0].abs())
    return ~(lead > slack)


def fairseq_decision(generator, src_tokens: Tensor, decided: Tensor,
                     bos_token: Optional[int] = None) -> int:
    """The token fairseq's beam-1 search takes after ``decided`` for one source sentence.

    Args:
        generator: the draft-and-verify generator (its model, dictionary and search options).
        src_tokens: (S,) the sentence's source tokens (padding is dropped).
        decided: (P,) the target tokens before the decision (BOS excluded).
    """
    src = src_tokens[src_tokens.ne(generator.src_pad)].unsqueeze(0)
    search = SequenceGenerator(
        [generator.model], generator.tgt_dict, beam_size=1, max_len_a=0,
        max_len_b=decided.numel() + 1, max_len=generator.max_len, min_len=generator.min_len,
        normalize_scores=generator.normalize_scores, len_penalty=generator.len_penalty,
        unk_penalty=generator.unk_penalty, temperature=generator.temperature, eos=generator.eos,
    )
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src.size(1)])}}
    prefix = decided.unsqueeze(0) if decided.numel() else None
    hypo = search.generate([generator.model], sample, prefix_tokens=prefix, bos_token=bos_token)[0][0]
    return int(hypo["tokens"][decided.numel()])
