"""``--criterion blockwise_cross_entropy``: label-smoothed cross-entropy of the proposal heads.

Head p_i (i = 1..k) at decoder position t predicts target token t + i - 1. The paper (§ 6) trains
on one head drawn uniformly at random per batch (an unbiased estimate of the mean over heads
that needs one vocabulary projection instead of k); ``--head-sampling mean`` uses all k.
"""

from dataclasses import dataclass, field

import torch

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)
from fairseq.dataclass import ChoiceEnum
from fairseq.models.transformer import TransformerDecoderBase

from ..errors import UsageError


@dataclass
class BlockwiseCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    head_sampling: ChoiceEnum(["random", "mean"]) = field(
        default="random",
        metadata={"help": "train one random head per batch (paper) or the mean over all heads"},
    )


def shift_target(target, offset, pad):
    """Target for a head looking ``offset`` tokens further ahead: left shift, pad at the end."""
    if offset == 0:
        return target
    shifted = target.new_full(target.size(), pad)
    shifted[:, :-offset] = target[:, offset:]
    return shifted


def _frozen(module):
    return not any(p.requires_grad for p in module.parameters())


@register_criterion("blockwise_cross_entropy", dataclass=BlockwiseCrossEntropyConfig)
class BlockwiseCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, head_sampling="random"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.head_sampling = str(head_sampling)

    @staticmethod
    def trainable_heads(decoder):
        """Heads whose loss reaches a trainable parameter: with an identity p_1 on a frozen base
        (--identity-first-head --freeze-base) p_1 is the base itself and has nothing to learn."""
        heads = list(range(decoder.proposal_heads))
        if decoder.proposal.identity_first_head and _frozen(decoder.layers):
            heads = heads[1:]
        if not heads:
            raise UsageError(
                "nothing to train: --proposal-heads 1 with --identity-first-head --freeze-base"
            )
        return heads

    def forward(self, model, sample, reduce=True):
        decoder = model.decoder
        if not hasattr(decoder, "proposal"):
            raise UsageError(
                "--criterion blockwise_cross_entropy needs --arch blockwise_transformer*"
            )
        features, _ = model(**sample["net_input"], features_only=True)
        heads = self.trainable_heads(decoder) if model.training else list(range(decoder.proposal_heads))
        if self.head_sampling == "random" and model.training:
            # fairseq seeds torch per update, so every worker draws the same head.
            heads = [heads[int(torch.randint(len(heads), (1,)))]]
        outputs = decoder.proposal(features, heads=max(heads) + 1)
        target = sample["target"]
        loss = nll_loss = 0.0
        n_tokens = 0
        for head in heads:
            logits = TransformerDecoderBase.output_layer(decoder, outputs[..., head, :])
            lprobs = torch.log_softmax(logits.float(), dim=-1)
            head_target = shift_target(target, head, self.padding_idx)
            head_loss, head_nll = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), head_target.view(-1), self.eps,
                ignore_index=self.padding_idx, reduce=reduce,
            )
            loss = loss + head_loss
            nll_loss = nll_loss + head_nll
            n_tokens += int(head_target.ne(self.padding_idx).sum())
        loss, nll_loss = loss / len(heads), nll_loss / len(heads)
        n_tokens = n_tokens / len(heads)
        sample_size = sample["target"].size(0) if self.sentence_avg else n_tokens
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": n_tokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output
