"""The package's error class, and the one place that turns it into a one-line message.

Library code (models, criterions, generators, drafters) raises :class:`UsageError` for bad input
or options: an ordinary exception (a ``ValueError``) that callers can catch. Only the command
lines turn it into ``fairseq_pardec: error: ...`` and exit status 1: our own CLIs catch it, and
for fairseq's CLIs (whose ``main`` is not ours) :func:`install_cli_boundary` hooks the uncaught
exception. Anything else keeps its traceback: a ``ValueError`` from a bug is not a user error.
An output file that cannot be written raises :class:`OutputError` (an ``OSError``), told in one
line too. Ctrl-C and SIGTERM end a command line in one line that says how far it got.
"""

import atexit
import errno
import logging
import os
import re
import signal
import sys
import threading

from fairseq_pardec import failures, prefetch_threads


class UsageError(ValueError):
    """Bad input or options; the message names the problem and the flag that fixes it."""


class OutputError(OSError):
    """An output file could not be written (a full disk, a folder made read-only meanwhile).

    Still an ``OSError`` (with the cause's ``errno``) for a library caller; the message names the
    file and the flag that chose it, and says that the earlier file there is intact.
    """

    def __init__(self, message, cause=None):
        super().__init__(message)
        self.errno = getattr(cause, "errno", None)
        self.filename = getattr(cause, "filename", None)

    def __str__(self):
        return self.args[0]


def output_error(error, path, flag):
    """:class:`OutputError` for ``error`` (an ``OSError``) met writing ``path``, given by ``flag``."""
    reason = (error.strerror or str(error)) if isinstance(error, OSError) else str(error)
    hint = {errno.ENOSPC: "free some space, or give %s on another disk" % flag,
            errno.EDQUOT: "free some of your quota, or give %s on another disk" % flag,
            errno.EROFS: "give %s on a writable file system" % flag,
            errno.EACCES: "give %s a directory you can write" % flag,
            errno.EPERM: "give %s a directory you can write" % flag}.get(
        getattr(error, "errno", None), "check %s" % flag)
    return OutputError("%s: cannot write %s (%s); nothing was replaced: the earlier file there, "
                       "if any, is intact; %s" % (flag, path, reason, hint), error)


class Terminated(SystemExit):
    """SIGTERM (``timeout``, ``kill``, Slurm, ``docker stop``) ended the command line.

    Raised where the run is, as Ctrl-C's ``KeyboardInterrupt`` is, so that open files are closed
    and settled on the way out; a ``SystemExit`` so that no ``except Exception`` of fairseq's
    swallows it, with status 143 (128 + 15, what a shell reports for a run SIGTERM ended).
    """

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


PREFIX = "fairseq_pardec: error: "
WARNING = "fairseq_pardec: warning: "

_FAIRSEQ_CLIS = ("fairseq-generate", "fairseq-interactive", "fairseq-train", "fairseq-validate",
                 "fairseq-preprocess", "pardec-benchmark")
_FAIRSEQ_MODULES = ("generate.py", "interactive.py", "train.py", "validate.py")

# What fairseq itself raises for a handful of bad inputs, as a one-line message of ours. fairseq
# raises these from its own main, before or around our code, so they cannot be caught earlier.
# Each message is given the match and the error (where it was raised tells which input line).
_FAIRSEQ_FAILURES = (
    (OSError, r"Model file not found: (.*)",
     lambda m, _: "--path %s: no such checkpoint file" % m.group(1)),
    (RuntimeError, r"PytorchStreamReader failed|failed finding central directory|unpickling",
     lambda m, _: "--path: a checkpoint is truncated or not a torch checkpoint (%s); check the "
                  "file, or train/copy it again" % m.group(0)),
    (AssertionError, r"--sampling requires --nbest to be equal to --beam",
     failures.sampling_beam),
    (AssertionError, r"--temperature must be greater than 0",
     lambda m, _: "--temperature must be > 0 (it divides the scores before sampling); for greedy "
                  "output drop --sampling and --temperature"),
    (FileNotFoundError, failures.MISSING_DICTIONARY, failures.missing_dictionary),
    (FileNotFoundError, failures.MISSING_SPLIT, failures.missing_split),
    (Exception, failures.NO_LANGUAGE_PAIR, failures.no_language_pair),
    (Exception, failures.TOO_LONG, failures.too_long),
    (Exception, failures.TRUNCATED_BIN, failures.truncated_bin),
)

# fairseq's failures that their text alone does not identify: where they were raised (a
# checkpoint that fairseq's reader cannot read) or several parts of the text matter.
_FAIRSEQ_RULES = (failures.bad_checkpoint, failures.dictionary_mismatch,
                  failures.no_space, failures.bad_binarized_file,
                  failures.interactive_input_not_utf8)


def one_line(error):
    """The one-line message for ``error``, or None when it is not a known user error."""
    if isinstance(error, (UsageError, OutputError)):
        return PREFIX + str(error)
    for rule in _FAIRSEQ_RULES:
        message = rule(error)
        if message:
            return PREFIX + message
    for kind, pattern, message in _FAIRSEQ_FAILURES:
        match = re.search(pattern, str(error)) if isinstance(error, kind) else None
        if match:
            return PREFIX + message(match, error)
    return None


