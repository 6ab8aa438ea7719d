"""Version guards and safe checkpoint loading for torch >= 2.6.

torch 2.6 made ``torch.load(weights_only=True)`` the default. fairseq checkpoints pickle a few
non-tensor objects: the training ``argparse.Namespace`` (older checkpoints and ``cfg.model`` of models
built from args) and, when training ran with ``--eval-bleu``, numpy scalars/arrays in the saved meter
state (``best_bleu`` and the BLEU count meters). Instead of switching the safe loader off (which
would let a checkpoint file run arbitrary code), we allow exactly those types.

fairseq imports ``--user-dir`` modules before it loads any checkpoint, so importing the plugin is
enough; ``fairseq-generate``, ``fairseq-interactive`` and training resume all benefit.
"""

import argparse
import sys

import numpy as np
import torch

MIN_PYTHON = (3, 11)


def _numpy_safe_globals():
    """The numpy objects a fairseq checkpoint may pickle (scalars, arrays, dtypes)."""
    types = [np.ndarray, np.dtype]
    # numpy >= 1.25 exposes concrete dtype classes (np.dtypes.Float64DType, ...); they are what
    # pickling a dtype references.
    dtypes_module = getattr(np, "dtypes", None)
    if dtypes_module is not None:
        for name in dir(dtypes_module):
            obj = getattr(dtypes_module, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                types.append(obj)
    # Scalars and arrays are rebuilt by these two functions; numpy 2 moved them to numpy._core.
    for module_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = __import__(module_name, fromlist=["scalar"])
            except ImportError:
                continue
        types.extend([module.scalar, module._reconstruct])
        break
    return types


SAFE_CHECKPOINT_GLOBALS = [argparse.Namespace] + _numpy_safe_globals()


def install_safe_checkpoint_globals():
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4 does not load weights-only by default: nothing to do
        return
    add(SAFE_CHECKPOINT_GLOBALS)


def check_versions():
    if sys.version_info < MIN_PYTHON:
        raise RuntimeError(
            "fairseq_pardec needs Python >= %d.%d (found %s)"
            % (MIN_PYTHON + (sys.version.split()[0],))
        )


check_versions()
install_safe_checkpoint_globals()


def restore_log_level():
    """Undo fairseq's import-time ``logging.basicConfig(level=DEBUG)``.

    ``fairseq/models/wav2vec/wav2vec2_classification.py`` sets the root logger to DEBUG when
    fairseq is imported, so every library's debug lines print (matplotlib's font manager floods
    the benchmark). fairseq's CLIs mean INFO (``LOGLEVEL``, default INFO): restore that.
    """
    import logging
    import os

    root = logging.getLogger()
    if root.level == logging.DEBUG and os.environ.get("LOGLEVEL", "INFO").upper() != "DEBUG":
        root.setLevel(logging.INFO)
