"""What the server tests share: a server process on 127.0.0.1 (a real ``python -m
fairseq_pardec.serve`` on the tiny checkpoint of cli_setup.py), waited for with a bound, and
fairseq-interactive's greedy outputs of the same texts to compare with."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cli_setup import PLUGIN, run

READY = re.compile(r"fairseq-pardec-serve: ready at (http://127\.0\.0\.1:\d+/)")
START_TIMEOUT_S = 180


class ServerProcess:
    """``python -m fairseq_pardec.serve DATA --path CKPT --port 0 ...``; ``url`` once ready."""

    def __init__(self, data, ckpt, *extra, log_path):
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.log = open(log_path, "w+", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fairseq_pardec.serve", str(data), "--path", str(ckpt),
             "--host", "127.0.0.1", "--port", "0", *map(str, extra)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.url = self._wait_ready()

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = READY.search(self.output())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise AssertionError("the server exited (%s) before it was ready:\n%s"
                                     % (self.proc.returncode, self.output()[-3000:]))
            time.sleep(0.2)
        self.kill()
        raise AssertionError("the server was not ready within %d s:\n%s"
                             % (START_TIMEOUT_S, self.output()[-3000:]))

    def terminate(self, timeout=60) -> int:
        """SIGTERM, then its exit status (it drains first)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def source_texts(cli_data, count=None):
    root, _ = cli_data
    with open(root / "raw" / "test.src", encoding="utf-8") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    return lines[:count]


def interactive_greedy(data, ckpt, texts):
    """fairseq-interactive --generator greedy --batch-size 1: its D- line per text."""
    proc = run("fairseq_cli.interactive", data, "--user-dir", PLUGIN, "--path", ckpt,
               "--task", "translation_pardec", "--generator", "greedy", "--batch-size", 1,
               "--buffer-size", 1, input_text="\n".join(texts) + "\n")
    outputs = {int(m.group(1)): m.group(2)
               for m in re.finditer(r"^D-(\d+)\t\S+\t(.*)$", proc.stdout, re.M)}
    return [outputs[i] for i in range(len(texts))]


# the shared server: small limits, so that the tests reach each one with few texts; batch 2, so
# that a request of many texts keeps the server busy long enough to be seen
SERVED_ARGS = ("--generator", "auto", "--batch-size", 2, "--max-pending-rows", 64,
               "--max-texts", 48, "--max-request-bytes", 65536)


@pytest.fixture(scope="session")
def served(cli_data, stock_checkpoint, tmp_path_factory):
    _, data = cli_data
    server = ServerProcess(data, stock_checkpoint / "checkpoint_last.pt", *SERVED_ARGS,
                           log_path=tmp_path_factory.mktemp("served") / "server.log")
    yield server
    server.terminate()
