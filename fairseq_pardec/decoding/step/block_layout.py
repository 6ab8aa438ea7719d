"""Where each real position of a ragged verify block lives once the padding is squeezed out.

A batch verifies blocks of different lengths (each row's last token plus its own draft), padded
to the longest. The decoder's position-wise work (projections, feed-forward, output layer,
log-softmax) is most of an iteration's arithmetic, and at batch 32 a third of a padded block can
be padding. :class:`BlockLayout` numbers the real positions (time-major, the decoder's layout)
so that work runs on them only; attention, which needs each row's block in place, scatters them
back onto the (L, B) grid.
"""

from typing import Optional

import numpy as np
import torch
from torch import Tensor


class BlockLayout:
    """Packing of a (B, L) block with padding ``block_pad`` (True = padding).

    Packed rows are the real positions in time-major order (position 0 of every row, then
    position 1, ...). ``pos[b, l]`` is the packed row of block position l of row b, -1 at padding.
    A block without padding packs as the plain time-major flattening (no copies).
    """

    def __init__(self, block_pad: Tensor, dense: Optional[bool] = None):
        """``dense``: whether ``block_pad`` is all False, where the caller knows (else read)."""
        self.batch, self.length = block_pad.shape
        device = block_pad.device
        grid = self.batch * self.length
        self.dense = not bool(block_pad.any()) if dense is None else dense
        self.block_pad = block_pad
        if self.dense:
            self.index: Optional[Tensor] = None
            self.size = grid
            self.pos = torch.arange(grid, device=device).view(self.length, self.batch).t()
        else:
            self.index = (~block_pad).t().reshape(-1).nonzero().squeeze(1)
            self.size = self.index.numel()
            pos = torch.full((grid,), -1, dtype=torch.long, device=device)
            pos[self.index] = torch.arange(self.size, device=device)
            self.pos = pos.view(self.length, self.batch).t()

    @classmethod
    def from_host(cls, block_pad: Tensor, index: np.ndarray, pos: np.ndarray) -> "BlockLayout":
        """The layout of a ragged block whose packing the caller computed on the host
        (``index``: (N,) int64, the grid position of each packed row; ``pos``: (B, L) int64,
        per row and block position its packed row, -1 at padding), fresh arrays that nothing
        writes again."""
        layout = cls.__new__(cls)
        layout.batch, layout.length = block_pad.shape
        layout.dense = False
        layout.block_pad = block_pad
        # on the CPU the arrays themselves; elsewhere copies queued without waiting for the
        # device (never written again, the host's arrays need no copy of their own)
        device = block_pad.device
        layout.index = torch.from_numpy(index).to(device, non_blocking=True)
        layout.size = len(index)
        layout.pos = torch.from_numpy(pos).to(device, non_blocking=True)
        return layout

    def pack_time_major(self, t: Tensor) -> Tensor:
        """(L, B, ...) -> (N, ...)."""
        flat = t.reshape((self.length * self.batch,) + t.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack_time_major(self, packed: Tensor) -> Tensor:
        """(N, ...) -> (L, B, ...), zeros at padding."""
        shape = (self.length, self.batch) + packed.shape[1:]
        if self.index is None:
            return packed.view(shape)
        grid = packed.new_zeros((self.length * self.batch,) + packed.shape[1:])
        return grid.index_copy_(0, self.index, packed).view(shape)

    def pack(self, t: Tensor) -> Tensor:
        """(B, L, ...) -> (N, ...)."""
        return self.pack_time_major(t.transpose(0, 1))

    def unpack(self, packed: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at padding."""
        return self.unpack_time_major(packed).transpose(0, 1)

    def at(self, rows: Tensor, cols: Tensor) -> Tensor:
        """Packed rows of block positions (rows[i], cols[i]); they must be real positions."""
        return self.pos[rows, cols]
