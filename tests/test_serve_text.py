"""The server's text out is fairseq-interactive's (``utils.post_process_prediction``), and
leaves the target dictionary as the model has it."""

import copy

import pytest
from fairseq import utils

from serve_setup import source_texts


@pytest.mark.parametrize("remove_bpe", ["sentencepiece", "subword_nmt"])
def test_outputs_are_interactives_text_and_add_no_word_to_the_dictionary(
        cli_data, stock_checkpoint, remove_bpe):
    from fairseq_pardec.serve.model import LoadedModel
    from fairseq_pardec.serve.options import parse_args

    _, data = cli_data
    model = LoadedModel(parse_args([str(data), "--path",
                                    str(stock_checkpoint / "checkpoint_last.pt"), "-s", "src",
                                    "-t", "tgt", "--generator", "greedy", "--cpu",
                                    "--remove-bpe", remove_bpe]))
    words = len(model.tgt_dict)
    theirs = copy.deepcopy(model.tgt_dict)  # what fairseq's own post-processing may grow
    sources = [model.encode(text) for text in source_texts(cli_data, 6)]
    sample = model.batch(sources)
    hypotheses = model.decode(sample)
    for position, hypos in zip(sample["id"].tolist(), hypotheses):
        best = hypos[0]
        _, expected, _ = utils.post_process_prediction(
            hypo_tokens=best["tokens"].int().cpu(), src_str="", alignment=None,
            align_dict=None, tgt_dict=theirs, remove_bpe=remove_bpe,
            extra_symbols_to_ignore=model.strip)
        assert model.output(sources[position], best).text == expected
    assert len(model.tgt_dict) == words
    # the sentencepiece removal joins a hypothesis's tokens into words the dictionary lacks:
    # fairseq's post-processing added them to its copy
    if remove_bpe == "sentencepiece":
        assert len(theirs) > words
