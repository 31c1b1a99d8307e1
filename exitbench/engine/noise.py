"""Initial-state noise keyed by (seed, position), so batching never changes where a token starts."""
from __future__ import annotations

import torch

from ..models.looped import unit_trunc_normal


class PositionNoise:
    """Unit truncated-normal initial-state noise keyed by (seed, position), identical for every row.

    Drawn in fixed blocks, each from its own generator: torch's samplers are not prefix-stable (the first
    rows of a draw of 8 differ from a draw of 16), so growing one table would change earlier positions.
    """

    BLOCK = 64

    def __init__(self, seed: int, dim: int):
        self.seed, self.dim = seed, dim
        self.table = torch.empty(0, dim)

    def _grow(self, end: int) -> None:
        if end > self.table.shape[0]:
            blocks = [self.table]
            for b in range(self.table.shape[0] // self.BLOCK, -(-end // self.BLOCK)):
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
                blocks.append(unit_trunc_normal((self.BLOCK, self.dim), gen))
            self.table = torch.cat(blocks)

    def rows(self, start: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Noise of positions start … start + length − 1, (length, dim)."""
        self._grow(start + length)
        return self.table[start:start + length].to(dtype=dtype, device=device)

    def at(self, positions: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Noise of each position in `positions`, (len(positions), dim)."""
        self._grow(max(positions) + 1)
        if len(positions) == 1:  # (a slice, not a gather through a tensor made from the list: a token at a time)
            return self.table[positions[0]:positions[0] + 1].to(dtype=dtype, device=device)
        return self.table[positions].to(dtype=dtype, device=device)
