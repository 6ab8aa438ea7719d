"""fairseq_pardec: parallel decoding methods for fairseq seq2seq Transformers (--user-dir plugin)."""

import sys

from fairseq_pardec import compat  # noqa: F401  (first: safe checkpoint loading on torch >= 2.6)
from fairseq_pardec import argv, checkpoint_saving, cli_checks, results_file
from fairseq_pardec.errors import install_cli_boundary, running_a_cli

# What the command lines need changes process-wide state (the exception hook, the root
# logger's level): done for fairseq's (and our) command lines only, so importing the plugin
# leaves a library user's process as it was.
if running_a_cli():
    install_cli_boundary()  # fairseq's CLIs print our errors (and a few of fairseq's) as one line
    if argv.training(sys.argv):
        checkpoint_saving.install()  # a checkpoint that cannot be written: one line, no .tmp

from fairseq_pardec import criterions  # noqa: F401,E402
from fairseq_pardec import decoding  # noqa: F401,E402
from fairseq_pardec import models  # noqa: F401,E402
from fairseq_pardec import tasks  # noqa: F401,E402

from fairseq_pardec.tasks.translation_pardec import TranslationPardecConfig  # noqa: E402

cli_checks.check_argv(TranslationPardecConfig)  # our task's flags without its --task, ...
results_file.guard()  # fairseq-generate --results-path: the earlier file survives a failed run

if running_a_cli():
    compat.restore_log_level()  # after the imports above have imported fairseq

__version__ = "0.1.0"
