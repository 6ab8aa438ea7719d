"""The server's app as two replicas under a local Ray Serve (skipped where ray is not
installed): both replicas run, and their answers equal fairseq-interactive's greedy outputs.
127.0.0.1 only; every wait bounded."""

import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from serve_setup import interactive_greedy, source_texts  # noqa: E402


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_replicas_under_ray_serve(cli_data, stock_checkpoint):
    from fairseq_pardec.serve.replicas import ray_app

    _, data = cli_data
    ckpt = stock_checkpoint / "checkpoint_last.pt"
    texts = source_texts(cli_data, 12)
    expected = interactive_greedy(data, ckpt, texts)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app([str(data), "--path", str(ckpt), "--generator", "auto", "--cpu"],
                          replicas=2), route_prefix="/")
        status = serve.status().applications["default"].deployments["fairseq_pardec"]
        assert status.replica_states.get("RUNNING") == 2, status
        url = "http://127.0.0.1:%d/" % port
        deadline = time.monotonic() + 120
        while httpx.get(url + "ready", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the replicas were not ready in 120 s"
            time.sleep(0.5)
        outputs = [httpx.post(url + "translate", json={"text": t}, timeout=120).json()["outputs"][0]
                   for t in texts]
        assert outputs == expected
    finally:
        serve.shutdown()
        ray.shutdown()
