"""The capture layer of the static decoder step: each bucket's call recorded once as a CUDA graph,
then replayed.

A decoder step of a small Transformer on a GPU costs its kernel launches, not its arithmetic:
about 70 kernels for a 3-layer decoder, each a few microseconds of Python and driver work. The
static step (step/static.py) computes with fixed shapes on fixed buffers, so one call per
(batch bucket, block-length bucket) can be recorded as a CUDA graph and every later call of
that bucket is one replay.

Why ``torch.cuda.CUDAGraph`` by hand and not ``torch.compile(mode="reduce-overhead")``:

* the cache's shape changes within a process (the capacity grows with the longest row; source
  lengths differ between batches; rows leave): ``torch.compile`` specialises on shapes, and each
  new one costs a recompilation (seconds for a decoder) or a dynamic-shape graph that its CUDA
  graph trees do not record; by hand a new bucket costs one capture (milliseconds), and the
  buckets are few;
* compile time is paid in every process, and ``fairseq-generate`` is one process per run;
* the step writes its cache in place, and ``reduce-overhead`` does not record functions that
  mutate their inputs (it falls back to running them eagerly);
* determinism: a replay runs the kernels of the eager call it recorded, so the graph computes
  bit for bit what the same code computes eagerly on the same device, the code the CPU tests
  check against fairseq. Inductor instead generates fused kernels with their own reduction
  orders (layer norms, softmax), autotuned per process: another rounding, possibly a different
  one in the next process, which the margin the step declares was not measured for.

A graph reads and writes fixed addresses. Its inputs are the static buffers its owner fills
before a replay, its outputs are the tensors the recorded call returned (overwritten by the next
replay), and its temporaries live in a memory pool of its own: one pool per :class:`GraphSet`,
whose graphs are replayed one at a time (one set per cache slot: two caches decoding in two
threads never share one).
"""

import logging
from typing import Callable, Dict, Hashable

import torch

logger = logging.getLogger(__name__)

_WARMUP_CALLS = 2
_failures_logged = set()


def graphs_possible(device: torch.device) -> bool:
    """Whether calls on ``device`` can be captured here: a CUDA device, outside another capture."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return not torch.cuda.is_current_stream_capturing()


class GraphSet:
    """Captured calls keyed by their bucket; a key seen for the first time is recorded.

    ``call(key, fn)``: ``fn`` reads its inputs from static buffers, may write static buffers in
    place, and returns its outputs. It must compute the same thing however often it runs on the
    same buffers (it runs eagerly for the warm-up, then is recorded): the static step's calls
    are (they write the block's keys and values at the same places each time, and its callers
    move the cache's lengths only outside the call).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: Dict[Hashable, tuple] = {}
        self._pool = None
        self.enabled = graphs_possible(device)

    def __len__(self) -> int:
        return len(self._graphs)

    def call(self, key: Hashable, fn: Callable):
        if not self.enabled:
            return fn()
        # a model on another GPU than the current one: record and replay on its own
        with torch.cuda.device(self.device):
            recorded = self._graphs.get(key)
            if recorded is None:
                try:
                    recorded = self._graphs[key] = self._capture(fn)
                except RuntimeError as error:
                    # an operation that cannot be recorded (a driver or torch build without the
                    # support some kernel needs): this set runs eagerly from now on, same results
                    self.enabled = False
                    self._graphs.clear()
                    _log_failure(error)
                    return fn()
            graph, outputs = recorded
            graph.replay()
        return outputs

    def _capture(self, fn: Callable):
        # kernels initialise their workspaces (cuBLAS handles, ...) on a first call; that must
        # not happen inside the capture, and warm-up on a side stream is what torch asks for
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_CALLS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn()
        return graph, outputs

    def clear(self):
        """Forget every recorded call (the weights or buffers they read were replaced)."""
        self._graphs.clear()
        self._pool = None
        self.enabled = graphs_possible(self.device)


def _log_failure(error: Exception):
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if reason in _failures_logged:
        return
    _failures_logged.add(reason)
    logger.warning("the static decoder step could not be captured as a CUDA graph (%s): it runs "
                   "eagerly, with the same results, more slowly", reason)
