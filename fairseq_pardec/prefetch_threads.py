"""fairseq's batch-prefetch threads, stopped before the interpreter finalizes.

fairseq's ``BufferedIterator`` (``--data-buffer-size``, 10 batches by default) collates batches
ahead of the decoding in a daemon thread (``BackgroundConsumer``). The decoding command lines
load batches in their own process (no DataLoader workers: tasks/translation_pardec.py), so that
thread runs torch operators of the collation much of the time. When a run ends early (an error
that our boundary tells in one line, a bug's traceback, Ctrl-C, SIGTERM), the thread may be
inside such an operator, the GIL released; once the interpreter finalizes, a daemon thread that
takes the GIL back is ended with ``pthread_exit``, whose forced unwinding through torch's C++
frames calls ``std::terminate``: "terminate called without an active exception" and SIGABRT
(exit 134) after the right one-line error.

Exit handlers run before the interpreter finalizes, while threads still run as usual: ours tells
each prefetch thread to stop after the batch at hand and empties its queue until it has ended.
After a complete run the threads have ended already, and this costs nothing.
"""

import atexit
import queue
import sys
import threading
import time

# a batch being collated is finished first: far more than a batch takes; past it, the process
# exits as before (a thread still collating may then abort it)
STOP_WITHIN_S = 60.0


def prefetch_threads():
    """fairseq's live ``BackgroundConsumer`` threads (none where fairseq's iterators were never
    imported)."""
    iterators = sys.modules.get("fairseq.data.iterators")
    kind = getattr(iterators, "BackgroundConsumer", None)
    if kind is None:
        return []
    return [thread for thread in threading.enumerate()
            if isinstance(thread, kind) and thread.is_alive()]


def stop_prefetch_threads(within_s=STOP_WITHIN_S):
    """Stop fairseq's prefetch threads: each puts the batch it is collating, then its end marker,
    and ends. Returns the threads still running after ``within_s`` seconds (normally none)."""
    deadline = time.monotonic() + within_s
    for thread in prefetch_threads():
        # the thread's loop (fairseq/data/iterators.py) ends once it has put count >= _max_len
        # batches: 0 ends it after the batch at hand, whatever the iterator's length
        thread._max_len = 0
        while thread.is_alive() and time.monotonic() < deadline:
            _empty(thread._queue)  # room for that batch and the end marker after it
            thread.join(0.01)
    return prefetch_threads()


def _empty(batches):
    try:
        while True:
            batches.get_nowait()
    except queue.Empty:
        pass


def install():
    """Stop the prefetch threads when the command line exits, however it exits. Registered when
    the plugin is imported, so it runs after the exit handlers registered later (the results
    file's, the summary's): nothing of theirs needs the threads."""
    atexit.register(stop_prefetch_threads)
