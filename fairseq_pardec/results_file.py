"""fairseq-generate's ``--results-path`` file: it takes its name only when the run is complete.

fairseq opens ``RESULTS/generate-SUBSET.txt`` for writing before it loads the model, so any failure
(a bad checkpoint, a refused option, Ctrl-C, SIGTERM, a full disk) left the earlier file truncated,
or this run's first hypotheses under the normal name as if they were all. When the plugin is
imported (before fairseq opens the file) fairseq-generate's ``open`` is pointed at this module:
the run writes a temporary file of its own (``.generate-SUBSET.PID.tmp.txt``: processes that
share the folder, sharded ranks, never write one file), which is renamed over
``generate-SUBSET.txt`` when fairseq closes it after the last sentence. A run that fails or is
interrupted moves its hypotheses (if any) to ``generate-SUBSET.partial.txt`` and says so in one
line; only a run killed outright (SIGKILL) leaves the temporary file. The earlier file is never
touched until a run completes.
"""

import atexit
import builtins
import os
import sys
import tempfile

from fairseq_pardec import errors
from fairseq_pardec.argv import program, values
from fairseq_pardec.errors import UsageError, output_error
from fairseq_pardec.output_files import temporary_name

FLAG = "--results-path"


def _check_folder(results):
    """--results-path must be a folder, or creatable as one, that this process can write:
    fairseq's makedirs and open would otherwise fail with a traceback after loading everything."""
    path = os.path.abspath(results)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if path and not os.path.isdir(path):
        raise UsageError("%s %s: %s is a file, not a directory; give a directory "
                         "(fairseq writes generate-SUBSET.txt into it)" % (FLAG, results, path))
    try:  # a real file, not os.access: root passes os.access on a read-only file system
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise UsageError("%s %s: %s cannot be written (%s); give a directory you can write (any "
                         "earlier results there are left as they are)"
                         % (FLAG, results, path, error.strerror or error)) from None


def partial_name(path):
    root, ext = os.path.splitext(path)
    return root + ".partial" + ext


def _hypotheses(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.startswith("H-"))
    except OSError:
        return 0


class _Staged:
    """The file fairseq-generate writes, under the temporary name; renamed to the results file
    when fairseq's ``with`` block ends without an exception (the last sentence written)."""

    def __init__(self, results, stream):
        self._results = results
        self._stream = stream

    def _failed(self, error):
        return output_error(error, self._results.path, FLAG)

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as error:
            raise self._failed(error) from None

    def flush(self):
        try:
            self._stream.flush()
        except OSError as error:
            raise self._failed(error) from None

    def close(self):
        try:
            self._stream.close()
        except OSError as error:
            raise self._failed(error) from None

    def __getattr__(self, name):  # fileno, encoding, isatty, ... of the real file
        return getattr(self._stream, name)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None:  # the run failed: what it wrote becomes partial (settled at exit)
            try:
                self._stream.close()
            except OSError:
                pass  # the error that ended the run is the one to report
            return False
        self.close()
        self._results.complete()
        return False


class ResultsFile:
    def __init__(self, path):
        self.path = path
        self.partial = partial_name(path)
        self.temporary = temporary_name(path)
        self.staged = None
        self.settled = False
        errors.on_interrupt(self.interrupted)
        errors.on_error(self.after_error)
        atexit.register(self.at_exit)

    def open(self, file, mode="r", *args, **kwargs):
        """fairseq-generate's ``open``: its results file goes to the temporary name."""
        if (self.staged is None and isinstance(file, (str, os.PathLike)) and "w" in mode
                and os.path.abspath(file) == os.path.abspath(self.path)):
            try:
                stream = builtins.open(self.temporary, mode, *args, **kwargs)
            except OSError as error:
                raise output_error(error, self.path, FLAG) from None
            self.staged = _Staged(self, stream)
            return self.staged
        return builtins.open(file, mode, *args, **kwargs)

    def complete(self):
        self.settled = True
        try:
            os.replace(self.temporary, self.path)
        except OSError as error:
            raise output_error(error, self.path, FLAG) from None

    def keep_partial(self):
        """This run's hypotheses, if any, go to the partial name; an empty file goes.
        Returns how many there are (0 when none was written, or they could not be moved)."""
        self.settled = True
        if self.staged is None or not os.path.isfile(self.temporary):
            return 0
        written = _hypotheses(self.temporary)
        try:
            if written:
                os.replace(self.temporary, self.partial)
            else:
                os.remove(self.temporary)
        except OSError:
            return 0  # left under the temporary name: the line must not point elsewhere
        return written

    def _kept(self):
        return "; the earlier %s is kept" % self.path if os.path.isfile(self.path) else ""

    def interrupted(self):
        if self.settled:
            return None
        written = self.keep_partial()
        if written:
            return "%d hypotheses written to %s%s" % (written, self.partial, self._kept())
        return "no hypothesis written" + self._kept()

    def after_error(self):
        """Part of a user error's one line: where this run's hypotheses went."""
        if self.settled:
            return None
        written = self.keep_partial()
        if written:
            return "the %d hypotheses written before the error are in %s%s" % (
                written, self.partial, self._kept())
        return None

    def at_exit(self):
        """After an error that was not one line of ours (a traceback): a line of its own."""
        part = self.after_error()
        if part:
            sys.stderr.write(errors.PREFIX + part + "\n")


def _generate_modules():
    """fairseq-generate's module, as the console script (``fairseq_cli.generate``) and as
    ``python -m fairseq_cli.generate`` (``__main__``) load it."""
    for name in ("fairseq_cli.generate", "__main__"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) or ""
        if (os.path.basename(path) == "generate.py"
                and os.path.basename(os.path.dirname(path)) == "fairseq_cli"):
            yield module


def guard(argv=None):
    """Stage fairseq-generate's results file (see the module's docstring) for this run."""
    argv = sys.argv if argv is None else argv
    if not argv or not errors.running_a_cli(argv[0]) or program(argv) != "generate":
        return None
    results = values(argv, FLAG)
    if not results:
        return None
    folder = results[-1][1]
    _check_folder(folder)
    subsets = values(argv, "--gen-subset")
    subset = subsets[-1][1] if subsets else "test"
    staged = ResultsFile(os.path.join(folder, "generate-%s.txt" % subset))
    modules = list(_generate_modules())
    if not modules:
        import fairseq_cli.generate

        modules = [fairseq_cli.generate]
    for module in modules:
        # a module global shadows the builtin for that module's code only: fairseq-generate
        # opens its results file with a plain open() and offers no other way in
        module.open = staged.open
    return staged
