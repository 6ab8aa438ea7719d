"""Lookup drafting (--generator lookup): the n-gram table, the drafter's choices, and output
identical to fairseq greedy whatever is drafted."""

import pytest
import torch

from fairseq_pardec.decoding.draft_verify.drafters import DraftView

from fairseq_pardec.errors import UsageError
from fairseq_pardec.decoding.registry import DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable

from helpers import collate, make_dictionary, make_task, tiny_transformer
from test_engine_lossless import assert_same, random_setting
from test_speculative import SETTINGS, chi_square_pvalue, one_source, ours_counts

EOS, START = 2, 2


def table(sentences, order=4, vocab=100):
    return NgramTable(sentences, vocab, START, EOS, order)


# ------------------------------------------------------------------------------ the n-gram table
def test_most_frequent_continuation_of_the_longest_context():
    t = table([[10, 11, 12], [10, 11, 12], [20, 11, 13], [20, 11, 13], [30, 11, 13]])
    assert t.next_token([10, 11]) == 12  # the context (10, 11) was always followed by 12
    assert t.next_token([20, 11]) == 13
    assert t.next_token([99, 11]) == 13  # unknown (99, 11): backs off to (11,) -> 13 (3 of 5)
    assert t.next_token([START]) == 10  # sentence start: 10 twice, 20 twice, 30 once -> tie
    assert t.next_token([98, 99]) is None


def test_ties_go_to_the_smaller_id_whatever_the_corpus_order():
    a = table([[7, 40], [7, 30]])
    b = table([[7, 30], [7, 40]])
    assert a.next_token([7]) == b.next_token([7]) == 30


def test_contexts_do_not_cross_sentences():
    t = table([[5, 6], [7, 8]])
    # 6 ends its sentence: it is followed by EOS, never by the next sentence's start
    assert t.next_token([6]) == EOS
    # across sentences (6, EOS) would be followed by the next START: no such context exists,
    # so the lookup backs off to (EOS,) = START, followed by 5 or 7 (tie: 5)
    assert t.next_token([6, EOS]) == 5


def test_continuation_chains_and_stops_after_eos():
    t = table([[5, 6, 7, 8]])
    assert t.continuation([START, 5], 10) == [6, 7, 8, EOS]
    assert t.continuation([START, 5], 2) == [6, 7]
    assert t.continuation([99], 3) == []


def test_order_is_capped_to_what_packs_into_int64():
    assert table([[5, 6]], order=4, vocab=8184).order == 4  # 13 bits
    assert table([[5, 6]], order=6, vocab=8184).order == 4
    assert table([[5, 6]], order=4, vocab=250_000).order == 3  # 18 bits
    big = NgramTable([[200_000, 200_001, 200_002, 200_003]], 250_000, START, EOS, 4)
    assert big.next_token([200_000, 200_001, 200_002]) == 200_003


def test_from_file_reads_subword_text_and_refuses_bad_input(tmp_path, monkeypatch):
    d = make_dictionary(20)
    good = tmp_path / "corpus.txt"
    good.write_text("w1 w2 w3\n\nw1 w2 w4\nw1 w2 w3\n", encoding="utf-8")
    t = NgramTable.from_file(str(good), d)
    assert t.sentences == 3
    assert t.next_token([d.index("w1"), d.index("w2")]) == d.index("w3")
    with pytest.raises(UsageError, match="--draft-corpus .*no such file"):
        NgramTable.from_file(str(tmp_path / "missing.txt"), d)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    with pytest.raises(UsageError, match="has no sentences"):
        NgramTable.from_file(str(empty), d)
    capped = tmp_path / "long.txt"
    capped.write_text("w1 w2 w3\n" * 10, encoding="utf-8")
    monkeypatch.setattr(NgramTable, "MAX_TOKENS", 7)  # two sentences fit, not a third
    assert NgramTable.from_file(str(capped), d).sentences == 2
    monkeypatch.undo()
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("das ist kein Text im Wörterbuch w1\n", encoding="utf-8")
    with pytest.raises(UsageError, match="not in the target dictionary"):
        NgramTable.from_file(str(foreign), d)


# --------------------------------------------------------------------------- the drafter's choices
def drafts_after(drafter, sample, output, cap=8):
    """The draft proposed for row 0 after ``output`` (BOS excluded) was accepted."""
    state = drafter.start(sample, None, EOS)
    tokens = torch.tensor([[EOS] + output])
    return drafter.propose(state, DraftView([0], [len(output)], [cap], tokens))[0]


