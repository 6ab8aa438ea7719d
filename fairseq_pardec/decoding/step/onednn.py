"""oneDNN's product with a packed weight, at few row counts.

oneDNN (through PyTorch's ideep) builds a primitive for each shape it is asked to multiply and
keeps it in a cache of 1024: its code, compiled for that shape. Decoding asks for every row
count, from one row to a batch's blocks and a batch's source tokens, so a process that decodes
long enough fills the cache, and holds what it holds for good (docs/results.md: a server's
resident memory grew for minutes under a steady load), and every row count seen for the first
time waits for a build.

So the rows are padded to a few counts: up to :data:`EXACT_UP_TO` each count is its own, above
it there are eight counts per doubling. A weight shape is then built at fewer than a hundred
counts up to 8192 rows, and the padding costs at most an eighth of the rows. A row's product
does not depend on the rows beside it; the count may change which kernel oneDNN runs, and so
its rounding, as any count does (the margin guard covers it).
"""

from typing import Optional

import torch
from torch import Tensor

# row counts up to this many are multiplied as they are
EXACT_UP_TO = 16

_ONEDNN_OK: Optional[bool] = None


def packs_on_onednn() -> bool:
    """True when this torch has oneDNN's packed linear and it computes a product correctly
    (checked once on a small product; a build without it falls back, never fails)."""
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        try:
            weight = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
            rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
            _ONEDNN_OK = bool(torch.allclose(linear(rows, pack(weight)), rows @ weight.t(),
                                             atol=1e-4))
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_OK = False
    return _ONEDNN_OK


def pack(weight: Tensor) -> Tensor:
    """``weight`` (out, in) in oneDNN's blocked layout for :func:`linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def padded_rows(rows: int) -> int:
    """The row count that ``rows`` rows are multiplied at: ``rows`` itself up to
    :data:`EXACT_UP_TO`, else the next multiple of an eighth of its power of two."""
    if rows <= EXACT_UP_TO:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def linear(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None, relu: bool = False) -> Tensor:
    """``x W^T + b`` (then a ReLU, fused, where ``relu``) for 2-D float32 rows ``x`` on the
    weight :func:`pack` made, multiplied at :func:`padded_rows` rows: the first ``len(x)`` rows
    of the product, contiguous."""
    rows = x.size(0)
    size = padded_rows(rows)
    if size != rows:
        padded = x.new_empty(size, x.size(1))
        padded[:rows] = x
        padded[rows:].zero_()
        x = padded
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias,
                                             "relu" if relu else "none", [], "")
    return out if size == rows else out[:rows]
