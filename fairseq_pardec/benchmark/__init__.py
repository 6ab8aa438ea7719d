"""Side-by-side decoding benchmark: ``python -m fairseq_pardec.benchmark DATA --path CKPT ...``.

``runner`` decodes the same sentences with every generator in one process (and CTranslate2 in a
process of its own, ``ctranslate2_baseline``), ``step_table`` times single decoder calls,
``report`` writes the table and the plot, ``specs`` checks the generator specs given.
``draft_ceiling`` counts, without timing, what copy and lookup drafts could keep on a model's
greedy outputs (``python -m fairseq_pardec.benchmark.draft_ceiling``).
"""

from fairseq_pardec.benchmark.runner import cli_main, divergence, load_model, main

__all__ = ["cli_main", "divergence", "load_model", "main"]
