"""The benchmark's generator specs (``name:key=value,...``), checked before anything is loaded.

A spec names a generator of ``--generator`` (or ``ct2``) and options that are fields of
``--task translation_pardec`` or of fairseq's generation config. A misspelt name, an option that
neither knows, or a value of the wrong type is refused in one line naming the spec: otherwise it
surfaced as omegaconf's traceback after minutes of loading, or, for an unknown key, as a row
labelled with an option that never applied.
"""

import argparse
import os

from fairseq_pardec.errors import UsageError

# keys of the spec itself, not of a config: another checkpoint, the row's name
SPEC_KEYS = ("path", "label")

# fairseq's generation counts that must be >= 1 (0 ends in a traceback from deep inside torch)
_COUNTS = ("beam", "nbest")


def check_spec(spec, options):
    """UsageError for the first thing wrong with ``spec`` (its text), parsed into
    ``name`` and ``options`` (without ``label``)."""
    from dataclasses import fields

    from fairseq.dataclass.configs import GenerationConfig
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from fairseq_pardec.decoding.registry import GENERATORS, SPECS
    from fairseq_pardec.decoding.options import ARG_VALIDATORS
    from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig

    name = spec.partition(":")[0]
    check_files(spec, options)
    if name == "ct2":  # CTranslate2's own options, checked before anything is loaded
        from fairseq_pardec.benchmark.ctranslate2_baseline import check_options

        try:
            check_options({k: v for k, v in options.items() if k not in SPEC_KEYS})
        except UsageError as error:
            raise UsageError("--generators %s: %s" % (spec, error)) from None
        return
    if name not in GENERATORS:
        raise UsageError("--generators %s: no generator %r; choose from %s, ct2"
                         % (spec, name, ", ".join(GENERATORS)))
    task_keys = {f.name for f in fields(TranslationPardecConfig)} - {"data", "generator"}
    generation_keys = {f.name for f in fields(GenerationConfig)}
    config_options = {k: v for k, v in options.items() if k not in SPEC_KEYS}
    unknown = sorted(set(config_options) - task_keys - generation_keys)
    if unknown:
        raise UsageError("--generators %s: %s is not an option of --task translation_pardec nor of "
                         "fairseq's generation (beam, lenpen, max_len_a, ...); check the spelling"
                         % (spec, ", ".join(unknown)))
    for config, keys in ((TranslationPardecConfig, task_keys), (GenerationConfig, generation_keys)):
        given = {k: v for k, v in config_options.items() if k in keys}
        try:
            OmegaConf.merge(OmegaConf.structured(config), given)
        except OmegaConfBaseException as error:
            key = getattr(error, "key", None) or next(iter(given), "?")
            expected = getattr(getattr(config, "__dataclass_fields__", {}).get(key), "type", None)
            raise UsageError("--generators %s: %s=%r is not a valid value%s"
                             % (spec, key, given.get(key), " (expected %s)" % _type_name(expected)
                                if expected is not None else "")) from None
    for key in _COUNTS:
        if key in config_options and config_options[key] < 1:
            raise UsageError("--generators %s: %s must be >= 1 (got %s)"
                             % (spec, key, config_options[key]))
    beam = config_options.get("beam", 1)
    if SPECS[name].greedy_only and beam != 1:
        # a greedy-only generator decodes with beam 1 whatever the spec says: the row would
        # carry a beam it never used (the command line refuses a typed --beam alike)
        raise UsageError("--generators %s: %s decodes greedily (beam 1); drop beam=%s, or use "
                         "beam:beam=%s" % (spec, name, beam, beam))
    nbest = config_options.get("nbest", 1)
    if SPECS[name].greedy_only and nbest != 1:
        raise UsageError("--generators %s: %s returns one hypothesis; drop nbest=%s"
                         % (spec, name, nbest))
    for key, value in config_options.items():
        validate = ARG_VALIDATORS.get("--" + key.replace("_", "-"))
        if validate is not None:
            try:
                validate(str(value))
            except argparse.ArgumentTypeError as error:
                raise UsageError("--generators %s: %s %s" % (spec, key, error)) from None


def check_files(spec, options):
    """``path=`` (a checkpoint every spec that names one loads) and the task's file options
    (``draft_corpus=``, ``drafter_path=``): a directory, or a missing checkpoint, before minutes
    of loading."""
    from fairseq_pardec.input_files import FILE_FLAGS, file_problem

    given = {"path": ("checkpoint file", ".pt")}
    given.update((flag[2:].replace("-", "_"), kind) for flag, kind in FILE_FLAGS.items())
    for key, (what, suffix) in given.items():
        path = options.get(key)
        if not isinstance(path, str) or (key != "path" and not os.path.isdir(path)):
            continue
        problem = file_problem(path, key + "=", what, suffix)
        if problem:
            raise UsageError("--generators %s: %s" % (spec, problem))


def _type_name(kind):
    text = str(getattr(kind, "__name__", kind)) if isinstance(kind, type) else str(kind)
    for python, words in (("int", "an integer"), ("float", "a number"), ("str", "text"),
                          ("bool", "True or False")):
        if text in (python, "typing.Optional[%s]" % python, "Optional[%s]" % python):
            return words
    return text
