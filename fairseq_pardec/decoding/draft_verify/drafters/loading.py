"""Loading GAD's drafter checkpoint next to the verifier, with clear errors before decoding.

fairseq-generate moves only the ``--path`` models to the GPU and applies ``--fp16`` to them; the
drafter follows the verifier here (same device, same dtype) and is put in eval mode.
"""

import os

import torch

from fairseq import checkpoint_utils
from fairseq_pardec.errors import UsageError


def _arch(state):
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        model_cfg = cfg["model"]
        name = model_cfg.get("_name") if hasattr(model_cfg, "get") else None
        arch = model_cfg.get("arch") if hasattr(model_cfg, "get") else None
        return arch or name or getattr(model_cfg, "arch", None)
    args = state.get("args")
    return getattr(args, "arch", None)


def load_drafter(task, path, verifier):
    if not path:
        raise UsageError("--generator gad needs the drafter checkpoint: add --drafter-path D.pt")
    if not os.path.isfile(path):
        raise UsageError("--drafter-path %s: no such file" % path)
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    arch = _arch(state) or "unknown"
    if not str(arch).startswith("glat_drafter"):
        raise UsageError(
            "--drafter-path %s is a %s checkpoint, not a glat_drafter (train one with "
            "--arch glat_drafter_base --criterion glat_loss)" % (path, arch)
        )
    weights = state["model"]
    for side, key, dictionary in (
        ("source", "encoder.embed_tokens.weight", task.source_dictionary),
        ("target", "decoder.embed_tokens.weight", task.target_dictionary),
    ):
        rows = weights[key].size(0) if key in weights else None
        if rows is not None and rows != len(dictionary):
            raise UsageError(
                "drafter and verifier dictionaries differ: the drafter's %s embeddings have %d "
                "types, this data's %s dictionary has %d; train the drafter on data binarized "
                "with the verifier's dictionary (fairseq-preprocess --srcdict/--tgtdict)"
                % (side, rows, side, len(dictionary))
            )
    # the state read above builds the model: the file is read once
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([path], task=task, state=state)
    drafter = models[0]
    if drafter.reads_verifier_encoder:
        _check_same_encoder(path, drafter, verifier)
    reference = next(verifier.parameters())
    drafter.to(device=reference.device, dtype=reference.dtype)
    drafter.eval()
    return drafter


def _check_same_encoder(path, drafter, verifier):
    """A drafter trained on the verifier's frozen encoder reads the verifier's encoder output;
    that is only right for the verifier it was trained with."""
    own = drafter.encoder.state_dict()
    theirs = verifier.encoder.state_dict()
    same = own.keys() == theirs.keys() and all(
        own[k].shape == theirs[k].shape
        and torch.equal(own[k].to(theirs[k].device, theirs[k].dtype), theirs[k]) for k in own)
    if not same:
        raise UsageError(
            "--drafter-path %s was trained on another verifier's encoder (--drafter-encoder "
            "verifier): give --path the checkpoint it was trained with (its --init-from-verifier)"
            % path)