def test_drafts_from_the_source_then_the_output_then_the_table():
    d = make_dictionary(30)
    w = [d.index("w%d" % i) for i in range(30)]
    sample = collate(d, [torch.tensor([w[1], w[2], w[3], w[4], d.eos()])])
    corpus = table([[w[20], w[21], w[22]]], vocab=len(d))
    drafter = LookupDrafter(d, d, corpus)
    # the source: w2 is followed by w3 w4 EOS there
    assert drafts_after(drafter, sample, [w[9], w[2]]) == [w[3], w[4], d.eos()]
    # the output's own earlier occurrence: w9 w10 ... w9 -> w10 w11 w9 (up to the cap)
    assert drafts_after(drafter, sample, [w[9], w[10], w[11], w[9]], cap=3) == [w[10], w[11], w[9]]
    # neither: the table continues w20 with w21 w22 EOS
    assert drafts_after(drafter, sample, [w[20]]) == [w[21], w[22], d.eos()]
    # nothing anywhere: no draft (a plain greedy step)
    assert drafts_after(LookupDrafter(d, d), sample, [w[25]]) == []


def test_longer_local_match_wins():
    d = make_dictionary(30)
    w = [d.index("w%d" % i) for i in range(30)]
    # w5 occurs twice in the source; only the second is preceded by w7 as in the output
    sample = collate(d, [torch.tensor([w[5], w[1], w[7], w[5], w[8], d.eos()])])
    assert drafts_after(LookupDrafter(d, d), sample, [w[7], w[5]], cap=2) == [w[8], d.eos()]


# ------------------------------------------------------------------------------ lossless decoding
def lookup(model, src_dict, tgt_dict, corpus=None, block_size=None, **kwargs):
    """lookup whose drafts follow acceptance only (no CPU prices): on these random models the
    source's matches are rejected, and the prices would stop a sentence of 13 tokens from
    drafting before the table's continuations, which are under test, are tried."""
    drafter = LookupDrafter(src_dict, tgt_dict, corpus, block_size=block_size,
                            adaptive=block_size is None)
    drafter.CPU_PRICES = None
    return DraftVerifyGenerator([model], tgt_dict, drafter, ExactAcceptance(), **kwargs)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("corpus", ["none", "random", "outputs"])
def test_random_model_equals_greedy(batch_size, shared, corpus):
    src_dict, tgt_dict, model, sample, expected = random_setting(batch_size, shared)
    table_of = None
    if corpus == "random":
        g = torch.Generator().manual_seed(5)
        table_of = table([torch.randint(4, len(tgt_dict), (12,), generator=g).tolist()
                          for _ in range(40)], vocab=len(tgt_dict))
    elif corpus == "outputs":  # the verifier's own outputs: long drafts, mostly accepted
        table_of = table([h[0]["tokens"][:-1].tolist() for h in expected], vocab=len(tgt_dict))
    for block_size in (None, 5):
        generator = lookup(model, src_dict, tgt_dict, table_of, block_size,
                           max_len_a=1.2, max_len_b=10)
        got = generator.generate([model], sample)
        assert_same(sample, expected, got)
        if corpus == "outputs" and batch_size == 1:
            assert generator.stats.tokens_per_iteration > 2.0


@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[1]])
def test_sampling_with_lookup_drafts_samples_fairseqs_distribution(setting):
    from test_speculative import fairseq_counts, peaked

    d = make_dictionary(5)
    verifier = peaked(tiny_transformer(make_task(d), seed=31))
    sample = one_source(d, 16)
    reference = fairseq_counts(verifier, d, sample, 2000, *setting)
    corpus = table([[d.index("w1"), d.index("w2"), d.index("w3")]] * 3, vocab=len(d))
    drafter = LookupDrafter(d, d, corpus, adaptive=True)
    # the acceptance of drafts is under test: every draft the caps allow is made (at the CPU's
    # prices the 16 rows of this batch would draft nothing)
    drafter.CPU_PRICES = None
    counts, stats = ours_counts(verifier, d, drafter, sample, 2000, *setting)
    assert chi_square_pvalue(reference, counts) > 1e-3
    assert stats.tokens_per_iteration > 1.0


def test_generator_reads_its_task_options(tmp_path):
    """--generator lookup builds its table from --draft-corpus and takes GAD++'s relaxed rule
    from --gad-beta/--gad-tau (lossless by default)."""
    import argparse

    from fairseq_pardec.decoding.registry import GENERATORS

    d = make_dictionary(20)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3\n", encoding="utf-8")
    args = argparse.Namespace(beam=1, max_len_a=1.0, max_len_b=5)
    model = tiny_transformer(make_task(d))
    plain = GENERATORS["lookup"](make_task(d), [model], args)
    assert plain.drafter.table is None and plain.acceptance.lossless
    relaxed = GENERATORS["lookup"](make_task(d, draft_corpus=str(corpus), gad_beta=3, gad_tau=1.0),
                                   [model], args)
    assert relaxed.drafter.table.sentences == 1 and not relaxed.acceptance.lossless
