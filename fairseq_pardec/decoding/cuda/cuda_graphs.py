"""The capture layer of the static decoder step: each bucket's call recorded once as a CUDA graph,
then replayed.

A decoder step of a small Transformer on a GPU costs its kernel launches, not its arithmetic:
about 70 kernels for a 3-layer decoder, each a few microseconds of Python and driver work. The
static step (cuda/static.py) computes with fixed shapes on fixed buffers, so one call per
(batch bucket, block-length bucket) can be recorded as a CUDA graph and every later call of
that bucket is one replay.

Why ``torch.cuda.CUDAGraph`` by hand and not ``torch.compile(mode="reduce-overhead")``:

* the cache's shape changes within a process (source lengths differ between batches; rows
  leave; the capacity follows the batch's length limit): ``torch.compile`` specialises on
  shapes, and each new one costs a recompilation (seconds for a decoder) or a dynamic-shape
  graph that its CUDA graph trees do not record; by hand a new bucket costs one capture
  (milliseconds), and the buckets are few;
* compile time is paid in every process, and ``fairseq-generate`` is one process per run;
* the step writes its cache in place, and ``reduce-overhead`` does not record functions that
  mutate their inputs (it falls back to running them eagerly);
* determinism: a replay runs the kernels of the eager call it recorded, so the graph computes
  bit for bit what the same code computes eagerly on the same device, the code the CPU tests
  check against fairseq. Inductor instead generates fused kernels with their own reduction
  orders (layer norms, softmax), autotuned per process: another rounding, possibly a different
  one in the next process, which the margin the step declares was not measured for.

A graph reads and writes fixed addresses. Its inputs are the static buffers its owner fills
before a replay; its outputs are the tensors the recorded call returned; its temporaries live
in a memory pool, one per :class:`GraphSet`, shared by the set's graphs. Sharing is what keeps a
set's memory near one call's worth, and it has a price the caller must pay: **every output must
be copied out (or be done with) before the set's next replay, of any of its graphs**. Replaying
a graph rewrites its own outputs; and a graph recorded later in the same pool may have placed
its outputs where an earlier graph keeps its temporaries (the earlier capture had freed them),
so replaying the earlier graph rewrites the later one's outputs too. The static step copies the
features out right after the call and its scores when they are read, which the engine does
before its next call on that cache; a cache has its own slot, hence its own set.

Capture rules (torch allows one capture at a time in a process):

* captures take a process-wide lock, so two decoding threads never capture at once;
* ``capture_error_mode="thread_local"``: another thread that reads the device meanwhile (a
  ``.tolist()``, a synchronize) neither breaks the capture nor is refused; the default mode
  ("global") would fail whichever came second;
* each device has its own capture stream (a stream belongs to one device: one stream for all,
  as ``torch.cuda.graph`` keeps, makes a model on a second GPU fail to capture and run eagerly);
* no ``torch.cuda.synchronize`` and ``empty_cache`` per capture (``torch.cuda.graph`` does
  both, to hand the new pool as much memory as possible). The capture stream waits for the
  current stream's work instead, which orders everything the call reads, and nothing is freed
  that a pending kernel uses; the cached memory is reused by the pool as is. Only out of
  memory empties the cache, after evicting (``make_room``), and retries once.
"""

import logging
import threading
from collections import OrderedDict
from typing import Callable, Dict, Hashable, NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)

_WARMUP_CALLS = 2
_failures_logged = set()

# one capture at a time in the process (torch's rule), and the per-device capture streams
_CAPTURE_LOCK = threading.Lock()
_capture_streams: Dict[int, "torch.cuda.Stream"] = {}


