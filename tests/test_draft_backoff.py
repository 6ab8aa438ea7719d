"""Drafts that keep being rejected cost next to nothing: rows back off to the plain step.

Cost is counted in verified block positions per accepted token (1.0 for greedy decoding), not
in time: speed belongs to the benchmark."""

import pytest

from fairseq_pardec.decoding.registry import CopyDrafter, DraftVerifyGenerator, ExactAcceptance
from fairseq_pardec.decoding.draft_verify.backoff import DraftBackoff

from helpers import by_id, fairseq_greedy, make_dictionary, make_task, random_batch, tiny_transformer


def test_backoff_schedule():
    """One rejection is tolerated; from the second in a row the waits double up to the longest;
    an accepted draft ends the back-off."""
    backoff = DraftBackoff(1)
    room = [10]
    drafted_at = []
    for iteration in range(60):
        [allowed] = backoff.room(room, iteration)
        drafted_at.append(allowed)
        backoff.update([min(allowed, 3)], [0], iteration)
    tries = [i for i, allowed in enumerate(drafted_at) if allowed > 0]
    gaps = [b - a - 1 for a, b in zip(tries, tries[1:])]
    assert gaps[:7] == [0, 1, 2, 4, 8, 16, 16]
    assert drafted_at[:2] == [10, 10] and all(a <= DraftBackoff.PROBE for a in drafted_at[2:])
    # a waiting row's wait ends at an iteration: the iterations between need no update
    iteration = 60
    assert backoff.waiting(iteration)
    while backoff.room(room, iteration) == [0]:
        iteration += 1
    assert not backoff.waiting(iteration)
    backoff.update([1], [1], iteration)  # a probe is accepted: full drafts again
    assert backoff.room(room, iteration + 1) == [10]


@pytest.mark.parametrize("batch_size", [1, 32])
def test_model_that_never_copies_costs_about_a_greedy_step(batch_size):
    """An untrained model copies nothing its source offers: with the back-off, or with the CPU's
    price of a draft position (AdaptiveCaps' threshold), iad verifies few positions beyond one
    per token, and its output stays fairseq's."""
    d = make_dictionary(50)
    model = tiny_transformer(make_task(d), seed=2)
    sample = random_batch(d, [40 + (i * 7) % 40 for i in range(batch_size)], seed=2)
    expected = fairseq_greedy(model, d, sample, max_len_a=1.2, max_len_b=10)
    cost = {}
    for backoff, paying in ((False, False), (True, False), (False, True), (True, True)):
        drafter = CopyDrafter(d, d, adaptive=True)
        if not paying:  # the caps follow acceptance only (no price of a position on the CPU)
            drafter.CPU_PRICES = None
        generator = DraftVerifyGenerator([model], d, drafter, ExactAcceptance(),
                                         max_len_a=1.2, max_len_b=10, backoff=backoff)
        assert by_id(sample, generator.generate([model], sample)) == by_id(sample, expected)
        stats = generator.stats
        assert stats.tokens_per_iteration < 1.05  # it does not copy
        cost[backoff, paying] = stats.positions_verified / stats.target_tokens
    # without the back-off and without pricing positions the rejected drafts are verified
    assert cost[False, False] > 1.7
    # the first draft has no history to go by (up to 16 positions); the rest are probes
    assert cost[True, False] < (1.45 if batch_size == 1 else 1.2)
    # a row whose estimated acceptance falls below a position's price stops drafting too
    assert cost[False, True] < (1.45 if batch_size == 1 else 1.2)
    assert cost[True, True] < (1.45 if batch_size == 1 else 1.2)
