"""The server's load benchmark against the shared test server (variant url): a few requests at
one rate, every output compared with fairseq-interactive's greedy one; the report's three files.
Nothing is timed: speed stays in the benchmark."""

import json

import pytest

pytest.importorskip("httpx")

from serve_setup import interactive_greedy, source_texts  # noqa: E402


def texts_and_greedy(cli_data, stock_checkpoint, folder, count):
    """``count`` test texts and fairseq-interactive's greedy outputs of them, as the files
    ``texts`` and ``greedy`` in ``folder``."""
    _, data = cli_data
    texts = source_texts(cli_data, count)
    (folder / "texts").write_text("\n".join(texts) + "\n", encoding="utf-8")
    greedy = interactive_greedy(data, stock_checkpoint / "checkpoint_last.pt", texts)
    (folder / "greedy").write_text("\n".join(greedy) + "\n", encoding="utf-8")


def test_load_benchmark_reports_every_output_equal_to_greedy(served, cli_data, stock_checkpoint, tmp_path):
    from fairseq_pardec.benchmark.serve import main

    texts_and_greedy(cli_data, stock_checkpoint, tmp_path, 8)
    out = tmp_path / "out"
    rows = main(["--input", str(tmp_path / "texts"), "--greedy", str(tmp_path / "greedy"),
                 "--variants", "url", "--url", served.url, "--rates", "20", "--requests", "12",
                 "--out-dir", str(out)])
    assert len(rows) == 1
    row = rows[0]
    assert row["answered"] == 12 and row["failed"] == 0
    assert row["identical_to_greedy"] == row["compared"] == 12
    assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
    report = json.loads((out / "serve.json").read_text())
    assert report["rows"][0]["variant"] == "url" and report["meta"]["seed"] == 1
    assert "| url | 20 |" in (out / "serve.md").read_text()
    assert (out / "serve_latency.png").read_bytes()[:4] == b"\x89PNG"


def test_the_soak_counts_every_answer_per_chunk(served, cli_data, stock_checkpoint, tmp_path):
    from fairseq_pardec.benchmark.serve import main, resident_mb

    texts_and_greedy(cli_data, stock_checkpoint, tmp_path, 4)
    out = tmp_path / "soak"
    chunks = main(["--input", str(tmp_path / "texts"), "--greedy", str(tmp_path / "greedy"),
                   "--variants", "url", "--url", served.url, "--rates", "20",
                   "--soak", "1.0", "--soak-chunk", "0.5", "--out-dir", str(out)])
    assert [c["chunk"] for c in chunks] == [0, 1]
    assert all(c["answered"] == c["requests"] == 10 and c["failed"] == 0 for c in chunks)
    assert all(c["identical_to_greedy"] == c["compared"] for c in chunks)
    assert "20 sent, 20 answered, 0 failed, 0 unlike greedy" in (out / "soak.md").read_text()
    assert json.loads((out / "soak.json").read_text())["meta"]["variant"] == "url"
    import os

    assert resident_mb(os.getpid()) > 1.0  # read from /proc on Linux


def test_a_soak_chunk_of_no_time_is_refused_naming_the_flag(tmp_path):
    from fairseq_pardec.benchmark.serve import main
    from fairseq_pardec.errors import UsageError

    with pytest.raises(UsageError, match="--soak-chunk"):
        main(["--input", str(tmp_path / "texts"), "--variants", "url", "--url",
              "http://127.0.0.1:1/", "--soak", "10", "--soak-chunk", "0"])


@pytest.mark.parametrize("flag", ["--input", "--greedy"])
def test_a_missing_text_file_is_one_line_naming_its_flag(tmp_path, flag):
    from fairseq_pardec.benchmark.serve import main
    from fairseq_pardec.errors import UsageError

    (tmp_path / "texts").write_text("a text\n", encoding="utf-8")
    files = {"--input": str(tmp_path / "texts"), "--greedy": str(tmp_path / "texts")}
    files[flag] = str(tmp_path / "missing")
    with pytest.raises(UsageError, match="^%s .*missing does not exist" % flag):
        main(["--input", files["--input"], "--greedy", files["--greedy"], "--variants", "url",
              "--url", "http://127.0.0.1:1/", "--out-dir", str(tmp_path / "out")])


def test_the_soak_reads_memory_through_each_chunk():
    """A chunk's memory is its end, its lowest and its highest reading: a server that returns
    freed memory now and then is not judged by one reading."""
    import os
    import time

    from fairseq_pardec.benchmark.serve import ResidentReadings, soak_markdown

    with ResidentReadings(os.getpid(), every_s=0.01) as memory:
        time.sleep(0.1)
    assert len(memory.readings) >= 2 and min(memory.readings) > 0
    with ResidentReadings(None) as nothing:  # no server process of ours: nothing read
        pass
    assert nothing.readings == []

    def chunk(k, end, low, high):
        return dict(chunk=k, requests=10, answered=10, failed=0, identical_to_greedy=10,
                    compared=10, throughput=9.5, p99_ms=120.0, rss_mb=end, rss_low_mb=low,
                    rss_high_mb=high)

    meta = dict(variant="join", rate=10, chunk_s=1.0, machine="m", commit="c", date="d")
    text = soak_markdown(meta, [chunk(0, 100.0, 90.0, 110.0), chunk(1, 120.0, 88.0, 110.0)])
    assert "| 1 | 10 | 10 | 0 | 10/10 | 9.5 | 120.0 | 120.0 | 88.0 | 110.0 |" in text
    assert "first chunk's end to the last's: 20.0%; the highest reading, first chunk to last: 0.0%" in text
