"""Two threads decoding different batches with one generator get what each gets alone."""

import threading
import time

import pytest
import torch

from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.drafters import CachedNARDrafter, HeadsDrafter, NARDrafter
from fairseq_pardec.decoding.draft_verify.drafters.lookup import LookupDrafter, NgramTable

from helpers import by_id, make_task, random_batch


def _drafter(kind, model, d):
    if kind in ("iad", "lookup"):
        if kind == "iad":
            drafter = CopyDrafter(d, d, adaptive=True)
        else:
            table = NgramTable([[d.nspecial + i % 7 for i in range(j, j + 12)] for j in range(9)],
                               len(d), d.eos(), d.eos())
            drafter = LookupDrafter(d, d, table, adaptive=True)
        # what the drafter learns across batches (AcceptanceHistory: a fresh row's prior) is
        # shared by the threads on purpose, so their drafts would depend on the interleaving;
        # the per-batch state is under test here
        drafter.history = None
        return drafter
    from test_gad_cached import causal_drafter
    from test_gad import drafter_model

    if kind == "gad":
        return NARDrafter(drafter_model(make_task(d)), 4, d.eos(), d.pad())
    return CachedNARDrafter(causal_drafter(make_task(d), k=4, seed=3), 4, d.eos(), d.pad(),
                            adaptive=True)


def _recording(drafter):
    """Per thread, every draft the drafter proposed; a pause after each lets the other thread
    run in between (the drafter's per-batch state is what the threads would share)."""
    drafts = {}
    propose = drafter.propose

    def recorded(state, view):
        lists = propose(state, view)
        drafts.setdefault(threading.get_ident(), []).append(lists)
        time.sleep(0.002)
        return lists

    drafter.propose = recorded
    return drafts


@pytest.mark.trains
@pytest.mark.parametrize("kind", ["iad", "lookup", "gad", "gad_cached"])
def test_two_threads_share_one_generator(copy_model, kind):
    model, d, make_sample = copy_model
    drafter = _drafter(kind, model, d)
    generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(), max_len_a=1.2,
                                     max_len_b=8)
    drafts = _recording(drafter)
    batches = [make_sample(7, seed=21), make_sample(3, seed=22)]  # different sizes
    alone = []
    for sample in batches:
        drafts.clear()
        out = generator.generate([model], sample)
        alone.append((by_id(sample, out), next(iter(drafts.values()))))
    drafts.clear()
    together = [None, None]
    errors = []

    def decode(i):
        try:
            out = generator.generate([model], batches[i])
            together[i] = (by_id(batches[i], out), drafts[threading.get_ident()])
        except Exception as error:  # reported below, with the thread's batch
            errors.append((i, repr(error)))

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert together == alone  # outputs, and every draft along the way
