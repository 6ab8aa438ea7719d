"""Early, one-line errors for flag combinations fairseq would reject obscurely.

fairseq imports ``--user-dir`` before it parses the rest of the command line, so this runs first.
Without ``--task translation_pardec`` our task's flags are unknown to fairseq, which answers
"unrecognized arguments" without saying which task they belong to.
"""

import os
import sys

from fairseq_pardec.argv import program, task, values
from fairseq_pardec.errors import UsageError, running_a_cli, warn
from fairseq_pardec.input_files import FILE_FLAGS, file_problem, require_file


def task_flags(config):
    """The flags ``--task translation_pardec`` (its ``config``, a dataclass) adds to fairseq's
    translation task."""
    from dataclasses import fields

    from fairseq.tasks.translation import TranslationConfig

    stock = {f.name for f in fields(TranslationConfig)}
    return tuple("--" + f.name.replace("_", "-") for f in fields(config)
                 if f.name not in stock and not f.name.startswith("_"))


# fairseq reads 0 (and a negative size) as "no limit": a typo would batch the whole split
_SIZES = ("--batch-size", "--max-sentences", "--max-tokens", "--batch-size-valid",
          "--max-tokens-valid")


# counts that fairseq divides by or sizes tensors with: 0 ended in a traceback from deep inside
# torch (--beam, --nbest) or in SIGFPE from fairseq's batching in C (--required-batch-size-multiple)
_COUNTS = {
    "--beam": "the hypotheses kept per sentence",
    "--nbest": "the hypotheses printed per sentence",
    "--required-batch-size-multiple": "each batch's size is a multiple of it",
}


def _integers(argv, flags):
    for flag, value in values(argv, *flags):
        try:
            yield flag, int(value)
        except ValueError:
            continue  # fairseq's parser names it


def check_sizes(argv):
    for flag, number in _integers(argv, _SIZES):
        if number < 1:
            raise UsageError("%s must be >= 1 (got %d; fairseq would read it as no limit): give "
                             "a positive size, or leave the flag out" % (flag, number))
    for flag, number in _integers(argv, _COUNTS):
        if number < 1:
            raise UsageError("%s must be >= 1 (got %d; %s)" % (flag, number, _COUNTS[flag]))
    for flag, number in _integers(argv, ("--num-workers",)):
        if number < 0:  # torch's DataLoader refuses it with a traceback, after the model loads
            raise UsageError("--num-workers must be >= 0 (got %d; 0 loads batches in the main "
                             "process)" % number)
    for flag, number in _integers(argv, ("--seed",)):
        if not 0 <= number < 2 ** 32:  # numpy's seed, a traceback after the model loads
            raise UsageError("--seed must be between 0 and 2**32 - 1 (got %d)" % number)


def check_precision(argv):
    """fairseq-generate and fairseq-interactive convert the model for --fp16 only."""
    if program(argv) in ("generate", "interactive") and "--bf16" in argv:
        warn("--bf16 has no effect in fairseq-%s (it converts the model for --fp16 only): this "
             "run decodes in float32; the benchmark's --bf16 decodes in bfloat16" % program(argv))


def check_interactive_input(argv):
    if program(argv) != "interactive":
        return
    given = values(argv, "--input")
    source = given[-1][1] if given else "-"
    if source == "-":
        if sys.stdin is None or sys.stdin.closed:
            raise UsageError("fairseq-interactive reads sentences from standard input, which is "
                             "closed: pipe them in, or give a file with --input FILE")
    else:
        require_file(source, "--input")


def check_file_flags(argv):
    """A directory given where a file is expected (the folder of the checkpoints, of a corpus)."""
    for flag, path in values(argv, *FILE_FLAGS):
        if os.path.isdir(path):
            raise UsageError(file_problem(path, flag, *FILE_FLAGS[flag]))


def check_argv(task_config, argv=None):
    """The checks of the command line typed (``task_config``: our task's config dataclass,
    whose own flags need ``--task translation_pardec``)."""
    argv = sys.argv if argv is None else argv
    if not argv or not running_a_cli(argv[0]):
        return
    check_sizes(argv)
    check_precision(argv)
    check_interactive_input(argv)
    check_file_flags(argv)
    ours = task_flags(task_config)
    used = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in ours]
    if used and task(argv) != "translation_pardec":
        raise UsageError(
            "%s is an option of --task translation_pardec; add --task translation_pardec "
            "(it decodes checkpoints of the stock translation task too)" % used[0]
        )
