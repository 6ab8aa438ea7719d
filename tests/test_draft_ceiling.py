"""The draft ceiling's counts (benchmark/draft_ceiling.py): walks worked out by hand, and its
command line."""

import re

import torch

from cli_setup import assert_clean_error, run
from helpers import make_dictionary

from fairseq_pardec.benchmark.draft_ceiling import (RULES, SentenceDrafts, drafter_for, kept,
                                                     walk)


def ids(d, words):
    return [d.index(w) for w in words.split()] + [d.eos()]


def walked(d, source, output, rule, cap, cut_to_kept=False):
    drafts = SentenceDrafts(drafter_for(d, d), torch.tensor(source), d.eos())
    return walk(drafts, output, RULES[rule], cap, cut_to_kept)


def test_kept_is_the_agreeing_prefix():
    assert kept([5, 6, 7], [5, 6, 8, 7]) == 2
    assert kept([], [5]) == 0
    assert kept([5, 6], [5]) == 1


def test_a_copied_sentence_takes_one_iteration():
    d = make_dictionary()
    sentence = ids(d, "w1 w2 w3 w4 w5")
    for rule in RULES:
        # the first draft (after BOS) is the whole source, EOS included
        assert walked(d, sentence, sentence, rule, 16) == (1, 1 + 6)
        assert walked(d, sentence, sentence, rule, 16, cut_to_kept=True) == (1, 1 + 6)
        # at cap 4: 4 kept and the verifier's fifth token, then the last one and EOS
        assert walked(d, sentence, sentence, rule, 4) == (2, 2 + 4 + 1)


def test_an_edit_costs_an_iteration_and_the_rejected_positions():
    d = make_dictionary()
    source, output = ids(d, "w1 w2 w3 w4"), ids(d, "w1 w2 w9 w3 w4")
    # lookup: "w1 w2 w3 w4 EOS" keeps 2 (the verifier adds w9); w9 matches nothing (a plain
    # step gives w3); after w3 the source continues "w4 EOS", kept whole
    assert walked(d, source, output, "lookup", 16) == (3, 3 + 5 + 0 + 2)
    assert walked(d, source, output, "lookup", 16, cut_to_kept=True) == (3, 3 + 2 + 0 + 2)


def test_no_match_is_a_plain_step():
    d = make_dictionary()
    source, output = ids(d, "w1 w2 w3"), ids(d, "w5 w6 w7 w8")
    for rule in RULES:
        assert walked(d, source, output, rule, 8, cut_to_kept=True) == (5, 5)


def test_best_of_both_takes_the_draft_that_keeps_more():
    d = make_dictionary()
    # "w8 w8 w8" is not in the source: lookup drafts the output's own repetition, copy nothing.
    # After it, "w2" occurs twice in the source: copy takes the one where the source's order
    # expects it (w3 w4 EOS follow, all kept), lookup the first (w5 ..., rejected)
    source, output = ids(d, "w2 w5 w1 w2 w3 w4"), ids(d, "w8 w8 w8 w2 w3 w4")
    iterations = {rule: walked(d, source, output, rule, 8, cut_to_kept=True)[0]
                  for rule in RULES}
    assert iterations == {"copy": 5, "lookup": 5, "best of both": 4}


def test_command_line(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = run("fairseq_pardec.benchmark.draft_ceiling", data, "--path",
               stock_checkpoint / "checkpoint_last.pt", "--max-sentences", 9, "--caps", 2, 4,
               "--cpu")
    rows = re.findall(r"^\| (copy|lookup|best of both) \| (\w+) \| ([\d.]+) \| ([\d.]+) \|$",
                      proc.stdout, re.M)
    assert [(rule, cap) for rule, cap, _, _ in rows] == [
        (rule, cap) for cap in ("2", "4", "kept") for rule in ("copy", "lookup", "best of both")]
    tokens = int(re.search(r"^9 sentences, (\d+) greedy tokens", proc.stdout, re.M).group(1))
    for rule, cap, per_iteration, per_token in rows:
        assert float(per_iteration) >= 1.0
        if cap == "kept":
            # no rejected position is verified: one per token, and one after a sentence's
            # last draft where that draft ends it
            assert float(per_token) <= 1.0 + 9 / tokens + 1e-3


def test_bad_input_is_one_line(cli_data, stock_checkpoint):
    _, data = cli_data
    proc = run("fairseq_pardec.benchmark.draft_ceiling", data, "--path",
               stock_checkpoint / "checkpoint_last.pt", "--caps", 0, check=False)
    assert_clean_error(proc, "--caps must be >= 1")
    proc = run("fairseq_pardec.benchmark.draft_ceiling", data, "--path", data / "no-such.pt",
               check=False)
    assert_clean_error(proc, "checkpoint", "no-such.pt", "does not exist")
