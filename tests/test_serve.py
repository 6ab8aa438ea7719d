"""fairseq-pardec-serve through real HTTP on 127.0.0.1, on the tiny checkpoint: outputs equal to
fairseq-interactive's greedy ones under concurrent requests, each limit's status and message, a
client that goes away, /metrics. Every wait is bounded; nothing is timed."""

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cli_setup import assert_clean_error, run  # noqa: E402
from serve_setup import SERVED_ARGS, ServerProcess, interactive_greedy, source_texts  # noqa: E402

TIMEOUT = httpx.Timeout(120.0)


def metrics(url):
    text = httpx.get(url + "metrics", timeout=TIMEOUT).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{%s}" % ",".join("%s=%s" % kv for kv in sorted(sample.labels.items()))
                                 if sample.labels else "")
            values[key] = sample.value
    return values


def wait_for(condition, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("not reached within %.0f s" % timeout)


def idle(url):
    values = metrics(url)
    return values["pardec_queue_rows"] == 0 and values["pardec_running_rows"] == 0


def post(url, body, **kwargs):
    return httpx.post(url + "translate", json=body, timeout=TIMEOUT, **kwargs)


def test_outputs_equal_offline_greedy_under_concurrent_requests(served, cli_data, stock_checkpoint):
    _, data = cli_data
    texts = source_texts(cli_data)
    expected = interactive_greedy(data, stock_checkpoint / "checkpoint_last.pt", texts)

    async def send_all():
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT) as client:
            singles = [client.post("translate", json={"text": t}) for t in texts]
            # and lists: in order, whoever shares their batches (52 texts in all, under the
            # server's --max-pending-rows 64)
            lists = [client.post("translate", json={"text": texts[i::5]}) for i in range(2)]
            return await asyncio.gather(*singles, *lists)

    answers = asyncio.run(send_all())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    singles, lists = answers[:len(texts)], answers[len(texts):]
    assert [a.json()["outputs"] == [e] for a, e in zip(singles, expected)] == [True] * len(texts)
    for i, answer in enumerate(lists):
        assert answer.json()["outputs"] == expected[i::5]


def test_what_a_request_can_ask_for(served, cli_data):
    text = source_texts(cli_data, 1)[0]
    answer = post(served.url, {"text": text, "return_tokens": True, "return_score": True,
                               "return_timing": True, "return_edits": True}).json()
    output = answer["outputs"][0]
    assert answer["tokens"][0] == output.split()  # no BPE here: the tokens are the words
    assert len(answer["positional_scores"][0]) == len(answer["tokens"][0]) + 1  # and EOS
    assert isinstance(answer["scores"][0], float)
    assert set(answer["timing"]) == {"queue_ms", "decode_ms", "total_ms"}
    edits = answer["edits"][0]
    assert " ".join(e["output"] for e in edits if e["output"]) == " ".join(output.split())
    assert " ".join(e["source"] for e in edits if e["source"]) == " ".join(text.split())


@pytest.mark.parametrize("body, needle", [
    ({"text": ""}, "text is empty"),
    ({"text": ["a", "  "]}, "text[1] is empty"),
    ({"text": []}, "an empty list"),
    ({"text": 5}, "text must be a string or a list of strings"),
    ({}, "text must be a string or a list of strings"),
    ({"text": "a", "beam": 5}, "beam: Extra inputs are not permitted"),
    ({"text": "a", "timeout_ms": 0}, "timeout_ms"),
])
def test_malformed_input_is_400(served, body, needle):
    answer = post(served.url, body)
    assert answer.status_code == 400
    assert needle in answer.json()["error"]["message"]


def test_a_body_that_is_not_json_is_400(served):
    answer = httpx.post(served.url + "translate", content=b"{not json", timeout=TIMEOUT)
    assert answer.status_code == 400
    assert "not JSON" in answer.json()["error"]["message"]


def test_too_many_texts_is_413_naming_the_flag(served):
    answer = post(served.url, {"text": ["a"] * 49})
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["flag"] == "--max-texts" and error["limit"] == 48
    assert "49 texts" in error["message"]


def test_a_large_body_is_413_naming_the_flag(served):
    answer = post(served.url, {"text": "x" * 70000})
    assert answer.status_code == 413
    assert answer.json()["error"]["flag"] == "--max-request-bytes"


def test_a_text_longer_than_the_model_takes_is_413_naming_the_flag(served):
    answer = post(served.url, {"text": ["a b", "w " * 1100]})
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["flag"] == "--max-source-positions" and error["limit"] == 1024
    assert "text[1] has 1101 source tokens" in error["message"]
    assert "--truncate-source" in error["message"]


def test_a_full_queue_is_503_with_retry_after(served, cli_data):
    """A request of 48 long texts holds the server (batch 2); another of 48 then exceeds
    --max-pending-rows 64 while more than 16 of the first are still pending (a second of 20
    left a window of two rounds, which a fast machine closed before it arrived). Tried up to
    three times, in case the first finished too soon."""
    texts = (source_texts(cli_data) * 2)[:48]
    for _ in range(3):
        wait_for(lambda: idle(served.url))
        holder = {}
        thread = threading.Thread(target=lambda: holder.setdefault("answer", post(served.url, {"text": texts})))
        thread.start()
        try:
            wait_for(lambda: metrics(served.url)["pardec_queue_rows"] > 0, timeout=30, every=0.01)
            refused = post(served.url, {"text": texts})
        except AssertionError:
            refused = None  # the holder finished before it was seen: try again
        thread.join(120)
        assert holder["answer"].status_code == 200  # the holder loses nothing
        if refused is not None and refused.status_code == 503:
            break
    assert refused is not None and refused.status_code == 503, refused and refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["flag"] == "--max-pending-rows"
    assert "64" in error["message"]


