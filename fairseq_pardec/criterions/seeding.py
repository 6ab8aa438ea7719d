"""Random draws of the training criteria that do not depend on how an update is split up.

fairseq reseeds torch at the start of every update (``--seed`` + number of updates, the same seed
on every rank), then runs the update's batches one after the other (``--update-freq``) or, with N
processes, one batch per rank. A draw from torch's global generator therefore depends on where a
batch runs: with ``--update-freq 2`` the second batch continues the first one's random stream,
while on 2 ranks both batches start from the update's seed, so the ranks make the *same* draws
for their different batches. ``glat_loss`` (prefixes, glancing) and ``blockwise_cross_entropy``
(the head of ``--head-sampling random`` / ``position``) draw from :func:`update_generator`
instead: a generator seeded by the update (and, per batch, by the batch's sentence ids), so a
batch gets the same draws wherever it runs. N processes then train exactly as one process with
``--update-freq N`` over the same batches (``tests/test_distributed.py``), and no two ranks share
their draws.
"""

import hashlib
import struct

import torch


def update_generator(update_num, ids=None):
    """A CPU ``torch.Generator`` for this update (``ids``: and this batch of sentences).

    The seed mixes torch's current seed (fairseq's per-update ``seed + num_updates``), the update
    number (for callers outside fairseq's trainer that do not reseed) and the sorted sentence ids.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<QQ", torch.initial_seed() % 2 ** 64, int(update_num) % 2 ** 64))
    if ids is not None:
        digest.update(torch.sort(ids.detach().reshape(-1).cpu().long()).values.numpy().tobytes())
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
    return generator
