"""The task's options, what each generator refuses, and fairseq's one mapping of the generation
config.

fairseq maps its generation config (``--beam``, ``--max-len-a/b``, ``--sampling``, ...) to a
generator's arguments in ``FairseqTask.build_generator``; our generators are built through that
same call (as its ``seq_gen_cls``), so the mapping exists once, in fairseq. What a generator cannot
honour, a generation option or another generator's task option, is refused here first
(:func:`refuse`), in one line naming the flag: silently ignoring a flag would change what the
user gets without saying so.
"""

import argparse

from fairseq import search
from fairseq.tasks.fairseq_task import FairseqTask

from fairseq_pardec.errors import UsageError

def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r" % value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1, got %d" % number)
    return number


def non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number, got %r" % value)
    if not number >= 0:
        raise argparse.ArgumentTypeError("must be >= 0, got %s" % value)
    return number


# The task's own options (--task translation_pardec): flag, default, and the check argparse runs
# on the value (the config dataclass knows only its type). Which generators read each one is in
# the registry (GeneratorSpec.task_options); every other generator refuses a non-default value.
TASK_OPTIONS = {
    "block_size": ("--block-size", None, positive_int),
    "draft_corpus": ("--draft-corpus", None, None),
    "drafter_path": ("--drafter-path", None, None),
    "gad_beta": ("--gad-beta", 1, positive_int),
    "gad_tau": ("--gad-tau", 0.0, non_negative_float),
    "blockwise_topk": ("--blockwise-topk", 1, positive_int),
    "blockwise_distance": ("--blockwise-distance", None, non_negative_float),
    "min_block_size": ("--min-block-size", 1, positive_int),
    "draft_vocab": ("--draft-vocab", None, positive_int),
    "interleaved_candidates": ("--interleaved-candidates", None, positive_int),
}

# flag -> argparse check, for the flags that have one
ARG_VALIDATORS = {flag: check for flag, _, check in TASK_OPTIONS.values() if check is not None}


def _set(value, off=(None, False, 0, "", "none")):
    return value not in off


# flag, whether the generation config sets it, the families of generators that refuse it
# (registry.py: fairseq's own generators honour every option)
_OURS = ("draft_verify", "interleaved")
REFUSALS = (
    ("--diverse-beam-groups", lambda a: (getattr(a, "diverse_beam_groups", -1) or -1) > 0, _OURS),
    ("--diversity-rate", lambda a: (getattr(a, "diversity_rate", -1) or -1) > -1, _OURS),
    ("--match-source-len", lambda a: _set(getattr(a, "match_source_len", False)), _OURS),
    ("--constraints", lambda a: _set(getattr(a, "constraints", None)), _OURS),
    ("--no-repeat-ngram-size", lambda a: _set(getattr(a, "no_repeat_ngram_size", 0)), _OURS),
    ("--print-alignment", lambda a: _set(getattr(a, "print_alignment", None)), _OURS),
    ("--sampling", lambda a: _set(getattr(a, "sampling", False)), ("interleaved",)),
    ("--temperature", lambda a: getattr(a, "temperature", 1.0) != 1.0, ("interleaved",)),
)


