"""The word edits that turn a text into its output (GEC's corrections), for the page and for
``return_edits``: difflib's opcodes over whitespace-separated words."""

import difflib
from typing import List


def word_edits(source: str, output: str) -> List[dict]:
    """``[{"op": "equal"|"delete"|"insert"|"replace", "source": ..., "output": ...}, ...]``
    covering both texts in order; joining the ``source`` parts with spaces gives the source's
    words, the ``output`` parts its output's."""
    before, after = source.split(), output.split()
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    return [{"op": op, "source": " ".join(before[i1:i2]), "output": " ".join(after[j1:j2])}
            for op, i1, i2, j1, j2 in matcher.get_opcodes()]
