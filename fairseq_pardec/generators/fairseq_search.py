"""fairseq's own SequenceGenerator (beam search, and greedy = beam 1) with our statistics."""

import logging

from fairseq.sequence_generator import SequenceGenerator

from .stats import DecodeStats, count_hypotheses, timed

logger = logging.getLogger(__name__)


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
    beam = getattr(args, "beam", 1)
    if beam not in (1, 5):  # 5 is fairseq's default, i.e. the user did not ask for a beam
        logger.warning("--generator greedy decodes with beam 1; ignoring --beam %d", beam)
    nbest = getattr(args, "nbest", 1)
    if nbest != 1:
        raise ValueError(
            "--generator greedy returns one hypothesis; drop --nbest %d or use --generator beam" % nbest
        )
    with overridden(args, beam=1):
        return build_beam(task, models, args, extra_gen_cls_kwargs, **kwargs)


class overridden:
    """Temporarily set attributes of an argparse Namespace or an omegaconf config."""

    def __init__(self, args, **values):
        self.args, self.values, self.saved = args, values, {}

    def __enter__(self):
        from omegaconf import open_dict

        for key, value in self.values.items():
            self.saved[key] = getattr(self.args, key, None)
            try:
                setattr(self.args, key, value)
            except Exception:  # struct omegaconf config
                with open_dict(self.args):
                    setattr(self.args, key, value)

    def __exit__(self, *exc):
        from omegaconf import open_dict

        for key, value in self.saved.items():
            try:
                setattr(self.args, key, value)
            except Exception:
                with open_dict(self.args):
                    setattr(self.args, key, value)