def refuse(name, specs, task_cfg, args, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
    """UsageError naming the first option that generator ``name`` cannot honour.

    ``specs`` is the registry's table of generators (registry.SPECS), ``task_cfg`` holds the
    task's options, ``args`` fairseq's generation config.

    A greedy-only generator takes beam 1 and nothing else, whichever way the beam came: the
    command line's ``--beam`` (where a greedy-only ``--generator`` sets 1 unless ``--beam`` is
    typed, translation_pardec.py), a hub call's ``beam=`` (5 unless given), ``--eval-bleu-args``.
    A config without a beam at all (``--eval-bleu-args '{}'``) asks for none: the generator's own.
    Decoding greedily where a beam search was asked for would change the output without a word.
    """
    spec = specs[name]
    for attr, (flag, default, _) in TASK_OPTIONS.items():
        value = getattr(task_cfg, attr, default)
        if attr not in spec.task_options and value is not None and value != default:
            users = [s.name for s in specs.values() if attr in s.task_options]
            raise UsageError("%s is an option of --generator %s; --generator %s does not use it"
                             % (flag, " or ".join(users), name))
    for flag, is_set, refusers in REFUSALS:
        if spec.family in refusers and is_set(args):
            raise UsageError("--generator %s does not support %s; use --generator beam" % (name, flag))
    ours = spec.family in _OURS
    lm = (extra_gen_cls_kwargs or {}).get("lm_model")
    if ours and lm is not None:
        raise UsageError("--generator %s does not support --lm-path; use --generator beam" % name)
    if ours and prefix_allowed_tokens_fn is not None:
        raise UsageError("--generator %s does not support prefix_allowed_tokens_fn; use "
                         "--generator beam" % name)
    sampling = bool(getattr(args, "sampling", False))
    truncation = ((getattr(args, "sampling_topk", -1) or -1) > 0
                  or (getattr(args, "sampling_topp", -1.0) or -1.0) > 0)
    if truncation and not sampling:
        raise UsageError("--sampling-topk and --sampling-topp need --sampling")
    if spec.greedy_only:
        nbest = getattr(args, "nbest", 1)
        if nbest != 1:
            raise UsageError("--generator %s returns one hypothesis; drop --nbest %d or use "
                             "--generator beam" % (name, nbest))
        beam = getattr(args, "beam", None)
        if beam is not None and beam != 1:
            what = ("draws one sample per sentence, not %d" % beam if sampling
                    else "decodes greedily (beam 1), not with beam %d" % beam)
            raise UsageError(
                "--generator %s %s: ask for beam 1 (--beam 1; beam=1 in a hub call such as "
                "translate(..., beam=1); {\"beam\": 1} in --eval-bleu-args), or use --generator "
                "beam, fairseq's own search" % (name, what))
    elif spec.family == "interleaved":
        nbest, beam = getattr(args, "nbest", 1), getattr(args, "beam", 5)
        if nbest > beam:
            raise UsageError("--nbest %d is larger than --beam %d" % (nbest, beam))
    max_len_a, max_len_b = getattr(args, "max_len_a", 0), getattr(args, "max_len_b", 200)
    min_len = getattr(args, "min_len", 1)
    if not max_len_a and max_len_b < min_len:
        raise UsageError("--max-len-b %d leaves no room for an output of --min-len %d (the length "
                         "limit is --max-len-a x source length + --max-len-b); raise --max-len-b"
                         % (max_len_b, min_len))


def build_through_fairseq(task, models, args, factory, extra_gen_cls_kwargs=None, **own_kwargs):
    """``FairseqTask.build_generator`` with ``factory`` as the generator class.

    fairseq passes ``factory`` its mapping of the generation config (``beam_size``,
    ``max_len_a``, ..., ``search_strategy``); ``own_kwargs`` (drafter, acceptance rule, ...) ride
    along in ``extra_gen_cls_kwargs``. Options refused above never reach it.
    """
    extra = dict(extra_gen_cls_kwargs or {})
    extra.pop("lm_model", None), extra.pop("lm_weight", None)  # refused above when set
    extra.update(own_kwargs)
    return FairseqTask.build_generator(task, models, args, seq_gen_cls=factory,
                                       extra_gen_cls_kwargs=extra)


def sampling_of(search_strategy):
    """(top-k, top-p) of fairseq's sampling strategy, or None for its plain beam search."""
    if isinstance(search_strategy, search.Sampling):
        return search_strategy.sampling_topk, search_strategy.sampling_topp
    if type(search_strategy) is not search.BeamSearch:  # refused earlier; a guard for callers
        raise UsageError("search strategy %s is not supported here; use --generator beam"
                         % type(search_strategy).__name__)
    return None


def refuse_unknown_arguments(generator_class, mapped, tokens_to_suppress=()):
    """A UsageError (a ValueError) naming the first of fairseq ``SequenceGenerator``'s keyword
    arguments that ``generator_class`` cannot take, instead of Python's bare TypeError."""
    import inspect

    if tokens_to_suppress:
        raise UsageError("%s does not support tokens_to_suppress (SequenceGenerator's argument); "
                         "use --generator beam" % generator_class.__name__)
    accepted = set(inspect.signature(generator_class.__init__).parameters)
    unknown = sorted(set(mapped) - accepted)
    if unknown:
        raise UsageError("%s does not take the generator argument %s; use --generator beam"
                         % (generator_class.__name__, unknown[0]))


def set_output_symbols(generator, eos=None, symbols_to_strip_from_output=None):
    """SequenceGenerator's ``eos`` (also the default BOS) and ``symbols_to_strip_from_output``
    (read by fairseq-generate when it prints hypotheses), set as SequenceGenerator sets them."""
    if eos is not None:
        generator.eos = eos
    generator.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {generator.eos}
    return generator
