"""Interleaving orders, positions and the relaxed causal mask of IBDecoder / IMDecoder / SA."""

import itertools

import pytest
import torch

from fairseq_pardec.models import interleaving as ordering

EOS, PAD = 2, 1
SETTINGS = [(h, c) for h in (1, 2, 4, 6) for c in (1, 2, 3)]


@pytest.mark.parametrize("h,c", SETTINGS)
def test_round_trip_every_length(h, c):
    for n in range(0, 41):
        words = list(range(100, 100 + n))
        flat = [words[i] if i >= 0 else EOS for i in ordering.interleave_indices(n, h, c)]
        z = h * c
        assert len(flat) % z == 0
        steps = [flat[s : s + z] for s in range(0, len(flat), z)]
        # EOS only in the last step, and at least once there
        assert all(EOS not in step for step in steps[:-1]) and EOS in steps[-1]
        assert ordering.deinterleave(flat, h, c, EOS) == words
        assert sorted(i for i in ordering.interleave_indices(n, h, c) if i >= 0) == list(range(n))


def test_paper_example_orders():
    y = list(range(1, 7))  # y1..y6
    flat = lambda n, h, c: [y[i] if i >= 0 else "E" for i in ordering.interleave_indices(n, h, c)]  # noqa: E731
    assert flat(6, 2, 1) == [1, 6, 2, 5, 3, 4, "E", "E"]  # Eq. 6: y1 yn y2 yn-1 ...
    assert flat(5, 2, 1) == [1, 5, 2, 4, 3, "E"]
    assert flat(6, 2, 2) == [1, 2, 6, 5, 3, "E", 4, "E"]  # +SA: two words per direction
    assert flat(6, 1, 2) == [1, 2, 3, 4, 5, 6, "E", "E"]  # vanilla SA
    assert flat(6, 4, 1) == [1, 3, 4, 6, 2, "E", 5, "E"]  # IMDecoder: segments y1-3, y4-6


def test_batched_interleave_matches_tables():
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, PAD, PAD, PAD], [PAD] * 5])
    lengths = torch.tensor([5, 2, 0])
    out = ordering.interleave(tokens, lengths, 2, 1, EOS, PAD)
    assert out.tolist() == [[10, 14, 11, 13, 12, EOS], [20, 21, EOS, EOS, PAD, PAD],
                            [EOS, EOS, PAD, PAD, PAD, PAD]]
    back = ordering.deinterleave_batch(out, 2, 1, EOS, PAD)
    assert back == [[10, 11, 12, 13, 14], [20, 21], []]


@pytest.mark.parametrize("h,c", SETTINGS)
def test_mask_is_eq4(h, c):
    n = 13
    mask = ordering.relaxed_causal_mask(n, h, c)
    for i, j in itertools.product(range(1, n + 1), repeat=2):  # Eq. 4 is 1-based
        allowed = -(-i // (h * c)) >= -(-j // (h * c))
        assert (mask[i - 1, j - 1] == 0) == allowed
        assert (mask[i - 1, j - 1] == float("-inf")) == (not allowed)
    assert torch.equal(ordering.relaxed_causal_mask(n, 1, 1) == 0, torch.tril(torch.ones(n, n)).bool())


def test_signed_positions_eq7_and_direction_indices_eq10():
    t = torch.arange(8)
    # Eq. 7: T_t = (-1)^(t-1) * ceil(t/2), t 1-based
    expected = [(-1) ** (k - 1) * -(-k // 2) for k in range(1, 9)]
    assert ordering.signed_positions(t, 2, 1).tolist() == expected
    assert ordering.signed_positions(t, 1, 1).tolist() == list(range(1, 9))
    assert ordering.signed_positions(t, 2, 2).tolist() == [1, 2, -1, -2, 3, 4, -3, -4]
    # Eq. 10: (floor((t-1)/h), (t-1) mod h), here 1-based steps
    assert ordering.step_positions(t, 4, 1).tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert ordering.slot_direction(t, 4, 1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_bad_settings():
    with pytest.raises(ValueError, match="even"):
        ordering.check_directions(3, 1)
    with pytest.raises(ValueError, match=">= 1"):
        ordering.check_directions(2, 0)
