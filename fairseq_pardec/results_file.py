"""fairseq-generate's ``--results-path`` file: an earlier run's file stays until this run completes.

fairseq opens ``RESULTS/generate-SUBSET.txt`` for writing before it loads the model, so any failure
(a bad checkpoint, a refused option, Ctrl-C) left the earlier file truncated, or this run's first
hypotheses under the normal name as if they were all. When the plugin is imported (before fairseq
opens the file) the earlier file is moved aside; at exit it is dropped if the run completed, or
put back, this run's partial hypotheses (if any) going to ``generate-SUBSET.partial.txt``.
"""

import atexit
import os
import sys

from fairseq_pardec import errors
from fairseq_pardec.cli_checks import program, values
from fairseq_pardec.errors import UsageError


def _check_folder(results):
    """--results-path must be a folder or creatable as one (fairseq's makedirs otherwise fails
    with a traceback after loading everything)."""
    path = os.path.abspath(results)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if path and not os.path.isdir(path):
        raise UsageError("--results-path %s: %s is a file, not a directory; give a directory "
                         "(fairseq writes generate-SUBSET.txt into it)" % (results, path))


def _aside(path):
    """A free name next to ``path`` for the earlier file (never over an older one left there)."""
    name, n = path + ".earlier", 1
    while os.path.exists(name):
        name, n = "%s.earlier.%d" % (path, n), n + 1
    return name


def _hypotheses(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.startswith("H-"))
    except OSError:
        return 0


class ResultsFile:
    def __init__(self, path):
        self.path = path
        self.earlier = None
        self.settled = False
        if os.path.isfile(path):
            self.earlier = _aside(path)
            os.replace(path, self.earlier)
        errors.on_interrupt(self.interrupted)
        atexit.register(self.at_exit)

    def partial_name(self):
        root, ext = os.path.splitext(self.path)
        return root + ".partial" + ext

    def keep_earlier(self):
        """Put the earlier file back; this run's hypotheses, if any, go to the partial name.
        Returns (hypotheses written, where they are) for the one line that reports it."""
        self.settled = True
        written, where = 0, None
        if os.path.isfile(self.path):
            written = _hypotheses(self.path)
            if written:
                where = self.partial_name()
                os.replace(self.path, where)
            else:
                os.remove(self.path)
        if self.earlier is not None:
            os.replace(self.earlier, self.path)
        return written, where

    def interrupted(self):
        written, where = self.keep_earlier()
        kept = "; the earlier %s is kept" % self.path if self.earlier else ""
        if where:
            return "%d hypotheses written to %s%s" % (written, where, kept)
        return "no hypothesis written" + kept

    def at_exit(self):
        if self.settled:
            return
        if errors.uncaught or not os.path.isfile(self.path):
            written, where = self.keep_earlier()
            if where:
                sys.stderr.write("%sthe %d hypotheses written before the error are in %s%s\n" % (
                    errors.PREFIX, written, where,
                    "; the earlier %s is kept" % self.path if self.earlier else ""))
        elif self.earlier is not None:
            os.remove(self.earlier)  # the run completed: its file replaces the earlier one


def guard(argv=None):
    """Move an earlier results file aside for the length of a fairseq-generate run."""
    argv = sys.argv if argv is None else argv
    if not argv or not errors.running_a_cli(argv[0]) or program(argv) != "generate":
        return None
    results = values(argv, "--results-path")
    if not results:
        return None
    folder = results[-1][1]
    _check_folder(folder)
    subsets = values(argv, "--gen-subset")
    subset = subsets[-1][1] if subsets else "test"
    return ResultsFile(os.path.join(folder, "generate-%s.txt" % subset))
