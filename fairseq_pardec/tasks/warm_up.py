"""One short decode when a decoding command line builds a draft-and-verify generator.

The engine's first batch pays what a steady run pays once: the decoder step prepares its copy of
the weights and chooses its product kernels (measured, or read from this machine's stored
choice), the fast encoder prepares its own, the native library and the thread pool start, and
the allocator grows. fairseq-generate times every ``inference_step`` (its "Translated ... in Xs"
line) and builds the generator outside that timer, so without a warm-up those costs land in the
first timed batch, while the benchmark (``python -m fairseq_pardec.benchmark``) pays them in its
own warm-up: the two rates would differ by what is no decoding.

The warm-up decodes one synthetic sentence through a view of the generator that shares its model
and its decoder step (what holds the prepared weights and the kernel choice) but drafts nothing,
samples nothing and counts into statistics of its own. So the generator's drafter learns nothing
from it (its acceptance histories, measured prices), no random number is drawn (``--sampling``
keeps its seeded draws), and the statistics that fairseq's summary line and ours report start
from zero.
"""

import copy
import logging
import os
import sys
import time

import torch

from fairseq_pardec.decoding.decode_stats import DecodeStats
from fairseq_pardec.decoding.draft_verify.acceptance import ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import NoDrafter
from fairseq_pardec.errors import UsageError

logger = logging.getLogger(__name__)

# the command lines that build a generator once, after the model is on its device, and then
# decode: fairseq-train builds its --eval-bleu generator before moving the model, and a library
# caller (the hub builds a generator per translate call) decides for itself
_DECODING_CLIS = ("fairseq-generate", "fairseq-interactive")
_DECODING_MODULES = ("generate.py", "interactive.py")

# source tokens of the warm-up sentence (then EOS): enough for every kernel regime a batch of
# one row runs, short enough to cost a few decoder steps
SOURCE_TOKENS = 8


def decoding_cli(program=None) -> bool:
    """Whether this process is fairseq-generate or fairseq-interactive."""
    program = sys.argv[0] if program is None and sys.argv else program or ""
    name = os.path.basename(program)
    folder = os.path.basename(os.path.dirname(program))
    return name.startswith(_DECODING_CLIS) or (
        folder == "fairseq_cli" and name in _DECODING_MODULES)


def warm_up(generator, model, source_dictionary) -> bool:
    """Decode one synthetic sentence through a drafting-free view of ``generator`` (a
    DraftVerifyGenerator) on ``model``'s device. Returns whether it decoded; a length limit
    that refuses the synthetic sentence leaves the generator cold (the real batches are
    checked on their own)."""
    device = next(model.parameters()).device
    first = source_dictionary.nspecial
    count = max(1, min(SOURCE_TOKENS, len(source_dictionary) - first))
    tokens = list(range(first, first + count)) + [source_dictionary.eos()]
    sample = {
        "id": torch.zeros(1, dtype=torch.long, device=device),
        "nsentences": 1,
        "ntokens": len(tokens),
        "net_input": {
            "src_tokens": torch.tensor([tokens], dtype=torch.long, device=device),
            "src_lengths": torch.tensor([len(tokens)], dtype=torch.long, device=device),
        },
    }
    started = time.perf_counter()
    if not decode_quietly(generator, model, sample):
        return False
    logger.info("warm-up: one sentence decoded in %.2fs before the timed decoding",
                time.perf_counter() - started)
    return True


def decode_quietly(generator, model, sample) -> bool:
    """Decode ``sample`` through a view of ``generator`` that shares its model and decoder step
    but drafts nothing, samples nothing and counts into statistics of its own (see the module's
    text). Returns whether it decoded (a length limit may refuse the sample)."""
    view = copy.copy(generator)  # shares the model and the chosen decoder step
    view.drafter = NoDrafter()
    view.acceptance = ExactAcceptance()
    view.sampler = None
    view.backoff = False
    view.stats = DecodeStats()
    try:
        view.generate([model], sample)
    except UsageError as error:
        logger.info("no warm-up decode (%s)", error)
        return False
    return True
