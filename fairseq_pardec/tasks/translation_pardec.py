"""``--task translation_pardec``: fairseq's translation task plus our decoding options.

A plugin cannot add a global ``--generator`` flag (hydra rejects new config groups), so the
decoding options live on the task. Checkpoints of the stock ``translation`` task decode through
this task and vice versa: the task adds no state to the model.
"""

import argparse
import atexit
import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import utils
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from fairseq_pardec import errors
from fairseq_pardec.errors import UsageError, running_a_cli
from fairseq_pardec.decoding.registry import GENERATORS, SPECS, DraftVerifyGenerator, help_text
from fairseq_pardec.decoding.fairseq_baselines import use_beam_one
from fairseq_pardec.decoding.options import ARG_VALIDATORS, refuse
from fairseq_pardec.models.loading import mark_from_checkpoint
from fairseq_pardec.tasks import interactive_input
from fairseq_pardec.tasks.binarized_data import check_binarized
from fairseq_pardec.tasks.checkpoint_fit import refuse_non_verifiers, warn_other_direction
from fairseq_pardec.tasks.warm_up import decoding_cli, warm_up

logger = logging.getLogger(__name__)

GENERATOR_CHOICES = ChoiceEnum(list(SPECS))


@dataclass
class TranslationPardecConfig(TranslationConfig):
    generator: GENERATOR_CHOICES = field(
        default="beam",
        metadata={
            "help": help_text()
        },
    )
    block_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "draft-and-verify generators: iad, lookup: a fixed cap on the draft tokens "
            "verified per iteration (default: each row's cap follows its acceptance, under a CPU ceiling of 16 "
            "that shrinks to 6 as the batch grows, "
            "unbounded on a GPU); blockwise: a fixed block size k counting p_1, as in the paper "
            "(default: each row's cap follows its acceptance, under the model's --proposal-heads)"
        },
    )
    blockwise_topk: int = field(
        default=1,
        metadata={"help": "blockwise: accept a proposal within the verifier's top-k (1 = exact, "
                  "lossless; paper § 5.1)"},
    )
    blockwise_distance: Optional[float] = field(
        default=None,
        metadata={"help": "blockwise: accept a proposal within this distance of the verifier's "
                  "token, for ordinal vocabularies (paper § 5.2)"},
    )
    drafter_path: Optional[str] = field(
        default=None,
        metadata={"help": "gad: checkpoint of the glat_drafter (the verifier is --path)"},
    )
    gad_beta: int = field(
        default=1,
        metadata={"help": "gad, lookup: GAD++ accepts a draft token within the verifier's "
                  "top-beta (1 with --gad-tau 0 = lossless)"},
    )
    gad_tau: float = field(
        default=0.0,
        metadata={"help": "gad, lookup: GAD++ tolerance: the draft token's log-probability may "
                  "be at most tau below the top-1's"},
    )
    interleaved_candidates: Optional[int] = field(
        default=None,
        metadata={"help": "interleaved: candidates kept per sentence and step, as a multiple of "
                  "the beam (default 2 = fairseq's rule; 3 for learned positions = the "
                  "double-token paper's DOUBLETOPK)"},
    )
    min_block_size: int = field(
        default=1,
        metadata={"help": "blockwise: accept at least this many tokens per iteration (paper § 5.3)"},
    )
    draft_vocab: Optional[int] = field(
        default=None,
        metadata={"help": "gad, blockwise: the drafter scores only EOS and the N-1 most frequent "
                  "types of the target dictionary (its counts), a cheaper vocabulary projection; "
                  "the verifier still scores every type, so lossless stays lossless (default: "
                  "the whole vocabulary)"},
    )
    draft_corpus: Optional[str] = field(
        default=None,
        metadata={"help": "lookup: target-side text, one sentence per line in the model's subword "
                  "units (the training targets, or the verifier's own outputs from "
                  "examples/distill.sh), whose n-gram table continues drafts that the source and "
                  "the output cannot (default: source and output only)"},
    )
    # Set by the parser when --beam is typed (_RecordTypedBeam): a greedy-only --generator then
    # leaves the typed beam for its check instead of setting beam 1 (_GreedyGeneratorBeam).
    explicit_beam: Optional[int] = field(default=None, metadata={"help": argparse.SUPPRESS})
    # Set by the parser when --num-workers is typed (_RecordTypedNumWorkers): fairseq-generate
    # then loads batches with the workers asked for, else in its own process (get_batch_iterator).
    explicit_num_workers: Optional[int] = field(default=None, metadata={"help": argparse.SUPPRESS})


