"""KV cache with one entry per (attention layer, loop iteration), laid out for per-token exits.

Each layer owns a tensor of shape (slots, batch, heads, capacity, head_dim): slot i of a core layer holds
the keys written at loop iteration i. Plain layers have one slot. When a token exits the loop at
iteration e, `carry_forward` copies its entry at e into slots e+1 … so that a later token reading slot i
finds that token's deepest entry of the same layer — Huginn's `latest` lookup (huginn-0125.md §3.3) —
with plain slicing instead of a per-read gather.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, batch: int, n_heads: int, head_dim: int, slots: dict[int, int],
                 capacity: int = 64, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.batch, self.n_heads, self.head_dim = batch, n_heads, head_dim
        self.slots = dict(slots)
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.ensure(capacity)

    def ensure(self, length: int) -> None:
        """Grow every layer's position axis to hold at least `length` tokens (doubling, to amortise)."""
        if length <= self.capacity:
            return
        new_cap = max(length, 2 * self.capacity)
        for layer, n_slots in self.slots.items():
            shape = (n_slots, self.batch, self.n_heads, new_cap, self.head_dim)
            for store in (self.k, self.v):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer in store:
                    grown[:, :, :, : self.capacity] = store[layer]
                store[layer] = grown
        self.capacity = new_cap

    def update(self, layer: int, slot: int, rows: torch.Tensor | None, start: int,
               k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, H, T, D) at positions start… of `rows`; return keys/values of positions 0 … start+T."""
        end = start + k.shape[2]
        self.ensure(end)
        K, V = self.k[layer][slot], self.v[layer][slot]
        if rows is None:
            K[:, :, start:end] = k
            V[:, :, start:end] = v
            return K[:, :, :end], V[:, :, :end]
        K[rows, :, start:end] = k
        V[rows, :, start:end] = v
        return K[rows, :, :end], V[rows, :, :end]

    def carry_forward(self, layers: list[int], rows: torch.Tensor | None, pos: int, last_slot: int) -> None:
        """Make slots after `last_slot` of `layers` at `pos` equal the entry at `last_slot` (token exited)."""
        for layer in layers:
            for store in (self.k, self.v):
                # Basic-index the position first: mixing an int and a row tensor split by slices would move
                # the advanced dimensions to the front and pair rows with slots.
                at_pos = store[layer][:, :, :, pos]  # (slots, batch, heads, head_dim), a view
                if last_slot + 1 >= at_pos.shape[0]:
                    continue
                if rows is None:
                    at_pos[last_slot + 1 :] = at_pos[last_slot].unsqueeze(0)
                else:
                    at_pos[last_slot + 1 :, rows] = at_pos[last_slot, rows].unsqueeze(0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.k, self.v) for t in store.values())
