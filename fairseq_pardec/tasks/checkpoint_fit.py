"""Whether the checkpoints that fairseq loaded can do what this run asks of them.

fairseq decodes with any checkpoint whose weights fit the data's dictionaries: a GAD drafter given
as ``--path`` decodes (garbage) without complaint, and a model that shares one dictionary between
its languages decodes the wrong direction when ``-s``/``-t`` are swapped. The first is refused, the
second warned about, in one line each.
"""

import os

from fairseq_pardec.errors import UsageError, warn
from fairseq_pardec.models.glat_drafter import GlatDrafterModel
from fairseq_pardec.models.loading import built_from_checkpoint


def refuse_non_verifiers(models):
    """A glat_drafter proposes blocks for a verifier; it is no translation model of its own.

    Only a drafter loaded from a checkpoint is refused: training one with ``--eval-bleu`` builds
    a generator for the new model, and that is fairseq's business.
    """
    for model in models:
        if isinstance(model, GlatDrafterModel) and built_from_checkpoint(model.args):
            raise UsageError(
                "--path is a glat_drafter checkpoint: a drafter, which cannot translate by itself; "
                "give --path the translation model (the verifier) and the drafter to "
                "--generator gad --drafter-path")


def trained_direction(model_cfg):
    """(source, target) languages a checkpoint was trained for, or None when it does not say.

    Checkpoints record ``-s``/``-t`` only when they were typed; otherwise the training data
    directory names them (``SPLIT.SRC-TGT.LANG.bin``) when it is still there and holds one pair.
    """
    source = getattr(model_cfg, "source_lang", None)
    target = getattr(model_cfg, "target_lang", None)
    if source and target:
        return str(source), str(target)
    data = str(getattr(model_cfg, "data", None) or "").split(os.pathsep)[0]
    try:
        names = os.listdir(data) if data else []
    except OSError:
        return None
    pairs = {n.split(".")[1] for n in names
             if n.endswith(".bin") and n.count(".") >= 3 and n.split(".")[1].count("-") == 1}
    if len(pairs) != 1:
        return None
    source, target = pairs.pop().split("-")
    return source, target


def warn_other_direction(task_cfg, model_cfg):
    trained = trained_direction(model_cfg)
    asked = (task_cfg.source_lang, task_cfg.target_lang)
    if trained is None or None in asked or tuple(asked) == trained:
        return
    warn("-s %s -t %s, but the checkpoint translates %s into %s (the languages it was trained "
         "on): this run feeds it %s text as if it were %s; give -s %s -t %s, or a checkpoint "
         "trained for %s into %s" % (asked + trained + (asked[0], trained[0]) + trained + asked))
