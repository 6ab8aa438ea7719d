"""fairseq-train's checkpoints written whole or not at all, and a failed write told in one line.

fairseq writes a checkpoint to ``NAME.pt.tmp`` and renames it, but on a full disk it tried
``torch.save`` three times, 2.5 s apart, logged the chained tracebacks, and left ``NAME.pt.tmp``
behind; the error that reached the command line was the closing file's ``ENOSPC``, which names
no file. Its other checkpoints of the same step (``checkpoint_last.pt`` after
``checkpoint_best.pt``) were copied straight over the earlier file, which a full disk then cut
short. Here a checkpoint that cannot be written leaves its temporary file removed and the earlier
file as it was, and ends the run with :class:`~fairseq_pardec.errors.OutputError` naming the file
and ``--save-dir``. Installed for fairseq-train only (errors.install_cli_boundary).
"""

import errno
import logging
import os
import time
import traceback

from fairseq_pardec.errors import output_error
from fairseq_pardec.output_files import remove_if_there

_FULL = (errno.ENOSPC, errno.EDQUOT)
RETRIES, RETRY_WAIT = 3, 2.5  # fairseq's, for a file system that fails for a moment


def full_disk(error):
    """The ``OSError`` of a full disk or quota in ``error`` or the errors it was raised from
    (torch reports the write's ``ENOSPC`` as a ``RuntimeError`` raised while handling it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL:
            return error
        error = error.__cause__ or error.__context__
    return None


def _settled(write, temporary, path):
    """Run ``write`` (which writes ``temporary``), then rename it to ``path``; on any failure
    (Ctrl-C too) remove ``temporary``, and tell a full disk as an ``OutputError``."""
    try:
        result = write()
        os.replace(temporary, path)
        return result
    except BaseException as error:
        remove_if_there(temporary)
        full = full_disk(error)
        if full is not None:
            raise output_error(full, path, "--save-dir") from None
        raise


def _torch_save(obj, f, logger):
    """fairseq's retries of ``torch.save``, but none where the disk is full: the same bytes
    would meet the same full disk, 5 seconds and two logged tracebacks later."""
    import torch

    for attempt in range(RETRIES):
        try:
            return torch.save(obj, f)
        except Exception as error:
            if full_disk(error) is not None:
                raise
            if attempt == RETRIES - 1:
                logger.error(traceback.format_exc())
                raise
            time.sleep(RETRY_WAIT)


def install():
    """Put the whole-or-nothing writes in place of fairseq's ``torch_persistent_save`` and
    ``PathManager.copy`` in ``fairseq.checkpoint_utils`` (which looks both up at each call)."""
    from fairseq import checkpoint_utils

    if getattr(checkpoint_utils.torch_persistent_save, "_pardec", False):
        return
    fairseq_save = checkpoint_utils.torch_persistent_save
    manager = checkpoint_utils.PathManager
    logger = logging.getLogger(checkpoint_utils.__name__)

    def torch_persistent_save(obj, filename, async_write=False):
        if async_write or not isinstance(filename, str) or not manager.supports_rename(filename):
            return fairseq_save(obj, filename, async_write=async_write)
        temporary = filename + ".tmp"

        def write():
            with manager.open(temporary, "wb") as f:
                _torch_save(obj, f, logger)

        return _settled(write, temporary, filename)

    class WholeCopies(manager):
        """fairseq's PathManager, copying ``checkpoint_best.pt`` to ``checkpoint_last.pt`` (and
        the like) under a temporary name first."""

        @staticmethod
        def copy(src_path, dst_path, overwrite=False):
            if not overwrite or not manager.supports_rename(dst_path):
                return manager.copy(src_path, dst_path, overwrite)
            temporary = dst_path + ".tmp"
            return _settled(lambda: manager.copy(src_path, temporary, True), temporary, dst_path)

    torch_persistent_save._pardec = True
    checkpoint_utils.torch_persistent_save = torch_persistent_save
    checkpoint_utils.PathManager = WholeCopies
