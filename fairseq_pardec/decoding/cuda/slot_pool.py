"""The static step's slots (cuda/static.py), least recently used first, within a budget.

A slot holds one bucket's static buffers (the self-attention cache, the encoder's keys and
values) and the CUDA graphs recorded on them, and is reused by later batches of the same
buckets. Batches bring new buckets (a batch that loses rows passes through smaller row
buckets; source lengths and length limits differ), so without a bound the slots and their
graphs would grow for as long as the process decodes. The pool keeps:

* at most ``slots`` slots and ``graphs`` recorded graphs;
* its slots' memory (buffers and graph pools) at most ``memory_share`` of the memory they could
  have: what they hold plus what the device has free (the driver's free memory and the blocks
  torch has cached but not allocated).

Beyond that it evicts the slots no batch uses, least recently used first (buffers and graphs
freed); a slot in use is never evicted (its batch needs it), so the slots in use alone may
exceed the budget. Past the graph count with every slot in use, the slot about to record drops
its own least recently used graphs.
"""

from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

import torch


class SlotBudget(NamedTuple):
    slots: int = 12  # a batch of 64 that loses rows passes through 8 row buckets
    graphs: int = 128
    memory_share: float = 0.5


def device_free_memory(device: torch.device) -> Optional[int]:
    """Bytes a new allocation on ``device`` could use (None off CUDA: no memory bound there):
    the driver's free memory and torch's cached, unallocated blocks. Reads counters, does not
    wait for the device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class SlotPool:
    """Slots by bucket and by last use. A slot offers ``rows, capacity, source`` (its bucket),
    ``free()`` (no batch uses it), ``nbytes`` (its buffers and graphs), ``graphs`` (its
    :class:`~fairseq_pardec.decoding.cuda.cuda_graphs.GraphSet`) and ``evict()``.
    The caller serialises the calls (the step's lock)."""

    def __init__(self, budget: SlotBudget = SlotBudget(),
                 free_memory: Callable[[torch.device], Optional[int]] = device_free_memory):
        self.budget = budget
        self.free_memory = free_memory
        self._slots: "OrderedDict[object, None]" = OrderedDict()  # least recently used first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self):
        return iter(list(self._slots))

    def find(self, rows: int, capacity: int, source: int):
        """A slot of these buckets that no batch uses (the most recently used), or None."""
        for slot in reversed(self._slots):
            if (slot.rows, slot.capacity, slot.source) == (rows, capacity, source) and slot.free():
                return slot
        return None

    def add(self, slot):
        self._slots[slot] = None

    def touch(self, slot):
        """``slot`` was just used."""
        if slot in self._slots:
            self._slots.move_to_end(slot)

    def graph_count(self) -> int:
        return sum(len(slot.graphs) for slot in self._slots)

    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self._slots)

    # ------------------------------------------------------------------ eviction
    def make_room(self, new_bytes: int, device: torch.device):
        """Evict unused slots until one more slot of ``new_bytes`` fits the budget."""
        while len(self._slots) + 1 > self.budget.slots or not self._fits(new_bytes, device):
            if not self._evict_oldest_unused():
                return

    def make_room_for_graph(self, graphs):
        """Before ``graphs`` (a slot's set) records one more: unused slots go first, then, while
        still over, that set's own least recently used graphs."""
        while self.graph_count() + 1 > self.budget.graphs or not self._fits(0, graphs.device):
            if not self._evict_oldest_unused():
                break
        while self.graph_count() + 1 > self.budget.graphs:
            if not graphs.drop_oldest():
                return

    def evict_unused(self) -> int:
        """Evict every slot no batch uses (out of memory); how many went."""
        count = 0
        while self._evict_oldest_unused():
            count += 1
        return count

    def clear(self):
        """Forget every slot (the weights changed): the unused ones are evicted, the ones in
        use stay with their batches until those end."""
        self.evict_unused()
        self._slots.clear()

    def _fits(self, new_bytes: int, device: torch.device) -> bool:
        free = self.free_memory(device)
        if free is None:
            return True
        held = self.nbytes()
        return held + new_bytes <= self.budget.memory_share * (held + free)

    def _evict_oldest_unused(self) -> bool:
        for slot in self._slots:
            if slot.free():
                del self._slots[slot]
                slot.evict()
                self.evictions += 1
                return True
        return False
