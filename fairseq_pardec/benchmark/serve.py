"""The server under load: ``python -m fairseq_pardec.benchmark.serve --input TEXTS
[--variants join buffer hub] [--rates ...] DATA --path CKPT [the server's options]``.

Open-loop Poisson arrivals (a fixed seed) at each rate of a sweep, one text a request, against
each variant in turn, alone on the machine:

* ``join``: fairseq-pardec-serve as it is (rows join the running batch at its next iteration);
* ``join-each``: the same with ``--prepare-rows 0`` (each waiting text encoded as it joins);
* ``rounds``: the same server with rows joining between rounds (``--batching rounds``);
* ``buffer``: the same server batching per request (``--batching buffer``: up to --batch-size
  rows or --buffer-ms, then that batch to its end), as TorchServe and CTranslate2's buffer do;
* ``ct2``: CTranslate2 float32 behind the same front, batching per request as ``buffer`` does
  (benchmark/ct2_server.py; needs ctranslate2);
* ``hub``: fairseq's hub, one request at a time (benchmark/hub_server.py);
* ``url``: a server already running at ``--url`` (nothing started).

A request's latency runs from its scheduled send time, so a server that falls behind cannot hide
its queue in the client. Per rate: p50, p95 and p99 latency and the achieved throughput (answers
per second from the first scheduled send to the last answer). Every output is compared with
fairseq greedy's (``--greedy FILE``, one line per text, or fairseq-interactive ``--generator
greedy --batch-size 1`` on the same options). Writes ``serve.md``, ``serve.json`` and
``serve_latency.png`` to ``--out-dir``.

``--soak SECONDS`` runs the first variant at the first rate for that long instead, in chunks, and
reads the server's resident memory every second: lost (failed) and wrong answers, and per chunk
the memory at its end, its lowest and its highest, over a long run (``soak.md``, ``soak.json``).

The options this command does not know are the server's (fairseq-interactive's and
fairseq-pardec-serve's): each variant's server gets them.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

from fairseq_pardec.errors import UsageError, exit_in_one_line
from fairseq_pardec.input_files import text_lines

PLUGIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = re.compile(r"fairseq-pardec-serve: ready at (http://\S+/)")
VARIANTS = ("join", "join-each", "rounds", "buffer", "ct2", "hub", "url")
START_TIMEOUT_S = 600


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_pardec.benchmark.serve",
        description=__doc__.split("\n\n")[0],
        epilog="Other options go to each variant's server (DATA, --path, --bpe, --generator, ...).")
    parser.add_argument("--input", required=True, help="texts, one a line (raw, as users send them)")
    parser.add_argument("--max-sentences", type=int, default=None, help="the first N texts only")
    parser.add_argument("--greedy", default=None,
                        help="fairseq greedy's output of each text, one a line (default: computed "
                        "with fairseq-interactive --generator greedy --batch-size 1)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["join", "buffer", "hub"])
    parser.add_argument("--url", default=None, help="the running server of variant url")
    parser.add_argument("--rates", nargs="+", type=float, default=[5, 10, 20, 40],
                        help="requests per second, swept in order")
    parser.add_argument("--requests", type=int, default=200, help="requests sent at each rate")
    parser.add_argument("--seed", type=int, default=1, help="arrival times and text order")
    parser.add_argument("--buffer-ms", type=float, default=10.0,
                        help="variant buffer: --batch-wait-ms of its server")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the servers")
    parser.add_argument("--out-dir", default="benchmark-out/serve")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                        help="instead of the sweep: the first variant at the first --rates value "
                        "for SECONDS, in chunks of --soak-chunk seconds, with the server's "
                        "resident memory after each (writes soak.md and soak.json)")
    parser.add_argument("--soak-chunk", type=float, default=30.0, metavar="SECONDS")
    return parser


def resident_mb(pid: int) -> Optional[float]:
    """The process's resident memory (VmRSS) in MiB, or None where /proc does not say."""
    try:
        with open("/proc/%d/status" % pid, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class ResidentReadings:
    """The resident memory of process ``pid`` read every ``every_s`` seconds on a thread of its
    own while the ``with`` block runs: a server that returns freed memory now and then is
    caught high or low by one reading at a chunk's end."""

    def __init__(self, pid: Optional[int], every_s: float = 1.0):
        self.pid, self.every_s = pid, every_s
        self.readings: List[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="rss-readings", daemon=True)

    def _read(self):
        while True:
            reading = resident_mb(self.pid)
            if reading is not None:
                self.readings.append(reading)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self):
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.pid is not None:
            self._stop.set()
            self._thread.join()


