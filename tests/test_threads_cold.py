"""Threads started together on a cold process, one generator each kind shared by all of them:
the native kernel's load, the kernel measurement, the fast layouts' first build and every
per-batch path run while the other threads run them too. Each thread's output must be what its
batch gets alone, and every thread must decode with the native kernel where the process has it.

The process must be cold, so the threads run in a subprocess of their own (with an empty kernel
cache: where the package ships no prebuilt kernel, the threads build it)."""

import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

THREADS = 4

SCRIPT = r"""
import json, sys, threading
sys.path.insert(0, %(tests)r)
import torch
torch.set_num_threads(2)

from fairseq_pardec.decoding.draft_verify.drafters import (CachedNARDrafter, NARDrafter,
                                                           NoDrafter)
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable
from fairseq_pardec.decoding.draft_verify.speculative import SamplingFilter, SpeculativeSampler
from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.native import library as native
from fairseq_pardec.decoding.cpu.products import NATIVE

from helpers import by_id, make_dictionary, make_task, random_batch, tiny_transformer
from test_blockwise import blockwise_generator, blockwise_model
from test_gad import drafter_model
from test_gad_cached import causal_drafter

THREADS = %(threads)d
LIMITS = dict(max_len_a=1.2, max_len_b=10)
d = make_dictionary(40)
task = make_task(d)
model = tiny_transformer(task, seed=0, encoder_layers=1, decoder_layers=2)
batches = [random_batch(d, [2 + (i * 7 + j * 5) %% 13 for j in range(1 + i %% 3 * 2)], seed=i)
           for i in range(THREADS)]


def uses_native(generator):
    # whether the fast step's products have the native kernel (None: not the fast step)
    step = generator.block_decoder
    if not getattr(step, "fast", False):
        return None
    return step._weights is not None and step._weights.layers[0].qkv.native is not None


def exact(drafter):
    def build():
        return DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), **LIMITS)
    return build


def lookup():
    table = NgramTable([[d.nspecial + i %% 7 for i in range(j, j + 12)] for j in range(9)],
                       len(d), d.eos(), d.eos())
    return LookupDrafter(d, d, table, adaptive=True)


blockwise_task = make_task(d)
heads = blockwise_model(blockwise_task, heads=4, seed=1, encoder_layers=1, decoder_layers=2)
torch.nn.init.normal_(heads.decoder.proposal.fc2.weight, std=0.5)

KINDS = {
    "lean_greedy": (model, exact(NoDrafter())),
    "iad": (model, exact(CopyDrafter(d, d, adaptive=True))),
    "lookup": (model, exact(lookup())),
    "gad": (model, exact(NARDrafter(drafter_model(make_task(d)), 4, d.eos(), d.pad()))),
    "gad_cached": (model, exact(CachedNARDrafter(causal_drafter(make_task(d), k=4, seed=3), 4,
                                                 d.eos(), d.pad(), adaptive=True))),
    "blockwise": (heads, lambda: blockwise_generator(blockwise_task, heads)),
}


def sampling():
    # a sampler draws from one seeded sequence across calls, so each thread has a generator
    # of its own (same model, same seed); pinned to one kernel, as its reference is
    generator = DraftVerifyGenerator([model], d, CopyDrafter(d, d), ExactAcceptance(),
                                     sampler=SpeculativeSampler(SamplingFilter(), 7), **LIMITS)
    generator.block_decoder.pin_kernel(NATIVE)
    return generator


def run(kind):
    if kind == "sampling":
        verifier, generators = model, [sampling() for _ in range(THREADS)]
    else:
        verifier, build = KINDS[kind]
        generators = [build()] * THREADS
    barrier = threading.Barrier(THREADS)
    together, kernel, errors = [None] * THREADS, [None] * THREADS, []

    def decode(i):
        try:
            barrier.wait()
            with torch.no_grad():
                out = generators[i].generate([verifier], batches[i])
            together[i] = by_id(batches[i], out)
            kernel[i] = [native.native_kernel() is not None, uses_native(generators[i])]
        except Exception as error:  # reported with the thread's batch
            errors.append("thread %%d: %%r" %% (i, error))

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = []
    for i in range(THREADS):
        generator = sampling() if kind == "sampling" else generators[i]
        with torch.no_grad():
            alone.append(by_id(batches[i], generator.generate([verifier], batches[i])))
    return dict(same=together == alone, together=repr(together), alone=repr(alone),
                kernel=kernel, errors=errors)


results = {kind: run(kind) for kind in list(KINDS) + ["sampling"]}
results["native_main"] = native.native_kernel() is not None
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kernel-cache")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore",
               FAIRSEQ_PARDEC_CACHE=str(cache), XDG_CACHE_HOME=str(cache))
    env.pop("FAIRSEQ_PARDEC_KERNEL", None)  # the threads measure the kernels
    proc = subprocess.run([sys.executable, "-c", SCRIPT % dict(tests=TESTS, threads=THREADS)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("kind", ["lean_greedy", "iad", "lookup", "gad", "gad_cached",
                                  "blockwise", "sampling"])
def test_threads_started_together_on_a_cold_process(cold_run, kind):
    result = cold_run[kind]
    assert not result["errors"]
    assert result["same"], "together: %s\nalone: %s" % (result["together"], result["alone"])
    if cold_run["native_main"]:  # the process has the native kernel: so has every thread
        assert all(loaded and used is not False for loaded, used in result["kernel"]), \
            result["kernel"]
