"""Generator registry: the names accepted by ``--generator`` and how each is built.

A builder takes ``(task, models, args, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None)``
where ``args`` is fairseq's generation config, and returns an object with fairseq's
``generate(models, sample, **kwargs)`` and a ``stats`` :class:`DecodeStats`.
"""

from .acceptance import AcceptanceRule, ExactAcceptance
from .draft_verify import DraftVerifyGenerator, build_draft_verify
from .drafters import CopyDrafter, Drafter
from .fairseq_search import CountingSequenceGenerator, build_beam, build_greedy
from .stats import DecodeStats


def build_iad(task, models, args, extra_gen_cls_kwargs=None, **kwargs):
    """Input-guided aggressive decoding: copy drafts, exact verification."""
    _refuse_lm(extra_gen_cls_kwargs, "iad")
    drafter = CopyDrafter(
        task.source_dictionary, task.target_dictionary, block_size=task.cfg.block_size
    )
    return build_draft_verify(task, models, args, drafter, ExactAcceptance(), "iad")


def _refuse_lm(extra_gen_cls_kwargs, name):
    if extra_gen_cls_kwargs and extra_gen_cls_kwargs.get("lm_model") is not None:
        raise ValueError("--generator %s does not support --lm-path; use --generator beam" % name)


GENERATORS = {
    "beam": build_beam,
    "greedy": build_greedy,
    "iad": build_iad,
}

__all__ = [
    "GENERATORS",
    "AcceptanceRule",
    "ExactAcceptance",
    "CopyDrafter",
    "Drafter",
    "DraftVerifyGenerator",
    "CountingSequenceGenerator",
    "DecodeStats",
]
