"""A/B of two checkouts' decoding speed in two long-lived processes that take turns.

    python examples/checkouts_ab.py BEFORE AFTER DATA --path CKPT [--generator lean_greedy]
        [--batch-size 1] [--max-sentences 150] [--rounds 12] [--threads 2]
        [--max-len-a 1.2] [--max-len-b 10] [--source-lang L --target-lang L]

BEFORE and AFTER are checkouts of this repository (``git worktree add /tmp/before <commit>``);
each runs in a process of its own with that checkout first on ``PYTHONPATH``. Both load the
model, batch the first ``--max-sentences`` test sentences and decode them once to warm up.
Then they take turns, in ABBA order, decoding all of them once per turn. Each round gives one
before/after ratio of the two passes' wall times, and the script prints their median, min and
max.

Why not fresh processes: on a machine others use, the speed of the same code drifts by a third
within minutes (docs/results.md, "The engine's plain iteration trimmed"), and ABBA cycles of
fresh benchmark processes, each a minute long, then cannot resolve 5%. Two passes a second
apart see nearly the same machine.

Both checkouts must have ``fairseq_pardec.benchmark.runner``'s ``load``, ``batches`` and
``build`` as this script calls them (``e0e44bf``, 2026-11-25, introduced them). A native library built from other sources
than the installed one is built at run time into the cache for that checkout (native/library.py).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

_WORKER = """
import argparse, sys, time, torch
from fairseq_pardec.benchmark import runner
a = argparse.Namespace(**eval(sys.argv[1]))
torch.set_num_threads(a.threads)
args = argparse.Namespace(data=a.data, path=a.path, source_lang=a.source_lang,
                          target_lang=a.target_lang, cpu=True, gen_subset=a.gen_subset,
                          fp16=False, bf16=False)
task, model, use_cuda, utils = runner.load(args)
samples = runner.batches(task, model, task.dataset(a.gen_subset), a.batch_size,
                         a.max_sentences, False, utils)
generator = runner.build(task, model, (a.generator, a.generator, {}),
                         argparse.Namespace(max_len_a=a.max_len_a, max_len_b=a.max_len_b))

def decode():
    for sample in samples:
        task.inference_step(generator, [model], sample, prefix_tokens=None)

decode()
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    decode()
    print("%.6f" % (time.perf_counter() - start), flush=True)
"""


class Worker:
    """One checkout's decoding process: ``run()`` decodes the sentences once, returns seconds."""

    def __init__(self, checkout: str, options: dict):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout),
                   OMP_NUM_THREADS=str(options["threads"]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, repr(options)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            # ``python -c`` puts its working directory before PYTHONPATH: started in a
            # checkout, both workers would import that checkout
            cwd=tempfile.gettempdir())
        for line in self.process.stdout:
            if line.strip() == "ready":
                return
        raise SystemExit("checkouts_ab: the worker for %s ended before it was ready (run it "
                         "by hand to see why)" % checkout)

    def run(self) -> float:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("data")
    parser.add_argument("--path", required=True)
    parser.add_argument("--generator", default="lean_greedy")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-sentences", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len-a", type=float, default=1.2)
    parser.add_argument("--max-len-b", type=int, default=10)
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--source-lang", default=None)
    parser.add_argument("--target-lang", default=None)
    args = parser.parse_args()
    if args.rounds < 1 or args.batch_size < 1 or args.max_sentences < 1 or args.threads < 1:
        parser.error("--rounds, --batch-size, --max-sentences and --threads must be >= 1")
    options = {key: getattr(args, key) for key in (
        "generator", "batch_size", "max_sentences", "threads", "max_len_a", "max_len_b",
        "gen_subset", "source_lang", "target_lang")}
    options.update(data=os.path.abspath(args.data), path=os.path.abspath(args.path))
    workers = {"before": Worker(args.before, options), "after": Worker(args.after, options)}
    times = {"before": [], "after": []}
    ratios = []
    try:
        for round_ in range(args.rounds):
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            took = {side: workers[side].run() for side in order}
            for side, seconds in took.items():
                times[side].append(seconds)
            ratios.append(took["before"] / took["after"])
    finally:
        for worker in workers.values():
            worker.close()
    print("%s, batch %d, %d sentences, %d rounds: before %.1f ms, after %.1f ms (medians); "
          "before / after %.3f (min %.3f, max %.3f)" % (
              args.generator, args.batch_size, args.max_sentences, args.rounds,
              1e3 * statistics.median(times["before"]), 1e3 * statistics.median(times["after"]),
              statistics.median(ratios), min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
