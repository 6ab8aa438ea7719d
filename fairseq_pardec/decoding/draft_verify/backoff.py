"""Per-row back-off: a row whose drafts keep being rejected stops drafting, and probes again later.

A rejected draft costs its verified positions and the drafter's work and gains nothing, so on a
model or a sentence that does not copy (a translation, a heavy rewrite, an untrained model) a
drafting generator would be slower than plain greedy decoding. One rejection in a row is normal
(an edit in grammatical error correction breaks one copy, the next draft re-aligns), so a row
backs off from its second consecutive rejection on: it drafts nothing for 1, 2, 4, ... up to
``LONGEST_WAIT`` iterations, each of which costs one plain step, then probes with a draft of at
most ``PROBE`` tokens. A draft with at least one accepted token ends the back-off.

Over ``n`` tokens of a row that never copies, drafting iterations grow as ``log2(n)`` while
``n / LONGEST_WAIT`` bounds them from below: about one verified position more per
``LONGEST_WAIT`` accepted tokens, once the waits are long.

``--generator auto`` keeps no back-off: its prices (drafters/pricing.py) decide when a row drafts
and when it probes, per drafter (drafters/auto.py).
"""

from typing import List

from torch import Tensor


class DraftBackoff:
    """The back-off state of one batch's rows (one object per ``generate`` call): a few
    integers per row, on the host, where the engine reads each iteration's outcome anyway;
    updating them in Python costs less than the tensor operations it would take. A row's wait
    is kept as the iteration it ends at, so that iterations without drafts cost it nothing."""

    TOLERATED = 1  # consecutive rejected drafts before the row backs off
    LONGEST_WAIT = 16
    PROBE = 2  # most draft tokens of a row that is backing off

    def __init__(self, bsz: int):
        self.failures = [0] * bsz
        self.resume = [0] * bsz  # the first iteration at which the row may draft again

    def room(self, room: List[int], iteration: int) -> List[int]:
        """The draft room of each row at ``iteration``: none while it waits, a probe's after
        its wait."""
        allowed = []
        for r, failures, resume in zip(room, self.failures, self.resume):
            if iteration < resume:
                allowed.append(0)
            else:
                allowed.append(min(r, self.PROBE) if failures > self.TOLERATED else r)
        return allowed

    def waiting(self, iteration: int) -> bool:
        """Whether every row waits at ``iteration`` (the engine then asks for no drafts)."""
        return min(self.resume, default=0) > iteration

    def update(self, drafted: List[int], accepted: List[int], iteration: int):
        """After ``iteration``: ``drafted`` tokens each row's drafter proposed, ``accepted``
        how many of them the verifier kept (per active row)."""
        for r, (tried, kept) in enumerate(zip(drafted, accepted)):
            if tried <= 0:
                continue
            failed = kept == 0
            self.failures[r] = self.failures[r] + 1 if failed else 0
            excess = min(max(self.failures[r] - self.TOLERATED, 0), 8)
            wait = min(2 ** (excess - 1), self.LONGEST_WAIT) if failed and excess > 0 else 0
            self.resume[r] = iteration + 1 + wait

    def extend(self, other: "DraftBackoff"):
        """``other``'s rows after these (rows joining a running batch)."""
        self.failures = self.failures + other.failures
        self.resume = self.resume + other.resume

    def keep(self, alive: Tensor):
        """Keep (and reorder) rows, as the engine does when finished rows leave."""
        order = alive.tolist()
        self.failures = [self.failures[i] for i in order]
        self.resume = [self.resume[i] for i in order]
