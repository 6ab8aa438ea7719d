"""Freed memory handed back to the system when the running batch empties.

A batch that opens after the running batch emptied allocates its buffers anew, at the sizes of
its own rows, and glibc keeps what the last batch freed in pieces that the next sizes fit badly:
under a load that empties the batch now and then, a server's resident memory crept up while the
memory in use stayed flat (docs/results.md). ``malloc_trim`` returns the free pages. It runs when
the batch has just emptied, at most once every ``every_s`` seconds, and not at all where the C
library has none (not glibc).
"""

import ctypes
import ctypes.util
import time
from typing import Callable, Optional


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class FreeMemory:
    """Call :meth:`batch_emptied` each time the running batch has no rows left."""

    def __init__(self, every_s: float = 30.0, clock=time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.trim = _malloc_trim()
        self._last = clock()
        self.trims = 0

    def batch_emptied(self):
        now = self.clock()
        if self.trim is None or now - self._last < self.every_s:
            return
        self._last = now
        self.trim(0)
        self.trims += 1
