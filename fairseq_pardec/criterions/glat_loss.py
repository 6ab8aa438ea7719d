"""``--criterion glat_loss``: training GAD's block drafter with random prefixes and glancing.

Per target y (EOS included) a prefix length p is drawn uniformly from 0..|y|-1; the decoder input
is [BOS, y_1..y_p, MASK x k] and the labels are y_{p+1..p+k} (padding past the end). Glancing
(GLAT, Qian et al. 2021): a first pass without gradients predicts the k slots; for each row,
ratio x (number of wrong slots) randomly chosen slots get their gold token as input, and the loss
is taken on the other slots. The ratio anneals linearly from ``--glat-ratio-start`` to
``--glat-ratio-end`` over ``--glat-anneal-updates`` updates. All of it is batched tensor code.
"""

from dataclasses import dataclass, field

import torch

from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics

from fairseq_pardec.errors import UsageError
from fairseq_pardec.criterions.seeding import update_generator


@dataclass
class GlatLossConfig(FairseqDataclass):
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing epsilon"})
    glat_ratio_start: float = field(default=0.5, metadata={"help": "glancing ratio at update 0"})
    glat_ratio_end: float = field(default=0.3, metadata={"help": "glancing ratio after annealing"})
    glat_anneal_updates: int = field(
        default=100000, metadata={"help": "updates over which the glancing ratio anneals"}
    )


def glancing_ratio(update, start, end, anneal_updates):
    if anneal_updates <= 0:
        return end
    frac = min(max(update, 0) / anneal_updates, 1.0)
    return start + (end - start) * frac


def sample_blocks(target, pad, bos, k, generator=None):
    """Random prefix per row -> (prefixes with BOS (B, T+1), prefix lengths (B,), labels (B, k))."""
    bsz = target.size(0)
    lengths = target.ne(pad).sum(1)
    p = (torch.rand(bsz, generator=generator, device="cpu").to(target.device) * lengths).long()
    p = torch.minimum(p, lengths - 1)
    prefixes = torch.cat([target.new_full((bsz, 1), bos), target], 1)
    padded = torch.cat([target, target.new_full((bsz, k), pad)], 1)
    idx = p.unsqueeze(1) + torch.arange(k, device=target.device)
    labels = padded.gather(1, idx)
    return prefixes, p, labels


@register_criterion("glat_loss", dataclass=GlatLossConfig)
class GlatLoss(FairseqCriterion):
    def __init__(self, task, label_smoothing, glat_ratio_start, glat_ratio_end, glat_anneal_updates):
        super().__init__(task)
        self.eps = label_smoothing
        self.ratio_start, self.ratio_end = glat_ratio_start, glat_ratio_end
        self.anneal_updates = glat_anneal_updates
        self.update_num = 0
        self.bos = task.target_dictionary.eos()  # fairseq decoders start from EOS

    def set_update_num(self, update_num):
        self.update_num = update_num

    def current_ratio(self):
        return glancing_ratio(self.update_num, self.ratio_start, self.ratio_end, self.anneal_updates)

    def forward(self, model, sample, reduce=True):
        if not hasattr(model, "draft_inputs"):
            raise UsageError("--criterion glat_loss needs --arch glat_drafter*")
        k = model.block_size
        target = sample["target"]
        # Draws keyed by the update and the batch's sentences, not torch's global stream: the same
        # batch gets the same prefixes and glances on any rank or --update-freq step, so N
        # processes train as one process with --update-freq N (see seeding.py).
        generator = update_generator(self.update_num, sample.get("id"))
        prefixes, p, labels = sample_blocks(target, self.padding_idx, self.bos, k, generator=generator)
        tokens, slots = model.draft_inputs(prefixes, p, k)
        net = sample["net_input"]
        encoder_out = model.encode(net["src_tokens"], net["src_lengths"])
        real = labels.ne(self.padding_idx)
        ratio = self.current_ratio() if model.training else 0.0
        glanced = torch.zeros_like(real)
        if ratio > 0:
            with torch.no_grad():
                pred = model.slot_logits(tokens, slots, encoder_out).argmax(-1)
            wrong = (pred.ne(labels) & real).sum(1)
            n_glance = (wrong.float() * ratio).long()
            # n_glance random real slots per row: rank random scores, padding slots last
            scores = torch.rand(labels.shape, generator=generator).to(labels.device)
            scores = scores.masked_fill(~real, 2.0)
            rank = scores.argsort(1).argsort(1)
            glanced = rank < n_glance.unsqueeze(1)
            slot_tokens = tokens.gather(1, slots)
            tokens = tokens.scatter(1, slots, torch.where(glanced, labels, slot_tokens))
        # through model(...), i.e. forward, so that torch's DDP (--ddp-backend pytorch_ddp)
        # all-reduces this pass's gradients (see GlatDrafterModel.forward)
        logits = model(net["src_tokens"], net["src_lengths"], tokens, slots=slots, encoder_out=encoder_out)
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        use = real & ~glanced
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs[use], labels[use], self.eps, ignore_index=None, reduce=reduce
        )
        sample_size = int(use.sum())
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample_size,
            "nsentences": target.size(0),
            "sample_size": sample_size,
            # Summable (ratio x sentences, divided back in reduce_metrics): multi-process training
            # sums logging outputs across ranks with all_reduce; fairseq's other path
            # (all_gather_list, for outputs that cannot be summed) allocates a CUDA buffer and
            # fails on CPU/gloo ("type torch.cuda.ByteTensor not available").
            "glat_ratio": ratio * target.size(0),
        }
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs):
        import math

        loss = sum(log.get("loss", 0) for log in logging_outputs)
        nll = sum(log.get("nll_loss", 0) for log in logging_outputs)
        size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss / max(size, 1) / math.log(2), size, round=3)
        metrics.log_scalar("nll_loss", nll / max(size, 1) / math.log(2), size, round=3)
        metrics.log_derived("ppl", lambda m: 2 ** m["nll_loss"].avg)
        sentences = sum(log.get("nsentences", 0) for log in logging_outputs)
        if sentences:
            ratio = sum(log.get("glat_ratio", 0) for log in logging_outputs) / sentences
            metrics.log_scalar("glat_ratio", ratio, round=3)

    @staticmethod
    def logging_outputs_can_be_summed():
        # True: every logging output is a sum (see "glat_ratio"), so fairseq all-reduces them,
        # which works with the gloo backend on CPU as well as with NCCL.
        return True
