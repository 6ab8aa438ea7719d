"""Initialising a new model from another checkpoint, and knowing when not to.

Options such as ``--init-from-transformer`` / ``--init-from-verifier`` initialise a *new* model
from another checkpoint at training time; when the trained model itself is loaded (generate,
resume) every weight comes from its own checkpoint and the other file need not exist. fairseq
drops its ``from_checkpoint`` argument before it calls a model's ``build_model(args, task)``, so
``translation_pardec``'s ``build_model`` hands it over in (a copy of) the model config:
:func:`mark_from_checkpoint` there, :func:`built_from_checkpoint` in the models.
"""

import copy

from fairseq_pardec.errors import UsageError

_FROM_CHECKPOINT = "pardec_from_checkpoint"


def mark_from_checkpoint(cfg):
    """A copy of a model config that says "rebuilding a trained model from its checkpoint"."""
    from omegaconf import OmegaConf, open_dict

    marked = copy.copy(cfg)
    if OmegaConf.is_config(marked):
        with open_dict(marked):
            setattr(marked, _FROM_CHECKPOINT, True)
    else:
        setattr(marked, _FROM_CHECKPOINT, True)
    return marked


def built_from_checkpoint(args) -> bool:
    return bool(getattr(args, _FROM_CHECKPOINT, False))


def init_from_checkpoint(model, path, flag, may_differ=(), skip=()):
    """Copy a trained checkpoint's parameters into a new ``model`` (training-time initialisation).

    Every parameter of ``model`` must come from ``path`` with the same shape, except those whose
    names start with a prefix in ``may_differ`` (the parts the new architecture adds or replaces:
    proposal heads, direction embeddings, learned positions); the checkpoint may hold such parts
    that the model lacks (a sinusoid buffer where the model has none). Anything else that does
    not match means other sizes or another model: a one-line error naming ``flag``. Parameters
    whose names start with a prefix in ``skip`` are not copied (they keep their fresh values).
    """
    import os

    from fairseq import checkpoint_utils


    if not os.path.isfile(path):
        raise UsageError("%s: no checkpoint file %r" % (flag, path))
    state = checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
    own = model.state_dict()
    free = lambda key: key.startswith(tuple(may_differ))  # noqa: E731
    missing = [k for k in own if k not in state and not free(k)]
    unexpected = [k for k in state if k not in own and not free(k)]
    shaped = [k for k in state if k in own and own[k].shape != state[k].shape]
    if missing or unexpected or shaped:
        raise UsageError(
            "%s %s does not match this model (missing %s, unexpected %s, other shape %s): train "
            "with the checkpoint's sizes (--encoder/decoder-embed-dim, layers, ffn, heads) and its "
            "dictionaries" % (flag, path, missing[:3], unexpected[:3], shaped[:3]))
    model.load_state_dict({k: v for k, v in state.items()
                           if k in own and not k.startswith(tuple(skip))}, strict=False)
