"""The registry of ``--generator`` names: one :class:`GeneratorSpec` per name says how the
generator is built, what it promises (greedy-only or not), which family of fairseq's generation
options it refuses, and which of the task's options it reads. The task's ``--generator`` choices
and help, the option checks (options.py) and the benchmark read it from here.

A builder takes ``(task, models, args, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None)``
where ``args`` is fairseq's generation config, and returns an object with fairseq's
``generate(models, sample, **kwargs)`` and a ``stats`` :class:`DecodeStats`.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from fairseq_pardec.decoding.decode_stats import DecodeStats
from fairseq_pardec.decoding.draft_verify.acceptance import (
    AcceptanceRule,
    DistanceAcceptance,
    ExactAcceptance,
    MinimumBlock,
    TopBetaTauAcceptance,
    TopKAcceptance,
)
from fairseq_pardec.decoding.draft_verify.drafters import (
    AutoDrafter,
    CachedNARDrafter,
    CopyDrafter,
    Drafter,
    HeadsDrafter,
    LookupDrafter,
    NARDrafter,
    NgramTable,
    NoDrafter,
)
from fairseq_pardec.decoding.draft_verify.drafters.loading import load_drafter
from fairseq_pardec.decoding.draft_verify.drafters.pricing import CPU_PRICES
from fairseq_pardec.decoding.draft_verify.engine import DraftVerifyGenerator, build_draft_verify
from fairseq_pardec.decoding.fairseq_baselines import (
    CountingSequenceGenerator,
    build_beam,
    build_greedy,
)
from fairseq_pardec.decoding.interleaved_beam import build_interleaved
from fairseq_pardec import failures
from fairseq_pardec.errors import UsageError

# Families: which generation options a generator can honour (options.py refuses the others).
FAIRSEQ = "fairseq"  # fairseq's own SequenceGenerator: every option fairseq has
DRAFT_VERIFY = "draft_verify"  # the draft-and-verify engine
INTERLEAVED = "interleaved"  # IBDecoder's multi-word beam search


@dataclass(frozen=True)
class GeneratorSpec:
    """What the plugin knows about one ``--generator`` name."""

    name: str
    build: Callable
    summary: str  # for --generator's help
    family: str  # FAIRSEQ, DRAFT_VERIFY or INTERLEAVED
    greedy_only: bool  # one hypothesis per sentence, beam 1 (any other beam is refused)
    task_options: Tuple[str, ...] = ()  # fields of TranslationPardecConfig it reads


def build_iad(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Input-guided aggressive decoding: copy drafts, exact verification."""
    # --block-size is the user's fixed cap; by default each row's cap follows its acceptance.
    # No measured prices here: on a UA-GEC model they cut iad's tokens per iteration at batch 1
    # from 1.65 to 1.03 and its speed against lean_greedy (docs/results-history.md, "Priced drafts");
    # auto decides by them
    drafter = CopyDrafter(
        task.source_dictionary, task.target_dictionary, block_size=task.cfg.block_size,
        adaptive=task.cfg.block_size is None,
    )
    return build_draft_verify(task, models, args, drafter, ExactAcceptance(), "iad",
                              extra_gen_cls_kwargs=extra_gen_cls_kwargs)