class _RecordTypedBeam(argparse._StoreAction):
    """``--beam``, also remembering that it was typed (``explicit_beam``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.explicit_beam = values


class _RecordTypedNumWorkers(argparse._StoreAction):
    """``--num-workers``, also remembering that it was typed (``explicit_num_workers``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.explicit_num_workers = values


class _GreedyGeneratorBeam(argparse._StoreAction):
    """``--generator``: a greedy-only generator typed without ``--beam`` decodes with beam 1.

    fairseq's default beam is 5, and a greedy-only generator refuses any beam but 1, wherever it
    comes from (options.refuse): on the command line, choosing such a generator is itself the
    request for beam 1, so no ``--beam 1`` needs typing. A typed ``--beam`` before or after it
    is kept (and refused unless 1).
    """

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        spec = SPECS.get(str(values))
        if spec is not None and spec.greedy_only and getattr(namespace, "explicit_beam", None) is None:
            namespace.beam = 1


class _SummaryReporter:
    """Logs each CLI generator's statistics once, when the process ends.

    fairseq-generate offers no hook after its loop, and its own summary is logged just before
    the process exits, so ours follows it. A run that an exception or Ctrl-C ended gets no
    summary (it would read as a complete run); Ctrl-C's line says how far it got instead.
    """

    def __init__(self, task):
        self.task = task
        self.stats = []
        atexit.register(self.report)
        errors.on_interrupt(self.interrupted, first=True)

    def add(self, name, generator):
        # the statistics only: holding the generator would keep its models alive
        self.stats.append((name, generator.stats))

    def report(self):
        if errors.uncaught:
            return
        for name, stats in self.stats:
            if stats.sentences:
                logger.info(stats.summary_line(name))

    def interrupted(self):
        decoded = sum(stats.sentences for _, stats in self.stats)
        names = ", ".join(dict.fromkeys(name for name, _ in self.stats))
        # fairseq-generate loads one split; fairseq-interactive none
        splits = list(self.task.datasets.values())
        of = " of %d" % len(splits[0]) if len(splits) == 1 else ""
        # fairseq prints a batch's lines after its generate call returns: a Ctrl-C between the
        # two leaves the batch just decoded (of the generator that ran last) partly printed
        latest = self.stats[-1][1] if self.stats else None
        unsure = 0
        if latest is not None and not getattr(latest, "decoding", False):
            unsure = getattr(latest, "last_batch", 0)
        if unsure:
            return ("%d%s sentences decoded and printed (--generator %s), %d more decoded whose "
                    "lines may be missing; the output is incomplete"
                    % (decoded - unsure, of, names, unsure))
        return "%d%s sentences decoded (--generator %s), the output is incomplete" % (
            decoded, of, names)


_reporter = None


@register_task("translation_pardec", dataclass=TranslationPardecConfig)
class TranslationPardecTask(TranslationTask):
    """Translation with fairseq_pardec's generators (``--generator``).

    ``report_summary``: on fairseq's command lines, log each generator's statistics when the
    process ends (the CLIs' summary line); a caller that reports by itself (the benchmark)
    turns it off.

    ``warm_up_generators``: whether each draft-and-verify generator decodes one synthetic
    sentence when it is built (tasks/warm_up.py), so that its one-time set-up is not timed as
    decoding. None: on fairseq-generate and fairseq-interactive only; the benchmark has a
    warm-up protocol of its own and turns it off.
    """

    cfg: TranslationPardecConfig
    report_summary = True
    warm_up_generators: Optional[bool] = None

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        for action in parser._actions:
            for flag, validator in ARG_VALIDATORS.items():
                if flag in action.option_strings:
                    action.type = validator
            if "--beam" in action.option_strings and type(action) is argparse._StoreAction:
                action.__class__ = _RecordTypedBeam
            if "--generator" in action.option_strings and type(action) is argparse._StoreAction:
                action.__class__ = _GreedyGeneratorBeam
            if "--num-workers" in action.option_strings and type(action) is argparse._StoreAction:
                action.__class__ = _RecordTypedNumWorkers

    def with_options(self, **options):
        """A copy of this task whose config has ``options`` (``generator="gad"``, ...) set.

        Dictionaries and loaded datasets are shared; this task is left as it is.
        """
        from omegaconf import OmegaConf, open_dict

        unknown = sorted(set(options) - set(TranslationPardecConfig.__dataclass_fields__))
        if unknown:
            raise UsageError("unknown option(s) of --task translation_pardec: %s"
                             % ", ".join(unknown))
        variant = copy.copy(self)
        if OmegaConf.is_config(self.cfg):
            variant.cfg = self.cfg.copy()
            with open_dict(variant.cfg):
                for key, value in options.items():
                    setattr(variant.cfg, key, value)
        else:
            variant.cfg = dataclasses.replace(self.cfg, **options)
        return variant

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        for path in utils.split_paths(cfg.data or ""):
            if not os.path.isdir(path):
                raise UsageError(
                    "data directory %r does not exist; give the fairseq-preprocess output "
                    "directory as the first argument (see examples/data/)" % path
                )
        if cfg.block_size is not None and cfg.block_size < 1:
            raise UsageError("--block-size must be >= 1 (got %d)" % cfg.block_size)
        return super().setup_task(cfg, **kwargs)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        check_binarized(self.datasets[split], split)

    def build_model(self, cfg, from_checkpoint=False):
        if from_checkpoint:  # our models then skip their --init-from-* files (models/loading.py)
            warn_other_direction(self.cfg, cfg)
            cfg = mark_from_checkpoint(cfg)
        return super().build_model(cfg, from_checkpoint)

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        """fairseq-interactive's sentences, cut to --max-source-positions with --truncate-source
        (fairseq's translation task cuts only the sentences of binarized splits)."""
        if self.cfg.truncate_source:
            keep = self.cfg.max_source_positions
            # fairseq keeps the first max-1 tokens and the EOS: the same cut here
            src_tokens = [t if len(t) <= keep else torch.cat([t[: keep - 1], t[-1:]])
                          for t in src_tokens]
            src_lengths = [min(int(n), keep) for n in src_lengths]
        return super().build_dataset_for_inference(src_tokens, src_lengths, constraints)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        if hasattr(criterion, "set_update_num"):  # glancing schedule, per-update seeding
            criterion.set_update_num(update_num)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    # ------------------------------------------------------------------ batching
    def get_batch_iterator(self, dataset, *args, **kwargs):
        # fairseq's Trainer asks for its train and valid iterators with skip_remainder_batch
        # (positional or keyword): their batches stay fairseq's, every one a multiple of
        # --required-batch-size-multiple; the iterators of decoding (fairseq-generate,
        # -validate, -interactive, library callers) keep the tail batch
        training = "skip_remainder_batch" in kwargs or len(args) >= _SKIP_REMAINDER_POSITION
        _keep_tail_batch(dataset, keep=not training)
        if not training and "num_workers" in kwargs:
            kwargs["num_workers"] = self._decoding_workers(kwargs["num_workers"])
        interactive_input.skip_long_lines(self, dataset, kwargs.get("max_positions"))
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def _decoding_workers(self, asked: int) -> int:
        """The DataLoader workers of a decoding command line's batches: those typed with
        ``--num-workers``, else none (the batches are collated in the decoding process).

        fairseq's default of one worker process wakes for every batch to collate the next one
        while the model decodes the current one, and on a CPU whose cores all run the decoder's
        threads it takes a core from them: a parallel region then waits for the thread it
        preempted, and fairseq-generate's timed decoding slows by far more than the collation
        costs. Collating in the decoding process runs it between two ``generate`` calls,
        outside fairseq's decode timer, as the benchmark does.
        """
        if getattr(self.cfg, "explicit_num_workers", None) is not None or not decoding_cli():
            return asked
        return 0

    # ------------------------------------------------------------------ generators
    def build_generator(
        self,
        models,
        args,
        seq_gen_cls=None,
        extra_gen_cls_kwargs=None,
        prefix_allowed_tokens_fn=None,
    ):
        refuse_non_verifiers(models)
        asked = name = str(self.cfg.generator)
        if models and hasattr(models[0], "words_per_step") and name in ("beam", "greedy"):
            name = "interleaved"  # ibdecoder models emit several words per step
        if seq_gen_cls is not None and asked != "beam":
            raise UsageError("--generator %s cannot build the generator class %s that the "
                             "caller asks for (seq_gen_cls); drop --generator or seq_gen_cls"
                             % (asked, getattr(seq_gen_cls, "__name__", seq_gen_cls)))
        if getattr(args, "score_reference", False) and asked != "beam":
            # fairseq scores the reference with its own scorer and decodes nothing: the
            # generator asked for would never run, and the output would not say so
            raise UsageError("--score-reference scores the references and decodes nothing, so "
                             "--generator %s would not be used: drop --generator %s (or "
                             "--score-reference to decode)" % (asked, asked))
        if getattr(args, "score_reference", False) or seq_gen_cls is not None:
            # Scoring and callers that bring their own generator class get fairseq's path.
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        for each in dict.fromkeys((asked, name)):  # greedy on an ibdecoder: both rule sets
            refuse(each, SPECS, self.cfg, args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if SPECS[asked].greedy_only:
            args = use_beam_one(args)
        generator = GENERATORS[name](
            self,
            models,
            args,
            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        )
        warm = decoding_cli() if self.warm_up_generators is None else self.warm_up_generators
        if warm and isinstance(generator, DraftVerifyGenerator):
            warm_up(generator, models[0], self.source_dictionary)
        if self.report_summary and running_a_cli():  # a library caller reads generator.stats
            global _reporter
            if _reporter is None:
                _reporter = _SummaryReporter(self)
            _reporter.add(name, generator)
        return generator


# positional arguments after dataset up to and including FairseqTask.get_batch_iterator's
# skip_remainder_batch
_SKIP_REMAINDER_POSITION = 13


def _keep_tail_batch(dataset, keep=True):
    """Make ``dataset.batch_by_size`` keep the last, smaller batch (``keep``), or undo that.

    fairseq main's ``data_utils.batch_by_size`` drops the final batch when its size is not a
    multiple of ``--required-batch-size-multiple`` (upstream issues #5036, #5351), which silently
    loses test sentences. We let fairseq batch as usual and append whatever it left out.
    """
    if not keep:
        if getattr(dataset, "_pardec_keeps_tail", False):  # a dataset decoded before
            del dataset.batch_by_size  # the class's method again
            dataset._pardec_keeps_tail = False
        return
    if getattr(dataset, "_pardec_keeps_tail", False):
        return
    original = dataset.batch_by_size

    def batch_by_size(indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        batches = original(indices, max_tokens, max_sentences, required_batch_size_multiple)
        covered = sum(len(b) for b in batches)
        if covered < len(indices):
            import numpy as np

            seen = set(np.concatenate(batches).tolist()) if len(batches) else set()
            missing = np.array([i for i in indices if i not in seen], dtype=np.int64)
            if len(missing):
                batches = list(batches) + [missing]
        return batches

    dataset.batch_by_size = batch_by_size
    dataset._pardec_keeps_tail = True
