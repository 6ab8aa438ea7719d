"""fairseq-interactive's input lines that are longer than the model takes: refused one by one.

fairseq-interactive reads ``--buffer-size`` lines at a time and numbers the sentences of each
buffer from 0, so fairseq's "Size of sample #0 is invalid" named the wrong line, and the run
stopped there: the lines after a long one were never decoded. Here each long line is told in one
warning that gives its line number in the input, it is left out of its buffer's batches, and the
rest of the input is decoded (fairseq-interactive's S-/H- ids are the input's line numbers from
0, so the lines after it keep theirs). ``--truncate-source`` cuts such lines instead.
"""

import sys

import numpy as np

from fairseq_pardec.argv import program
from fairseq_pardec.errors import warn
from fairseq_pardec.failures import interactive_input_name


def _source_limit(max_positions):
    if max_positions is None:
        return None
    if isinstance(max_positions, (tuple, list)):
        return max_positions[0]
    return max_positions


def skip_long_lines(task, dataset, max_positions, argv=None):
    """Leave the sentences of ``dataset`` whose source is longer than ``max_positions`` allows
    out of its batches, one warning each, where ``dataset`` is a buffer of fairseq-interactive's
    input lines; anything else is left as it is.

    Called by the task's ``get_batch_iterator`` with the dataset and its ``max_positions``:
    fairseq-interactive builds one dataset per buffer and asks for its batches once, so the
    lines counted so far (kept on ``task``) give each buffer's first line number.
    """
    argv = sys.argv if argv is None else argv
    if program(argv) != "interactive" or any(dataset is d for d in task.datasets.values()):
        return
    first = getattr(task, "_interactive_lines_read", 0)
    task._interactive_lines_read = first + len(dataset)
    limit = _source_limit(max_positions)
    if limit is None:
        return
    long_ones = [int(i) for i in np.flatnonzero(np.asarray(dataset.src_sizes) > limit)]
    if not long_ones:
        return
    where = interactive_input_name(argv)
    for i in long_ones:
        line = first + i  # fairseq-interactive's id of the line (S-/H- lines): from 0
        warn("%s line %d has %d source tokens (EOS included), more than the %d the model takes "
             "(--max-source-positions): skipped, no H-%d; cut long lines with --truncate-source"
             % (where, line + 1, int(dataset.src_sizes[i]), limit, line))
    refused = np.asarray(long_ones, dtype=np.int64)
    ordered_indices = dataset.ordered_indices

    def without_long_lines():
        indices = ordered_indices()
        return indices[~np.isin(indices, refused)]

    # a dataset of one buffer, asked for its batches once: nothing to undo
    dataset.ordered_indices = without_long_lines