def graphs_possible(device: torch.device) -> bool:
    """Whether calls on ``device`` can be captured here: a CUDA device, outside another capture."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return not torch.cuda.is_current_stream_capturing()


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the allocator's (or the driver's) out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)


class Recorded(NamedTuple):
    graph: object  # has ``replay()``
    outputs: tuple
    nbytes: int  # what the capture added to the device's reserved memory (an estimate)


class GraphSet:
    """Captured calls keyed by their bucket, least recently used first; a key seen for the first
    time is recorded.

    ``call(key, fn)``: ``fn`` reads its inputs from static buffers, may write static buffers in
    place, and returns its outputs. It must compute the same thing however often it runs on the
    same buffers (it runs eagerly for the warm-up, then is recorded): the static step's calls
    are (they write the block's keys and values at the same places each time, and its callers
    move the cache's lengths only outside the call). See the module's notes on outputs.

    ``before_capture(set)``: called before each capture (the owner's budget makes room).
    ``make_room()``: called when a capture ran out of memory, before its one retry.
    """

    def __init__(self, device: torch.device, before_capture: Optional[Callable] = None,
                 make_room: Optional[Callable[[], None]] = None):
        self.device = torch.device(device)
        self._graphs: "OrderedDict[Hashable, Recorded]" = OrderedDict()  # least recent first
        self._pool = None
        self.before_capture = before_capture
        self.make_room = make_room
        self.enabled = self._possible()

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def nbytes(self) -> int:
        """The device memory the set's captures added (an estimate: the reserved memory's growth
        while each capture ran)."""
        return sum(r.nbytes for r in self._graphs.values())

    def call(self, key: Hashable, fn: Callable):
        if not self.enabled:
            return fn()
        with self._device_scope():
            recorded = self._graphs.get(key)
            if recorded is None:
                recorded = self._record(key, fn)
                if recorded is None:
                    return fn()
            else:
                self._graphs.move_to_end(key)
            recorded.graph.replay()
        return recorded.outputs

    def drop_oldest(self) -> bool:
        """Forget the least recently used graph (its outputs are freed with it; the pool keeps
        the memory for the set's later captures). False when there is none."""
        if not self._graphs:
            return False
        self._graphs.popitem(last=False)
        return True

    def clear(self):
        """Forget every recorded call and the pool (the weights or buffers they read were
        replaced, or the set's slot is evicted)."""
        self._graphs.clear()
        self._pool = None
        self.enabled = self._possible()

    # ------------------------------------------------------------------ recording
    def _record(self, key: Hashable, fn: Callable) -> Optional[Recorded]:
        """Record ``fn``; on out of memory make room and retry once; else (or when it fails
        again) this set runs eagerly from now on, with the same results: None."""
        if self.before_capture is not None:
            self.before_capture(self)
        for attempt in (1, 2):
            try:
                recorded = self._capture(fn)
            except RuntimeError as error:
                if out_of_memory(error) and attempt == 1 and self.make_room is not None:
                    self.make_room()
                    continue
                # an operation that cannot be recorded (a driver or torch build without the
                # support some kernel needs), or no memory even after evicting
                self.enabled = False
                self._graphs.clear()
                self._pool = None
                _log_failure(error)
                return None
            self._graphs[key] = recorded
            return recorded
        return None  # not reached: the second attempt returns or gives up

    def _possible(self) -> bool:
        return graphs_possible(self.device)

    def _device_scope(self):
        # a model on another GPU than the current one: record and replay on its own
        return torch.cuda.device(self.device)

    def _capture(self, fn: Callable) -> Recorded:
        with _CAPTURE_LOCK:
            stream = _capture_stream(self.device)
            current = torch.cuda.current_stream(self.device)
            # everything queued so far (the buffers the call reads) comes first
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                # kernels initialise their workspaces (cuBLAS handles, ...) on a first call;
                # that must not happen inside the capture: warm up on the capture stream
                for _ in range(_WARMUP_CALLS):
                    fn()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                reserved = torch.cuda.memory_reserved(self.device)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outputs = fn()
                except BaseException:
                    _end_failed_capture(graph)
                    raise
                graph.capture_end()
                grown = torch.cuda.memory_reserved(self.device) - reserved
            # the replays run on the current stream, after the warm-up
            current.wait_stream(stream)
        return Recorded(graph, outputs, max(0, grown))


def _capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The device's capture stream (the caller holds the capture lock)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(device=index)
    return stream


def _end_failed_capture(graph):
    """End a capture whose call raised, so that the stream leaves capture mode; the capture
    itself is invalid, and ending it says so: that error is the call's, already raised."""
    try:
        graph.capture_end()
    except RuntimeError:
        pass


def _log_failure(error: Exception):
    if out_of_memory(error):
        reason = "out of memory, even after evicting the unused buffers"
    else:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if reason in _failures_logged:
        return
    _failures_logged.add(reason)
    logger.warning("the static decoder step could not be captured as a CUDA graph (%s): it runs "
                   "eagerly, with the same results, more slowly", reason)
