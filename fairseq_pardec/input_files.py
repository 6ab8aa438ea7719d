"""A file given on the command line that is not there, or is a directory.

``os.path.isfile`` is false for both, and both were told as "no such file": a user who gave the
folder of the checkpoints (or of the corpus) read that the folder did not exist. One line says
which it is, and for a directory which files it holds. No fairseq import here: the checks run
before fairseq parses the command line.
"""

import os
from typing import List

from fairseq_pardec.errors import UsageError


def _listing(folder, suffix):
    try:
        names = sorted(n for n in os.listdir(folder)
                       if not n.startswith(".") and (suffix is None or n.endswith(suffix)))
    except OSError:
        return "nothing readable"
    if not names:
        return "no %s files" % suffix if suffix else "nothing"
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def file_problem(path, flag, what="file", suffix=None):
    """The one-line reason ``path`` (given by ``flag``) is not a readable file, or None.

    ``what`` names the file expected ("checkpoint file", "text file"); ``suffix`` keeps the
    directory's listing to the names that could be meant (``.pt`` for a checkpoint).
    """
    if os.path.isfile(path):
        return None
    given = flag + path if flag.endswith("=") else "%s %s" % (flag, path)  # path=X of a spec
    if os.path.isdir(path):
        return ("%s is a directory, not a %s; give the file itself (the directory holds: %s)"
                % (given, what, _listing(path, suffix)))
    return "%s does not exist (no such %s)" % (given, what)


def require_file(path, flag, what="file", suffix=None):
    """:class:`UsageError` where ``path`` is missing or a directory (see :func:`file_problem`)."""
    problem = file_problem(path, flag, what, suffix)
    if problem:
        raise UsageError(problem)


def text_lines(path: str, flag: str) -> List[str]:
    """The lines of the UTF-8 text file ``path``, given by ``flag``; a missing or unreadable
    one is a :class:`UsageError` naming the flag."""
    require_file(path, flag, "text file")
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    except OSError as error:
        raise UsageError("%s %s: %s" % (flag, path, error.strerror)) from None
    except UnicodeDecodeError as error:
        raise UsageError("%s %s is not UTF-8 text (%s)" % (flag, path, error.reason)) from None


# the file flags of --task translation_pardec and of our models, and what each names. A
# directory is refused before anything loads; a missing file is told where the file is read (a
# resumed training run, or a generator that does not read it, never needs it). fairseq's own
# --path is told by failures.bad_checkpoint.
FILE_FLAGS = {
    "--draft-corpus": ("text file", None),
    "--drafter-path": ("checkpoint file", ".pt"),
    "--init-from-transformer": ("checkpoint file", ".pt"),
    "--init-from-verifier": ("checkpoint file", ".pt"),
}