def warn(message):
    """One warning line: ``fairseq_pardec: warning: ...`` on a command line, a logged warning in
    a library caller's program."""
    if running_a_cli():
        sys.stderr.write(WARNING + message + "\n")
    else:
        logging.getLogger("fairseq_pardec").warning(message)


def running_a_cli(program=None):
    """Whether this process is one of fairseq's command lines (or ours)."""
    program = sys.argv[0] if program is None and sys.argv else program or ""
    name = os.path.basename(program)
    folder = os.path.basename(os.path.dirname(program))
    return name.startswith(_FAIRSEQ_CLIS) or (
        folder == "fairseq_cli" and name.startswith(_FAIRSEQ_MODULES)) or (
        folder == "benchmark" and name in ("__main__.py", "runner.py")  # python -m fairseq_pardec.benchmark
        and os.path.basename(os.path.dirname(os.path.dirname(program))) == "fairseq_pardec")


# Exceptions that ended the command line (read at exit: a failed or interrupted run prints no
# summary and keeps the earlier results file), and what to say when Ctrl-C ends it.
uncaught = []
_interrupt_reports = []


def on_interrupt(report, first=False):
    """Call ``report()`` when Ctrl-C ends the command line; it returns a part of the one line
    that says so (how much was done, where the output went), or None."""
    _interrupt_reports.insert(0, report) if first else _interrupt_reports.append(report)


def on_error(report):
    """Call ``report()`` when a known user error ends the command line; it returns a part of
    the error's one line (what the run left behind, where), or None."""
    _error_reports.append(report)


_error_reports = []


def with_reports(line):
    parts = [part for part in (report() for report in _error_reports) if part]
    return line + ("; " + "; ".join(parts) if parts else "")


def interrupted_line(cause="Ctrl-C"):
    parts = [part for part in (report() for report in _interrupt_reports) if part]
    return PREFIX + "interrupted (%s)" % cause + (": " + "; ".join(parts) if parts else "")


def _terminate(signum, frame):
    """SIGTERM's handler: end the run as Ctrl-C does (see :class:`Terminated`)."""
    if os.getpid() != _sigterm_owner:
        # a forked child (a DataLoader worker) that a process-group kill (Slurm) reached: it
        # has nothing to settle, and the main process reports; die as SIGTERM would have it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the settling short
    error = Terminated()
    uncaught.append(error)
    # registered last, so it runs first at exit: after the stack has unwound (fairseq's output
    # file closed) and before the other exit handlers, which read ``uncaught``
    atexit.register(lambda: sys.stderr.write(interrupted_line("SIGTERM") + "\n"))
    raise error


def handle_sigterm():
    """Make SIGTERM end the command line as Ctrl-C does: one line, files settled, status 143.

    Only where SIGTERM still has its default action (a program that set its own keeps it) and
    from the main thread (the only one that may set a handler).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    global _sigterm_owner
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _sigterm_owner = os.getpid()
        signal.signal(signal.SIGTERM, _terminate)


_sigterm_owner = None


def quiet_finalizers():
    """After a one-line error, drop the tracebacks of finalizers (``__del__``) that fail at exit
    on objects the error left half-built (fairseq's reader of a broken ``.idx``): they are the
    same error again, told as a traceback."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if getattr(unraisable.object, "__name__", None) != "__del__":
            previous(unraisable)

    sys.unraisablehook = hook


def exit_in_one_line(error):
    """At a command line's boundary: end the process with ``error``'s one line and status 1, or
    raise it again where it is not a known user error (a bug keeps its traceback). Python prints
    the line after it has let go of the error, and with it of what the error left half-built
    (fairseq's reader of an empty split), whose failing ``__del__`` stays quiet."""
    line = one_line(error)
    if line is None:
        raise error
    quiet_finalizers()
    raise SystemExit(line) from None


def install_cli_boundary():
    """Print known user errors that reach the top of a fairseq CLI as one line (exit status 1),
    and an interruption as one line that says how far the run got.

    Installed when the plugin is imported; it decides only when an exception is uncaught, and
    only for fairseq's (and our) command lines, so a library caller's program is left alone.
    """
    previous = sys.excepthook
    if getattr(previous, "_pardec", False):
        return
    # decided now, while sys.argv names the program: ``runpy`` (``python -m``, and harnesses
    # that run a CLI module the same way) puts the original sys.argv[0] back as the exception
    # leaves the module, before the hook runs
    cli = running_a_cli()

    def hook(kind, error, traceback):
        uncaught.append(error)
        here = cli or running_a_cli()
        if here and isinstance(error, KeyboardInterrupt):
            sys.stderr.write(interrupted_line() + "\n")
            return  # Python still exits as killed by SIGINT (status 130 in a shell)
        line = one_line(error) if here else None
        if line is None:
            return previous(kind, error, traceback)
        sys.stderr.write(with_reports(line) + "\n")
        quiet_finalizers()

    hook._pardec = True
    sys.excepthook = hook
    handle_sigterm()
    # a batch-prefetch thread still collating when the process ends would abort it (SIGABRT)
    # after this line: stopped at exit
    prefetch_threads.install()