def soak(server, url, texts, greedy, options):
    """The server at one rate for ``options.soak`` seconds, chunk by chunk: per chunk the
    answers, failures, outputs unlike greedy's, p99 and the server's resident memory (at the
    chunk's end, its lowest and its highest reading)."""
    rate, chunks = options.rates[0], []
    count = max(1, int(round(options.soak / options.soak_chunk)))
    per_chunk = argparse.Namespace(**dict(vars(options),
                                          requests=max(1, int(rate * options.soak_chunk))))
    for k in range(count):
        per_chunk.seed = "%s|soak%d" % (options.seed, k)
        with ResidentReadings(server.proc.pid if server else None) as memory:
            row = measure(url, rate, texts, greedy, per_chunk)
        row.update(chunk=k, rss_mb=resident_mb(server.proc.pid) if server else None,
                   rss_low_mb=min(memory.readings, default=None),
                   rss_high_mb=max(memory.readings, default=None))
        print("soak chunk %d: %.1f req/s, p99 %s ms, %d failed, %d/%d = greedy, RSS %s MiB"
              % (k, row["throughput"], row["p99_ms"] and round(row["p99_ms"], 1), row["failed"],
                 row["identical_to_greedy"], row["compared"],
                 row["rss_mb"] and round(row["rss_mb"], 1)), file=sys.stderr, flush=True)
        chunks.append(row)
    return chunks


def soak_markdown(meta, chunks):
    sent = sum(c["requests"] for c in chunks)
    answered = sum(c["answered"] for c in chunks)
    wrong = sum(c["compared"] - c["identical_to_greedy"] for c in chunks)
    first, last = chunks[0]["rss_mb"], chunks[-1]["rss_mb"]
    first_high, last_high = chunks[0].get("rss_high_mb"), chunks[-1].get("rss_high_mb")
    lines = ["# Soak: %s at %g req/s for %d chunks of %g s" % (meta["variant"], meta["rate"],
                                                              len(chunks), meta["chunk_s"]),
             "", "machine: %s; commit %s; %s" % (meta["machine"], meta["commit"], meta["date"]),
             "", "| chunk | sent | answered | failed | = greedy | throughput | p99 ms | RSS MiB "
             "at end | lowest | highest |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def mib(value) -> str:
        return "-" if value is None else "%.1f" % value

    def growth(before, after) -> str:
        return ("%.1f%%" % (100.0 * (after - before) / before)) if before and after else "not read"

    for c in chunks:
        lines.append("| %d | %d | %d | %d | %d/%d | %.1f | %s | %s | %s | %s |" % (
            c["chunk"], c["requests"], c["answered"], c["failed"], c["identical_to_greedy"],
            c["compared"], c["throughput"], c["p99_ms"] and "%.1f" % c["p99_ms"],
            mib(c["rss_mb"]), mib(c.get("rss_low_mb")), mib(c.get("rss_high_mb"))))
    lines += ["", "%d sent, %d answered, %d failed, %d unlike greedy; resident memory from the "
              "first chunk's end to the last's: %s; the highest reading, first chunk to last: %s"
              % (sent, answered, sent - answered, wrong, growth(first, last),
                 growth(first_high, last_high)), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- servers
class StartedServer:
    """A server process of one variant, stopped with SIGTERM (the server drains)."""

    def __init__(self, module, server_args, extra, threads, log_path):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.log_path = log_path
        self.log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", module, *server_args, *extra,
                                      "--port", "0"], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        self.url = self._wait_ready()

    def _wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(self.log_path, encoding="utf-8") as f:
                found = READY.search(f.read())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log_path, encoding="utf-8") as f:
                    raise UsageError("the server exited (%s) before it was ready: %s"
                                     % (self.proc.returncode, f.read()[-1500:]))
            time.sleep(0.2)
        self.stop()
        raise UsageError("the server was not ready within %d s (%s)" % (START_TIMEOUT_S, self.log_path))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def start(variant, server_args, options, log_dir):
    log = os.path.join(log_dir, "server-%s.log" % variant)
    if variant in ("join", "rounds"):
        return StartedServer("fairseq_pardec.serve", server_args, ["--batching", variant],
                             options.threads, log)
    if variant == "join-each":
        return StartedServer("fairseq_pardec.serve", server_args,
                             ["--batching", "join", "--prepare-rows", "0"], options.threads, log)
    if variant == "buffer":
        return StartedServer("fairseq_pardec.serve", server_args,
                             ["--batching", "buffer", "--batch-wait-ms", str(options.buffer_ms)],
                             options.threads, log)
    if variant == "ct2":
        return StartedServer("fairseq_pardec.benchmark.ct2_server", server_args,
                             ["--batch-wait-ms", str(options.buffer_ms),
                              "--ct2-cache", os.path.join(log_dir, "ct2-cache")],
                             options.threads, log)
    if variant == "hub":
        return StartedServer("fairseq_pardec.benchmark.hub_server", server_args, [],
                             options.threads, log)
    raise ValueError(variant)


