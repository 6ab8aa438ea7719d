"""fairseq's own SequenceGenerator (beam search, and greedy = beam 1) with our statistics."""

import copy

from fairseq.sequence_generator import SequenceGenerator

from fairseq_pardec.decoding.decode_stats import DecodeStats, count_hypotheses, timed
from fairseq_pardec.errors import running_a_cli


class CountingSequenceGenerator(SequenceGenerator):
    """Unchanged fairseq search; counts decoder calls and times ``generate``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = DecodeStats()
        forward_decoder = self.model.forward_decoder

        def counting_forward_decoder(*a, **kw):
            self.stats.decoder_calls += 1
            return forward_decoder(*a, **kw)

        # An instance attribute shadows the (eager-mode) method of fairseq's EnsembleModel.
        self.model.forward_decoder = counting_forward_decoder

    def generate(self, models, sample, **kwargs):
        device = sample["net_input"]["src_tokens"].device
        with timed(self.stats, device):
            hypos = super().generate(models, sample, **kwargs)
        count_hypotheses(self.stats, hypos)
        # A sentence stays in the search until its last finished hypothesis, whose length
        # (EOS included) is the number of steps it took part in.
        self.stats.row_iterations += sum(
            max(len(h["tokens"]) for h in sent) for sent in hypos if sent
        )
        return hypos


def build_beam(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    from fairseq.tasks.fairseq_task import FairseqTask

    return FairseqTask.build_generator(
        task,
        models,
        args,
        seq_gen_cls=CountingSequenceGenerator,
        extra_gen_cls_kwargs=extra_gen_cls_kwargs,
        **kwargs,
    )


def build_greedy(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Greedy decoding is fairseq's beam search with beam 1 (and one hypothesis)."""
    return build_beam(task, models, use_beam_one(args), extra_gen_cls_kwargs, **kwargs)


def use_beam_one(args):
    """The generation config with beam 1, for the search and for what reports it.

    fairseq-generate's closing line ("Generate test with beam=N") reads the config it passed:
    on fairseq's command lines that config itself records beam 1, so a greedy generator is not
    reported as fairseq's default beam of 5. A library caller's config is left as it was: it gets
    a copy.
    """
    if getattr(args, "beam", None) == 1:
        return args
    from omegaconf import OmegaConf, open_dict, read_write

    if not running_a_cli():
        args = copy.copy(args)
    if OmegaConf.is_config(args):  # a struct or read-only config refuses plain assignment
        with read_write(args), open_dict(args):
            args.beam = 1
    else:
        args.beam = 1
    return args