def build_lookup(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Lookup drafting (no drafter model): the source, the output itself, and an n-gram table of
    --draft-corpus; exact verification, or GAD++'s relaxed one (--gad-beta/--gad-tau)."""
    cfg = task.cfg
    dictionary = task.target_dictionary
    table = NgramTable.from_file(cfg.draft_corpus, dictionary) if cfg.draft_corpus else None
    drafter = LookupDrafter(task.source_dictionary, dictionary, table, block_size=cfg.block_size,
                            adaptive=cfg.block_size is None)
    rule = TopBetaTauAcceptance(cfg.gad_beta, cfg.gad_tau)
    return build_draft_verify(task, models, args, drafter, rule, "lookup",
                              extra_gen_cls_kwargs=extra_gen_cls_kwargs)


def build_lean_greedy(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """fairseq's greedy search run by the draft-and-verify engine with nothing drafted.

    Same output contract as ``iad``; it shows what the engine's lean decoder step is worth on
    its own (the benchmark's row next to ``greedy`` and ``iad``), and is a faster greedy where
    no drafter helps.
    """
    return build_draft_verify(task, models, args, NoDrafter(), ExactAcceptance(), "lean_greedy",
                              extra_gen_cls_kwargs=extra_gen_cls_kwargs)


def build_blockwise(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Blockwise parallel decoding: proposal heads draft, p_1 verifies (merged invocation)."""
    if len(models) != 1:
        raise UsageError("--generator blockwise decodes with one model; give one checkpoint to --path")
    decoder = models[0].decoder
    if not hasattr(decoder, "proposal_heads"):
        raise UsageError(
            "--generator blockwise needs a model with proposal heads (--arch "
            "blockwise_transformer*); %s has none" % type(models[0]).__name__
        )
    cfg = task.cfg
    heads = decoder.proposal_heads
    block = cfg.block_size or heads
    if block > heads:
        raise UsageError(
            "--block-size %d is larger than the model's --proposal-heads %d" % (block, heads)
        )
    if cfg.min_block_size > block:
        raise UsageError("--min-block-size %d is larger than the block size %d"
                         % (cfg.min_block_size, block))
    if cfg.blockwise_distance is not None:
        if cfg.blockwise_topk != 1:
            raise UsageError("give either --blockwise-topk or --blockwise-distance, not both")
        rule = DistanceAcceptance(task.target_dictionary, cfg.blockwise_distance)
    else:
        rule = TopKAcceptance(cfg.blockwise_topk)
    if cfg.min_block_size > 1:
        rule = MinimumBlock(rule, cfg.min_block_size)
    # --block-size fixes the block (the paper); without it each row's draft follows its
    # acceptance, as iad's and gad's do (not under --min-block-size, which needs long drafts)
    drafter = HeadsDrafter(decoder, task.target_dictionary.pad(), block,
                           adaptive=cfg.block_size is None and cfg.min_block_size == 1,
                           dictionary=task.target_dictionary, draft_vocab=cfg.draft_vocab)
    return build_draft_verify(task, models, args, drafter, rule, "blockwise",
                              extra_gen_cls_kwargs=extra_gen_cls_kwargs)


def build_gad(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Generalized aggressive decoding: GLAT block drafter, AR verifier (GAD / GAD++)."""
    cfg = task.cfg
    rule = TopBetaTauAcceptance(cfg.gad_beta, cfg.gad_tau)
    if len(models) != 1:
        raise UsageError("--generator gad verifies with one model; give one checkpoint to --path")
    drafter = load_drafter(task, cfg.drafter_path, models[0])
    block = cfg.block_size or drafter.block_size
    dictionary = task.target_dictionary
    # a block-causal drafter caches its prefix (and, without --block-size, caps each row's
    # draft by its recent acceptance); the paper's bidirectional one re-reads the prefix
    if drafter.block_causal:
        proposer = CachedNARDrafter(drafter, block, dictionary.eos(), dictionary.pad(),
                                    adaptive=cfg.block_size is None, dictionary=dictionary,
                                    draft_vocab=cfg.draft_vocab)
    else:
        proposer = NARDrafter(drafter, block, dictionary.eos(), dictionary.pad(),
                              dictionary=dictionary, draft_vocab=cfg.draft_vocab)
    return build_draft_verify(task, models, args, proposer, rule, "gad",
                              extra_gen_cls_kwargs=extra_gen_cls_kwargs)


def build_auto(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Per row and iteration, the draft that pays the most at measured prices, or none: copy,
    lookup, the n-gram table of --draft-corpus, and the model's proposal heads or the
    --drafter-path drafter where there is one (drafters/auto.py); exact verification."""
    cfg = task.cfg
    if len(models) != 1:
        raise UsageError("--generator auto verifies with one model; give one checkpoint to --path")
    dictionary = task.target_dictionary
    table = NgramTable.from_file(cfg.draft_corpus, dictionary) if cfg.draft_corpus else None
    model, kind = None, None
    decoder = models[0].decoder
    if cfg.drafter_path:
        drafter = load_drafter(task, cfg.drafter_path, models[0])
        block = cfg.block_size or drafter.block_size
        kind = "gad"
        if drafter.block_causal:
            model = CachedNARDrafter(drafter, block, dictionary.eos(), dictionary.pad(),
                                     adaptive=True, dictionary=dictionary,
                                     draft_vocab=cfg.draft_vocab)
        else:
            model = NARDrafter(drafter, block, dictionary.eos(), dictionary.pad(),
                               dictionary=dictionary, draft_vocab=cfg.draft_vocab)
    elif getattr(decoder, "proposal_heads", 0) and decoder.proposal_heads > 1:
        kind = "blockwise"
        model = HeadsDrafter(decoder, dictionary.pad(), decoder.proposal_heads, adaptive=False,
                             dictionary=dictionary, draft_vocab=cfg.draft_vocab)
    # On the CPU the CPU's fixed prices decide (pricing.CPU_PRICES: no draft pays from 8
    # active rows on): on a UA-GEC model prices measured from the iterations drafted too
    # little and ran slower than fixed ones (docs/results-history.md, "Priced drafts").
    # Elsewhere the prices are measured.
    on_cpu = next(models[0].parameters()).device.type == "cpu"
    auto = AutoDrafter(task.source_dictionary, dictionary, table, model=model, model_kind=kind,
                       prices=CPU_PRICES if on_cpu else None)
    generator = build_draft_verify(task, models, args, auto, ExactAcceptance(), "auto",
                                   extra_gen_cls_kwargs=extra_gen_cls_kwargs)
    # the prices decide when a row drafts and probes: no back-off besides them
    generator.backoff = False
    auto.stats = generator.stats
    return generator


SPECS: Dict[str, GeneratorSpec] = {spec.name: spec for spec in (
    GeneratorSpec("beam", build_beam, "fairseq's own beam search, unchanged", FAIRSEQ,
                  greedy_only=False),
    GeneratorSpec("greedy", build_greedy, "beam 1", FAIRSEQ, greedy_only=True),
    GeneratorSpec("lean_greedy", build_lean_greedy, "greedy's output from the draft-and-verify "
                  "engine, nothing drafted", DRAFT_VERIFY, greedy_only=True),
    GeneratorSpec("iad", build_iad, "input-guided aggressive decoding: copy the source as a "
                  "draft, lossless", DRAFT_VERIFY, greedy_only=True, task_options=("block_size",)),
    GeneratorSpec("lookup", build_lookup, "draft what followed the output's last tokens in the "
                  "source, the output itself and --draft-corpus; no drafter model, lossless",
                  DRAFT_VERIFY, greedy_only=True,
                  task_options=("block_size", "draft_corpus", "gad_beta", "gad_tau")),
    GeneratorSpec("blockwise", build_blockwise, "blockwise parallel decoding with a "
                  "blockwise_transformer's proposal heads", DRAFT_VERIFY, greedy_only=True,
                  task_options=("block_size", "blockwise_topk", "blockwise_distance",
                                "min_block_size", "draft_vocab")),
    GeneratorSpec("gad", build_gad, "generalized aggressive decoding with a glat_drafter, "
                  "--drafter-path", DRAFT_VERIFY, greedy_only=True,
                  task_options=("block_size", "drafter_path", "gad_beta", "gad_tau", "draft_vocab")),
    GeneratorSpec("auto", build_auto, "lossless greedy decoding that drafts where it pays: per "
                  "row and iteration the draft that pays at measured prices (copy, lookup, "
                  "--draft-corpus, proposal heads, --drafter-path) or none", DRAFT_VERIFY,
                  greedy_only=True,
                  task_options=("draft_corpus", "drafter_path", "draft_vocab")),
    GeneratorSpec("interleaved", build_interleaved, "multi-word beam search of ibdecoder models; "
                  "beam and greedy map to it for them", INTERLEAVED, greedy_only=False,
                  task_options=("interleaved_candidates",)),
)}
# the errors' messages name the greedy-only generators (failures.py lives below this module)
failures.GREEDY_ONLY_GENERATORS.update(name for name, spec in SPECS.items() if spec.greedy_only)

# name -> builder (what fairseq's build_generator calls)
GENERATORS = {name: spec.build for name, spec in SPECS.items()}


def help_text() -> str:
    """``--generator``'s help: every name with its one-line summary."""
    return ("decoding method (default beam: fairseq's own search with fairseq's --beam, as "
            "--task translation decodes; auto: fairseq greedy's output, drafting where a draft "
            "pays). The greedy-only generators decode with beam 1 and refuse any other beam: "
            + ", ".join("%s (%s)" % (s.name, s.summary) for s in SPECS.values()))


__all__ = [
    "GENERATORS",
    "SPECS",
    "GeneratorSpec",
    "AcceptanceRule",
    "ExactAcceptance",
    "CopyDrafter",
    "LookupDrafter",
    "AutoDrafter",
    "NgramTable",
    "Drafter",
    "DraftVerifyGenerator",
    "CountingSequenceGenerator",
    "DecodeStats",
]
