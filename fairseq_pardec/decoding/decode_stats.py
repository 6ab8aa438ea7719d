"""Decoding statistics every fairseq_pardec generator reports."""

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Dict

import torch
from fairseq_pardec.errors import UsageError


@dataclass
class DecodeStats:
    """Counters accumulated over ``generate`` calls.

    ``decoder_calls`` counts batched decoder invocations (what costs time on a GPU);
    ``row_iterations`` counts, per sentence, the iterations it took part in, so that
    ``tokens_per_iteration`` is the mean number of tokens a sentence gains per decoder call
    (1.0 for left-to-right search, more for draft-and-verify and multi-word methods).
    ``wall_time`` covers ``generate`` only: model loading and data loading are excluded.
    ``drafter_time`` is the part of it spent in a draft-and-verify generator's drafter (its
    ``propose`` and ``observe``), ``verifier_time`` the part in the verifier's decoder call
    (block step and log-softmax), ``encoder_time`` the part in the verifier's encoder (once per
    batch), ``guard_time`` the part in the margin guard's replays of fairseq's arithmetic at
    close calls (draft_verify/margin_guard.py); the rest is the engine's bookkeeping. Measured on the CPU
    only (on a GPU kernels run asynchronously and timing them would need a synchronisation per
    iteration).
    """

    sentences: int = 0
    target_tokens: int = 0
    decoder_calls: int = 0
    row_iterations: int = 0
    wall_time: float = 0.0
    drafter_time: float = 0.0
    verifier_time: float = 0.0
    encoder_time: float = 0.0
    guard_time: float = 0.0
    # positions where the fast step could not certify fairseq's choice, decided by fairseq's
    # arithmetic instead (draft_verify/engine.py, draft_verify/margin_guard.py)
    close_calls: int = 0
    # of those, the ones one teacher-forced pass over the prefix decided (the others were
    # replayed step by step: draft_verify/margin_guard.py)
    close_calls_in_one_pass: int = 0
    # the margins in force, as measured on the model (step/margins.py MarginsInForce.describe;
    # empty where none was measured: unguarded, or a margin given)
    margins: str = ""
    # block positions the verifier computed: a greedy step verifies one per token
    positions_verified: int = 0
    # --generator auto: row-iterations per drafter chosen ("none": no draft), and the draft
    # tokens each drafter had accepted
    drafter_iterations: Dict[str, int] = field(default_factory=dict)
    drafter_accepted: Dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_iteration(self) -> float:
        return self.target_tokens / self.row_iterations if self.row_iterations else 0.0

    @property
    def sentences_per_second(self) -> float:
        return self.sentences / self.wall_time if self.wall_time > 0 else 0.0

    def reset(self):
        for name in ("sentences", "target_tokens", "decoder_calls", "row_iterations", "close_calls",
                     "close_calls_in_one_pass",
                     "positions_verified"):
            setattr(self, name, 0)
        self.wall_time = 0.0
        self.drafter_time = 0.0
        self.verifier_time = 0.0
        self.encoder_time = 0.0
        self.guard_time = 0.0
        self.drafter_iterations.clear()
        self.drafter_accepted.clear()

    def drafter_shares(self) -> str:
        """``copy 41% (2.10 accepted), none 59%``: each drafter's share of the row-iterations
        and its accepted draft tokens per iteration it drafted (``--generator auto``)."""
        total = sum(self.drafter_iterations.values())
        parts = []
        for name, count in sorted(self.drafter_iterations.items(), key=lambda kv: -kv[1]):
            part = "%s %.0f%%" % (name, 100.0 * count / max(total, 1))
            if name in self.drafter_accepted:
                part += " (%.2f accepted)" % (self.drafter_accepted[name] / max(count, 1))
            parts.append(part)
        return ", ".join(parts)

    def as_dict(self):
        out = asdict(self)
        out["tokens_per_iteration"] = self.tokens_per_iteration
        out["sentences_per_second"] = self.sentences_per_second
        return out

    def summary_line(self, name: str) -> str:
        return (
            f"pardec generator={name} | sentences {self.sentences} | target tokens "
            f"{self.target_tokens} | decoder calls {self.decoder_calls} | iterations per sentence "
            f"{self.row_iterations / max(self.sentences, 1):.2f} | mean accepted tokens per "
            f"iteration {self.tokens_per_iteration:.2f} | decode wall time {self.wall_time:.2f}s "
            f"({self.sentences_per_second:.1f} sentences/s)"
            + (f" | close calls decided by fairseq {self.close_calls} ({self.close_calls_in_one_pass} "
               f"in one pass)" if self.close_calls else "")
            + (f" | {self.margins}" if self.margins else "")
            + (f" | drafts {self.drafter_shares()}" if self.drafter_iterations else "")
        )


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(stats: DecodeStats, device: torch.device):
    """Adds the wall time of the block to ``stats``; waits for queued GPU work on both ends."""
    _synchronize(device)
    start = time.perf_counter()
    # whether a batch is being decoded now: what a Ctrl-C then leaves unprinted is that batch,
    # which is not counted yet (translation_pardec's interrupt line)
    stats.decoding = True
    try:
        yield
    finally:
        stats.decoding = False
        _synchronize(device)
        stats.wall_time += time.perf_counter() - start


class PartTimer:
    """Adds the wall time of ``with`` blocks to one of ``stats``' parts (``drafter_time``,
    ``verifier_time``, ``encoder_time``, ``guard_time``) on the CPU. On a GPU it times nothing: kernels run asynchronously, and
    timing them would need a synchronisation per block."""

    def __init__(self, stats: DecodeStats, part: str, device: torch.device):
        self.stats, self.part = stats, part
        self.on = device.type == "cpu"

    def __enter__(self):
        if self.on:
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.on:
            setattr(self.stats, self.part,
                    getattr(self.stats, self.part) + time.perf_counter() - self.start)


def count_hypotheses(stats: DecodeStats, hypos):
    """Sentences and target tokens (EOS included, as fairseq counts them) of a batch's output."""
    stats.sentences += len(hypos)
    stats.last_batch = len(hypos)  # not a field: no statistic of its own (as_dict)
    stats.target_tokens += sum(len(h[0]["tokens"]) for h in hypos if h)


class StatsGenerator:
    """fairseq's generator interface around ``_generate``: timing and counting in one place."""

    # generate() keyword -> the fairseq flag that produces it
    unsupported_kwargs = {"constraints": "--constraints"}
    name = "this generator"

    def cuda(self):
        self.model.cuda()
        return self

    def generate(self, models, sample, **kwargs):
        for key, flag in self.unsupported_kwargs.items():
            if kwargs.get(key) is not None:
                raise UsageError("--generator %s does not support %s" % (self.name, flag))
        device = sample["net_input"]["src_tokens"].device
        with torch.no_grad(), timed(self.stats, device):
            hypos = self._generate(sample, **{k: v for k, v in kwargs.items()
                                              if k not in self.unsupported_kwargs})
        count_hypotheses(self.stats, hypos)
        return hypos
