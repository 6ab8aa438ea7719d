"""Reading a command line's arguments as typed, before (or without) an argument parser: the
checks that run when the plugin is imported and the messages of errors read them."""

import os


def values(argv, *flags):
    """(flag, value) of each ``--flag value`` or ``--flag=value`` in ``argv``, in order."""
    found = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if eq:
                found.append((flag, value))
            elif i + 1 < len(argv):
                found.append((flag, argv[i + 1]))
    return found


def program(argv):
    """``generate``, ``interactive``, ... of a fairseq CLI's ``argv[0]`` (either spelling)."""
    name = os.path.basename(argv[0]) if argv else ""
    return name.replace("fairseq-", "").replace(".py", "")


def task(argv):
    """The ``--task`` typed, or None."""
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    return None


def training(argv) -> bool:
    """Whether ``argv`` runs fairseq-train (either spelling)."""
    return bool(argv) and os.path.basename(argv[0]).startswith(("fairseq-train", "train.py"))
