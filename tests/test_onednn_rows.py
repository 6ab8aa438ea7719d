"""oneDNN's packed product runs at few row counts (step/onednn.py): the rows are padded, and
the product of the rows asked for is the product of those rows."""

import pytest
import torch

from fairseq_pardec.decoding.step import onednn


def test_row_counts_are_few_and_padding_is_at_most_an_eighth():
    counts = [onednn.padded_rows(rows) for rows in range(1, 8193)]
    assert counts[: onednn.EXACT_UP_TO] == list(range(1, onednn.EXACT_UP_TO + 1))
    assert counts == sorted(counts)
    for rows, count in enumerate(counts, start=1):
        assert rows <= count <= rows + rows // 8
        assert onednn.padded_rows(count) == count  # a padded count is its own
    assert len(set(counts)) < 100


@pytest.mark.skipif(not onednn.packs_on_onednn(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("rows", [1, 16, 17, 31, 100, 257])
@pytest.mark.parametrize("relu", [False, True])
def test_padded_product_is_the_rows_product(rows, relu):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 24, generator=generator)
    bias = torch.randn(48, generator=generator)
    x = torch.randn(rows, 24, generator=generator)
    out = onednn.linear(x, onednn.pack(weight), bias, relu)
    expected = torch.addmm(bias, x, weight.t())
    if relu:
        expected = expected.relu()
    assert out.shape == (rows, 48) and out.is_contiguous()
    # another kernel than addmm's: equal up to float32 rounding
    assert torch.allclose(out, expected, rtol=0, atol=1e-4)
