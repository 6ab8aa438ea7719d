"""Decoding: the generators behind ``--generator``.

* ``registry``: every ``--generator`` name and how it is built;
* ``options``: the fairseq generation options each generator reads or refuses;
* ``fairseq_baselines``: fairseq's own beam search and greedy search, counted;
* ``fairseq_rules``: fairseq's per-step rules (its edits of the log-probabilities, its choice of
  token at beam 1), which our generators follow;
* ``draft_verify``: the draft-and-verify engine (lean_greedy, iad, lookup, gad, blockwise): the
  loop, acceptance rules, speculative sampling, the margin guard, and ``drafters``;
* ``step``: the decoder step and its cache, behind one interface (fairseq's modules, the lean
  step in fairseq's order, the fast step), and the output projection;
* ``interleaved_beam``: IBDecoder's multi-word beam search;
* ``decode_stats``: what every generator counts (iterations, tokens, time).
"""

from fairseq_pardec.decoding.decode_stats import DecodeStats
from fairseq_pardec.decoding.registry import GENERATORS

__all__ = ["GENERATORS", "DecodeStats"]