def test_past_its_deadline_a_request_is_504_and_its_rows_leave(served, cli_data):
    wait_for(lambda: idle(served.url))
    before = metrics(served.url)["pardec_rows_cancelled_total"]
    answer = post(served.url, {"text": source_texts(cli_data)[:40], "timeout_ms": 50})
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["flag"] == "timeout_ms" and "0.05 s" in error["message"]
    wait_for(lambda: idle(served.url))
    assert metrics(served.url)["pardec_rows_cancelled_total"] > before
    # and the server goes on as before
    assert post(served.url, {"text": "a b"}).status_code == 200


def test_a_client_that_goes_away_takes_its_rows_with_it(served, cli_data):
    wait_for(lambda: idle(served.url))
    before = metrics(served.url)
    body = json.dumps({"text": source_texts(cli_data)[:40]}).encode("utf-8")
    where = urlsplit(served.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: metrics(served.url)["pardec_queue_rows"] > 0, timeout=30, every=0.01)
    # the socket is closed: the request's waiting rows are dropped and it is logged as 499
    after = wait_for(lambda: (lambda m: m if m.get('pardec_requests_total{status=499}', 0) >
                              before.get('pardec_requests_total{status=499}', 0) else None)(metrics(served.url)))
    wait_for(lambda: idle(served.url))
    after = metrics(served.url)
    assert after["pardec_rows_cancelled_total"] > before["pardec_rows_cancelled_total"]
    decoded = after["pardec_rows_decoded_total"] - before["pardec_rows_decoded_total"]
    assert decoded < 40  # not all of them: the rest left with the client
    assert post(served.url, {"text": "a b"}).status_code == 200


def test_metrics_parse_and_name_what_the_issue_asks_for(served):
    post(served.url, {"text": "a b"})
    values = metrics(served.url)
    for name in ("pardec_queue_rows", "pardec_running_rows", "pardec_tokens_per_iteration",
                 "pardec_tokens_per_second", "pardec_tokens_total", "pardec_decoder_calls_total",
                 "pardec_request_latency_seconds_count", "pardec_rows_cancelled_total"):
        assert name in values, name
    assert values["pardec_request_latency_seconds_count"] >= 1
    assert values["pardec_tokens_per_iteration"] >= 1.0


def test_health_ready_and_the_page(served):
    assert httpx.get(served.url + "health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert httpx.get(served.url + "ready", timeout=TIMEOUT).json() == {"status": "ready"}
    page = httpx.get(served.url, timeout=TIMEOUT)
    assert page.status_code == 200 and 'id="input"' in page.text
    assert 'id="edits" checked' in page.text  # one shared vocabulary: edits shown


def test_sigterm_drains_answers_every_accepted_request_and_exits_0(cli_data, stock_checkpoint, tmp_path):
    _, data = cli_data
    # enough rows that the tiny model at batch 1 is still decoding when all three requests are
    # in: waiting for a queue snapshot instead raced the decoder on a fast machine
    per_request = 40
    texts = (source_texts(cli_data) * per_request)[:3 * per_request]
    server = ServerProcess(data, stock_checkpoint / "checkpoint_last.pt", "--generator", "auto",
                           "--batch-size", 1, log_path=tmp_path / "server.log")
    try:
        answers = [None] * 3

        def send(i):
            answers[i] = post(server.url, {"text": texts[per_request * i: per_request * (i + 1)]})

        def all_accepted_and_some_waiting():
            values = metrics(server.url)
            held = values["pardec_queue_rows"] + values["pardec_running_rows"]
            accepted = held + values["pardec_rows_decoded_total"]
            return accepted == len(texts) and values["pardec_queue_rows"] > 0

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        wait_for(all_accepted_and_some_waiting, timeout=30, every=0.01)
        server.proc.send_signal(__import__("signal").SIGTERM)
        # draining: new requests and /ready get 503, the listening socket still answers
        refused = post(server.url, {"text": "a b"})
        not_ready = httpx.get(server.url + "ready", timeout=TIMEOUT)
        for thread in threads:
            thread.join(120)
        status = server.proc.wait(120)
    finally:
        server.kill()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "1"
    assert not_ready.status_code == 503
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [len(a.json()["outputs"]) for a in answers] == [per_request] * 3
    assert status == 0, server.output()[-2000:]


@pytest.mark.parametrize("flags, needle", [
    (["--max-texts", 10, "--max-pending-rows", 5], "--max-texts 10 is more than --max-pending-rows 5"),
    (["--batch-size", 0], "--batch-size"),
    (["--request-timeout", 0], "--request-timeout must be > 0"),
    (["--prepare-rows", -1], "--prepare-rows must be >= 0"),
])
def test_bad_options_are_one_line(cli_data, stock_checkpoint, flags, needle):
    _, data = cli_data
    proc = run("fairseq_pardec.serve", data, "--path", stock_checkpoint / "checkpoint_last.pt",
               "--port", 0, *flags, check=False)
    assert_clean_error(proc, needle)


def test_a_port_in_use_is_one_line(cli_data, stock_checkpoint):
    _, data = cli_data
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = run("fairseq_pardec.serve", data, "--path", stock_checkpoint / "checkpoint_last.pt",
                   "--port", taken.getsockname()[1], check=False)
    assert_clean_error(proc, "cannot listen on 127.0.0.1", "give another --port")
