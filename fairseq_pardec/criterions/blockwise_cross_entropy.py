"""``--criterion blockwise_cross_entropy``: label-smoothed cross-entropy of the proposal heads.

Head p_i (i = 1..k) at decoder position t predicts target token t + i - 1. The paper (§ 6) trains
on one head drawn uniformly at random per batch (an unbiased estimate of the mean over heads
that needs one vocabulary projection instead of k); ``--head-sampling mean`` uses all k (k
projections per position: with k = 10 on a CPU a tenth of the updates); ``--head-sampling
position`` draws one head per target position, so every head learns in every batch for the
price of one projection (our addition, for models with many heads). Recurrent heads
(``--proposal-layer recurrent``) are unrolled at every position on the target tokens.
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

from fairseq_pardec.errors import UsageError
from fairseq_pardec.criterions.seeding import update_generator


@dataclass
class BlockwiseCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    head_sampling: ChoiceEnum(["random", "mean", "position"]) = field(
        default="random",
        metadata={"help": "train one random head per batch (paper), the mean over all heads, or "
                          "one random head per target position"},
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
        self.update_num = 0

    def set_update_num(self, update_num):
        """Called by translation_pardec's train_step: keys the head draws (seeding.py)."""
        self.update_num = update_num

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

    def one_head_per_position(self, outputs, target, heads, generator=None):
        """Draw a trainable head per target position: ([outputs (B, T, d)], [targets (B, T)]),
        head i at position t labelled with target t + i (pad past the end). ``generator``: a CPU
        generator to draw from (default: torch's global one)."""
        bsz, length = target.shape
        allowed = torch.tensor(heads, device=target.device)
        if generator is None:
            draw = torch.randint(len(heads), (bsz, length), device=target.device)
        else:
            draw = torch.randint(len(heads), (bsz, length), generator=generator).to(target.device)
        choice = allowed[draw]
        picked = outputs.gather(2, choice[..., None, None].expand(-1, -1, 1, outputs.size(-1))).squeeze(2)
        padded = torch.cat([target, target.new_full((bsz, max(heads)), self.padding_idx)], 1)
        positions = torch.arange(length, device=target.device).unsqueeze(0) + choice
        labels = padded.gather(1, positions).masked_fill(target.eq(self.padding_idx), self.padding_idx)
        return [picked], [labels]

    def head_outputs(self, decoder, features, target, count):
        """(B, T, count, d) outputs of heads 1..count at every position. Recurrent heads read
        the tokens before their own: at position t, the target tokens t .. t + count - 2 (what
        the verifier outputs there, so what exact acceptance feeds them whenever they count)."""
        if not decoder.proposals_read_tokens:
            return decoder.proposal(features, heads=count)
        if count == 1:
            return features.unsqueeze(-2)
        ahead = torch.stack([shift_target(target, j, self.padding_idx) for j in range(count - 1)], -1)
        later = decoder.proposal_features(features, count - 1, tokens=ahead)
        return torch.cat([features.unsqueeze(-2), later], dim=-2)

    def forward(self, model, sample, reduce=True):
        decoder = model.decoder
        if not hasattr(decoder, "proposal"):
            raise UsageError(
                "--criterion blockwise_cross_entropy needs --arch blockwise_transformer*"
            )
        features, _ = model(**sample["net_input"], features_only=True)
        heads = self.trainable_heads(decoder) if model.training else list(range(decoder.proposal_heads))
        if self.head_sampling == "random" and model.training:
            # One head per update, drawn from a generator keyed by the update (seeding.py), not
            # from torch's global stream: every rank and every --update-freq batch of an update
            # trains the same head, so N processes train as one process with --update-freq N.
            generator = update_generator(self.update_num)
            heads = [heads[int(torch.randint(len(heads), (1,), generator=generator))]]
        target = sample["target"]
        outputs = self.head_outputs(decoder, features, target, max(heads) + 1)
        if self.head_sampling == "position" and model.training:
            # draws keyed by the update and the batch's sentences: the same on any rank (seeding.py)
            generator = update_generator(self.update_num, sample.get("id"))
            outputs, targets = self.one_head_per_position(outputs, target, heads, generator)
            heads = [None]  # one projection, every head represented
        else:
            targets = [shift_target(target, head, self.padding_idx) for head in heads]
            outputs = [outputs[..., head, :] for head in heads]
        loss = nll_loss = 0.0
        n_tokens = 0
        for head_output, head_target in zip(outputs, targets):
            logits = TransformerDecoderBase.output_layer(decoder, head_output)
            lprobs = torch.log_softmax(logits.float(), dim=-1)
            head_loss, head_nll = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), head_target.reshape(-1), self.eps,
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