# ---------------------------------------------------------------------- greedy reference
def greedy_outputs(texts, server_args, threads):
    """fairseq-interactive's D- line of each text, greedy at batch 1, on the server's options."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.interactive", *server_args, "--user-dir", PLUGIN,
         "--task", "translation_pardec",
         "--generator", "greedy", "--beam", "1", "--batch-size", "1", "--buffer-size", "1"],
        input="\n".join(texts) + "\n", capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise UsageError("fairseq-interactive failed computing the greedy outputs: %s"
                         % proc.stderr.strip().splitlines()[-1:])
    found = {int(m.group(1)): m.group(2)
             for m in re.finditer(r"^D-(\d+)\t\S+\t(.*)$", proc.stdout, re.M)}
    return [found.get(i) for i in range(len(texts))]


# ---------------------------------------------------------------------- load
def schedule(rate, count, texts, seed):
    """(send time from the start, text index) of ``count`` Poisson arrivals at ``rate``/s."""
    rng = random.Random("%s|%s" % (seed, rate))
    at, plan = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        plan.append((at, rng.randrange(len(texts))))
    return plan


async def _load(url, plan, texts, timeout):
    import httpx

    limits = httpx.Limits(max_connections=len(plan), max_keepalive_connections=len(plan))
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05

        async def one(at, index):
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            try:
                answer = await client.post("translate", json={"text": texts[index]})
                status = answer.status_code
                output = answer.json()["outputs"][0] if status == 200 else None
            except Exception as error:  # a refused or timed-out request counts as failed
                status, output = type(error).__name__, None
            return {"index": index, "status": status, "output": output,
                    "latency": loop.time() - (start + at), "done": loop.time() - start}

        return await asyncio.gather(*(one(at, index) for at, index in plan))


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure(url, rate, texts, greedy, options):
    plan = schedule(rate, options.requests, texts, options.seed)
    results = asyncio.run(_load(url, plan, texts, options.timeout))
    ok = [r for r in results if r["status"] == 200]
    latencies = [1000 * r["latency"] for r in ok]
    span = max((r["done"] for r in results), default=0.0)
    compared = [r for r in ok if greedy[r["index"]] is not None]
    return {
        "rate": rate, "requests": len(results), "answered": len(ok),
        "failed": len(results) - len(ok),
        "throughput": len(ok) / span if span > 0 else 0.0,
        "p50_ms": percentile(latencies, 50), "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        "identical_to_greedy": sum(r["output"] == greedy[r["index"]] for r in compared),
        "compared": len(compared),
    }


# ---------------------------------------------------------------------- report
def markdown(meta, rows):
    lines = [
        "Machine: %s. Commit %s, %s. %d texts of `%s`, %d requests per rate (one text each), "
        "Poisson arrivals, seed %d; latency from each request's scheduled send time; "
        "*throughput*: answers per second from the first send to the last answer; *= greedy*: "
        "outputs identical to fairseq-interactive's greedy output of that text alone. Server: `%s`."
        % (meta["machine"], meta["commit"], meta["date"], meta["texts"], meta["input"],
           meta["requests"], meta["seed"], " ".join(meta["server_args"])),
        "",
        "| variant | rate (req/s) | throughput (req/s) | p50 ms | p95 ms | p99 ms | failed | = greedy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v: "" if v is None else "%.1f" % v
    for row in rows:
        lines.append("| %s | %g | %.1f | %s | %s | %s | %d | %d/%d |" % (
            row["variant"], row["rate"], row["throughput"], fmt(row["p50_ms"]),
            fmt(row["p95_ms"]), fmt(row["p99_ms"]), row["failed"], row["identical_to_greedy"],
            row["compared"]))
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font search, line by line
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = [(r["throughput"], r["p99_ms"]) for r in rows
                  if r["variant"] == variant and r["p99_ms"] is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("p99 latency (ms, from scheduled send)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _commit():
    try:
        return subprocess.run(["git", "-C", PLUGIN, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _machine():
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    return "%s, %d cores" % (model or platform.machine(), os.cpu_count() or 0)


def main(argv=None):
    options, server_args = build_parser().parse_known_args(argv)
    if "url" in options.variants and not options.url:
        raise UsageError("--variants url needs --url (the running server's address)")
    if not server_args and set(options.variants) - {"url"}:
        raise UsageError("give the server's options (DATA --path CKPT ...) after the benchmark's")
    if options.requests < 1 or any(rate <= 0 for rate in options.rates):
        raise UsageError("--requests must be >= 1 and every --rates value > 0")
    if options.soak < 0 or options.soak_chunk <= 0:
        raise UsageError("--soak must be >= 0 seconds and --soak-chunk > 0 seconds")
    texts = [line for line in text_lines(options.input, "--input")
             if line.strip()][:options.max_sentences]
    os.makedirs(options.out_dir, exist_ok=True)
    if options.greedy:
        greedy = text_lines(options.greedy, "--greedy")[:len(texts)]
        # texts past the file's end are answered and timed, and counted as not compared
        greedy += [None] * (len(texts) - len(greedy))
    else:
        greedy = greedy_outputs(texts, server_args, options.threads)
        # for the next run on these texts (--greedy), which then skips the slow batch-1 decode
        with open(os.path.join(options.out_dir, "greedy.txt"), "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in greedy))
    if options.soak > 0:
        return run_soak(options, server_args, texts, greedy)
    rows = []
    for variant in options.variants:
        server = None if variant == "url" else start(variant, server_args, options, options.out_dir)
        url = options.url if server is None else server.url
        try:
            for rate in options.rates:
                row = dict(variant=variant, **measure(url, rate, texts, greedy, options))
                print("%-7s rate %6g: %6.1f req/s, p50 %s p99 %s ms, %d failed, %d/%d = greedy"
                      % (variant, rate, row["throughput"], row["p50_ms"] and round(row["p50_ms"], 1),
                         row["p99_ms"] and round(row["p99_ms"], 1), row["failed"],
                         row["identical_to_greedy"], row["compared"]), file=sys.stderr, flush=True)
                rows.append(row)
        finally:
            if server is not None:
                server.stop()
    meta = {"machine": _machine(), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
            "texts": len(texts), "input": options.input, "requests": options.requests,
            "seed": options.seed, "server_args": server_args, "threads": options.threads,
            "buffer_ms": options.buffer_ms}
    with open(os.path.join(options.out_dir, "serve.md"), "w", encoding="utf-8") as f:
        f.write(markdown(meta, rows))
    with open(os.path.join(options.out_dir, "serve.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(options.out_dir, "serve_latency.png"))
    print(markdown(meta, rows))
    return rows


def run_soak(options, server_args, texts, greedy):
    variant = options.variants[0]
    server = None if variant == "url" else start(variant, server_args, options, options.out_dir)
    try:
        chunks = soak(server, options.url if server is None else server.url, texts, greedy,
                      options)
    finally:
        if server is not None:
            server.stop()
    meta = {"machine": _machine(), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
            "variant": variant, "rate": options.rates[0], "chunk_s": options.soak_chunk,
            "texts": len(texts), "server_args": server_args, "threads": options.threads}
    text = soak_markdown(meta, chunks)
    with open(os.path.join(options.out_dir, "soak.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(options.out_dir, "soak.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "chunks": chunks}, f, indent=1)
    print(text)
    return chunks


def cli_main():
    try:
        main()
    except Exception as error:
        exit_in_one_line(error)


if __name__ == "__main__":
    cli_main()
