"""Output files that appear whole or not at all.

Each file is written under a temporary name in its own folder and renamed over the final name
once it is complete (a rename within one file system is atomic on POSIX). A full disk, a
read-only folder, Ctrl-C or SIGTERM half-way then leaves the earlier file as it was, never a
truncated one: the benchmark's ``results.json`` was once cut to invalid JSON that way.
"""

import os

from fairseq_pardec.errors import output_error


def temporary_name(path):
    """A hidden name next to ``path`` that keeps its extension (matplotlib reads the format
    from it) and the process id (two runs into one folder do not write the same file)."""
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, ".%s.%d.tmp%s" % (stem, os.getpid(), ext))


def remove_if_there(path):
    """Remove ``path`` if it is there (a temporary file a failed write left)."""
    try:
        os.remove(path)
    except OSError:
        pass


def replace_together(writers, flag):
    """Write several files, then put them all in place: ``writers`` maps each final path to a
    function that writes it at the path it is given.

    All are written under temporary names first; if any write fails, the temporary files are
    removed and :class:`~fairseq_pardec.errors.OutputError` names the file and ``flag`` (the
    option that chose the folder): every earlier file is intact. Only then are they renamed,
    so the files of one run never mix with another's but for a failure between two renames.
    """
    staged = {}
    try:
        for path, write in writers.items():
            staged[path] = temporary_name(path)
            try:
                write(staged[path])
            except OSError as error:
                raise output_error(error, path, flag) from None
        for path, temporary in staged.items():
            try:
                os.replace(temporary, path)
            except OSError as error:
                raise output_error(error, path, flag) from None
    finally:
        for temporary in staged.values():
            if os.path.exists(temporary):
                remove_if_there(temporary)


def write_text(path, text, flag):
    """``text`` to ``path``, whole or not at all (see :func:`replace_together`)."""

    def write(temporary):
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)

    replace_together({path: write}, flag)
