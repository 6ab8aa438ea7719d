"""A server measures its margins before it says it is ready, where DATA holds text to measure
them on: its first requests then wait for no measurement (step/calibration.py)."""

import shutil

from fairseq_pardec.decoding.step import calibration


def _loaded(data, checkpoint):
    from fairseq_pardec.serve.model import LoadedModel
    from fairseq_pardec.serve.options import parse_args

    return LoadedModel(parse_args([str(data), "--path", str(checkpoint), "-s", "src", "-t",
                                   "tgt", "--generator", "lookup", "--cpu"]))


def _rows_measured(model) -> int:
    return max(measured.rows for measured in model.models[0].__dict__["_pardec_margins"].values())


def test_the_margins_are_measured_on_datas_valid_split_at_start(cli_data, stock_checkpoint):
    _, data = cli_data
    model = _loaded(data, stock_checkpoint / "checkpoint_last.pt")
    assert model.margin_rows == calibration.ROWS  # the valid split has 30 sentences
    assert _rows_measured(model) == calibration.ROWS


def test_without_a_binarized_split_the_first_requests_measure(cli_data, stock_checkpoint,
                                                              tmp_path, caplog):
    _, data = cli_data
    dictionaries = tmp_path / "dicts"
    dictionaries.mkdir()
    for side in ("src", "tgt"):
        shutil.copy(data / ("dict.%s.txt" % side), dictionaries)
    with caplog.at_level("INFO", logger="fairseq_pardec.serve"):
        model = _loaded(dictionaries, stock_checkpoint / "checkpoint_last.pt")
    assert model.margin_rows == 0
    assert "measured on the first requests" in caplog.text
    # the warm-up's one synthetic sentence only
    assert _rows_measured(model) < calibration.ROWS
