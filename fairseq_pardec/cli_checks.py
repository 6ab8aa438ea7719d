"""Early, one-line errors for flag combinations fairseq would reject obscurely.

fairseq imports ``--user-dir`` before it parses the rest of the command line, so this runs first.
Without ``--task translation_pardec`` our task's flags are unknown to fairseq, which answers
"unrecognized arguments" without saying which task they belong to.
"""

import os
import sys

from .errors import UsageError

TASK_FLAGS = ("--generator", "--block-size", "--blockwise-topk", "--blockwise-distance",
              "--min-block-size", "--drafter-path", "--gad-beta", "--gad-tau",
              "--interleaved-candidates")
CLIS = ("fairseq-generate", "fairseq-interactive", "fairseq-train", "fairseq-validate")
MODULES = ("generate.py", "interactive.py", "train.py", "validate.py")  # python -m fairseq_cli.X


def _is_fairseq_cli(program):
    name = os.path.basename(program)
    return name.startswith(CLIS) or (
        os.path.basename(os.path.dirname(program)) == "fairseq_cli"
        and name.startswith(MODULES)
    )


def _task(argv):
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    return None


def check_argv(argv=None):
    argv = sys.argv if argv is None else argv
    if not argv or not _is_fairseq_cli(argv[0]):
        return
    used = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in TASK_FLAGS]
    if used and _task(argv) != "translation_pardec":
        raise UsageError(
            "%s is an option of --task translation_pardec; add --task translation_pardec "
            "(it decodes checkpoints of the stock translation task too)" % used[0]
        )
