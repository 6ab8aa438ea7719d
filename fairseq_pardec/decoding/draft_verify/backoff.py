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

import torch
from torch import Tensor


class DraftBackoff:
    """The back-off state of one batch's rows (one object per ``generate`` call): a few
    integers per row, on the host, where the engine reads each iteration's outcome anyway;
    updating them in Python costs less than the tensor operations it would take. Tensors in and
    out are on the CPU."""

    TOLERATED = 1  # consecutive rejected drafts before the row backs off
    LONGEST_WAIT = 16
    PROBE = 2  # most draft tokens of a row that is backing off

    def __init__(self, bsz: int):
        self.failures = [0] * bsz
        self.wait = [0] * bsz

    def room(self, room: Tensor) -> Tensor:
        """The draft room of each row: none while it waits, a probe's after its wait."""
        allowed = []
        for r, failures, wait in zip(room.tolist(), self.failures, self.wait):
            if wait > 0:
                allowed.append(0)
            else:
                allowed.append(min(r, self.PROBE) if failures > self.TOLERATED else r)
        return torch.tensor(allowed, dtype=room.dtype)

    def update(self, drafted: Tensor, accepted: Tensor):
        """After an iteration: ``drafted`` (B,) tokens each row's drafter proposed, ``accepted``
        (B,) how many of them the verifier kept."""
        for r, (tried, kept) in enumerate(zip(drafted.tolist(), accepted.tolist())):
            if tried <= 0:
                self.wait[r] = max(self.wait[r] - 1, 0)
                continue
            failed = kept == 0
            self.failures[r] = self.failures[r] + 1 if failed else 0
            excess = min(max(self.failures[r] - self.TOLERATED, 0), 8)
            self.wait[r] = min(2 ** (excess - 1), self.LONGEST_WAIT) if failed and excess > 0 else 0

    def keep(self, alive: Tensor):
        """Keep (and reorder) rows, as the engine does when finished rows leave."""
        order = alive.tolist()
        self.failures = [self.failures[i] for i in order]
        self.wait = [self.wait[i] for i in order]
