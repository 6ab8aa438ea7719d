"""Early, one-line errors for flag combinations fairseq would reject obscurely.

fairseq imports ``--user-dir`` before it parses the rest of the command line, so this runs first.
Without ``--task translation_pardec`` our task's flags are unknown to fairseq, which answers
"unrecognized arguments" without saying which task they belong to.
"""

import sys

from .errors import UsageError, running_a_cli



def task_flags():
    """The flags ``--task translation_pardec`` adds to fairseq's translation task."""
    from dataclasses import fields

    from fairseq.tasks.translation import TranslationConfig

    from .tasks.translation_pardec import TranslationPardecConfig

    stock = {f.name for f in fields(TranslationConfig)}
    return tuple("--" + f.name.replace("_", "-") for f in fields(TranslationPardecConfig)
                 if f.name not in stock and not f.name.startswith("_"))


def _task(argv):
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    return None


def check_argv(argv=None):
    argv = sys.argv if argv is None else argv
    if not argv or not running_a_cli(argv[0]):
        return
    used = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in task_flags()]
    if used and _task(argv) != "translation_pardec":
        raise UsageError(
            "%s is an option of --task translation_pardec; add --task translation_pardec "
            "(it decodes checkpoints of the stock translation task too)" % used[0]
        )
