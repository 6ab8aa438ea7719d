"""``task='translation_pardec'`` and its options as overrides of a checkpoint of the stock task.

The hub (``TransformerModel.from_pretrained(..., generator='auto')``) and ``--model-overrides``
hand their keywords to fairseq's checkpoint reader as overrides, and fairseq sets only the keys
that the checkpoint's saved config already has (``overwrite_args_by_name``). A checkpoint
trained with the stock ``translation`` task has neither our task's name nor its options, so
``task='translation_pardec', generator='auto'`` were both dropped in silence: the model decoded
with fairseq's beam 5, and the caller was not told.

Our task's config extends fairseq's translation config and the task adds no state to the model,
so asking for it by name is enough: the checkpoint's task section becomes ours (its name, and
our options at their defaults) just before fairseq applies the overrides, which then set our
options as they set any other. Our options without our task are not applied (the stock task
has no generators); that is said in one warning that names the fix.
"""

import dataclasses

from fairseq_pardec.errors import warn

TASK = "translation_pardec"


def _our_config():
    from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig

    return TranslationPardecConfig


def _our_options():
    """The options our task adds to fairseq's translation task (``generator``, ...)."""
    from fairseq.tasks.translation import TranslationConfig

    stock = {f.name for f in dataclasses.fields(TranslationConfig)}
    return [f.name for f in dataclasses.fields(_our_config())
            if f.name not in stock and not f.name.startswith("_")]


def adopt_task(cfg, overrides):
    """Make the task section of ``cfg`` (a checkpoint's saved config) ``translation_pardec``'s
    where ``overrides`` ask for that task and the checkpoint's task is one it extends; warn
    where ``overrides`` give our options that would be dropped."""
    from fairseq.tasks import TASK_DATACLASS_REGISTRY
    from omegaconf import DictConfig, open_dict

    task = cfg.get("task") if isinstance(cfg, DictConfig) else None
    if not isinstance(task, DictConfig) or not isinstance(overrides, dict):
        return  # no saved task config (an older checkpoint's Namespace takes every override)
    saved = task.get("_name")
    if saved == TASK:
        return  # ours already: fairseq applies the overrides itself
    asked = overrides.get("task")
    ours = [name for name in _our_options() if name in overrides]
    if asked != TASK:
        if ours:
            warn("%s %s of task %r, which the checkpoint's task %r ignores (it decodes with "
                 "fairseq's own search): add task=%r (it decodes checkpoints of the stock "
                 "translation task too)"
                 % (", ".join("%s=%r" % (name, overrides[name]) for name in ours),
                    "is an option" if len(ours) == 1 else "are options", TASK, saved, TASK))
        return
    base = TASK_DATACLASS_REGISTRY.get(saved)
    if base is None or not issubclass(_our_config(), base):
        warn("task=%r cannot decode a checkpoint of task %r (it extends fairseq's translation "
             "task only): the checkpoint decodes with its own task%s"
             % (TASK, saved, ", which ignores %s" % ", ".join(ours) if ours else ""))
        return
    defaults = dataclasses.asdict(_our_config()())
    with open_dict(task):
        for name, value in defaults.items():
            if name not in task:
                task[name] = value
        task._name = TASK


def install():
    """Make fairseq's checkpoint reader adopt our task before it applies its overrides (it is
    the one caller of ``overwrite_args_by_name`` there)."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.overwrite_args_by_name
    if getattr(original, "_pardec", False):
        return

    def overwrite_args_by_name(cfg, overrides):
        adopt_task(cfg, overrides)
        return original(cfg, overrides)

    overwrite_args_by_name._pardec = True
    checkpoint_utils.overwrite_args_by_name = overwrite_args_by_name
