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
"""

import torch
from torch import Tensor


class DraftBackoff:
    """The back-off state of one batch's rows (one object per ``generate`` call)."""

    TOLERATED = 1  # consecutive rejected drafts before the row backs off
    LONGEST_WAIT = 16
    PROBE = 2  # most draft tokens of a row that is backing off

    def __init__(self, bsz: int, device):
        self.failures = torch.zeros(bsz, dtype=torch.long, device=device)
        self.wait = torch.zeros(bsz, dtype=torch.long, device=device)

    def room(self, room: Tensor) -> Tensor:
        """The draft room of each row: none while it waits, a probe's after its wait."""
        probing = self.failures > self.TOLERATED
        room = torch.where(probing, room.clamp(max=self.PROBE), room)
        return room.masked_fill(self.wait > 0, 0)

    def update(self, drafted: Tensor, accepted: Tensor):
        """After an iteration: ``drafted`` (B,) tokens each row's drafter proposed, ``accepted``
        (B,) how many of them the verifier kept."""
        tried = drafted > 0
        failed = tried & accepted.eq(0)
        self.failures = torch.where(tried, (self.failures + 1) * failed, self.failures)
        excess = (self.failures - self.TOLERATED).clamp(min=0, max=8)
        backoff = torch.where(
            failed & (excess > 0), (2 ** (excess - 1)).clamp(max=self.LONGEST_WAIT), 0
        )
        self.wait = torch.where(tried, backoff, (self.wait - 1).clamp(min=0))

    def keep(self, alive: Tensor):
        """Keep (and reorder) rows, as the engine does when finished rows leave."""
        self.failures = self.failures[alive]
        self.wait = self.wait[alive]
