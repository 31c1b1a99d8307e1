"""Where the fixed places of a continuous-depth-batching loop read and write, kept up to date place by place.

A table of fixed places (loop.py) holds one token per place, each at its own row, position and iteration. Its
attention context is one token-mode `AttnContext` for all places: where each place writes its keys at iteration
0, which keys it reads and what its mask hides; the loop moves it to each step's iterations by an offset
(`AttnContext.at_iteration`). Tokens leave and join every step or two, so the context is not rebuilt for each
change: the changes since the last step are written into it at the next step, all at once, a few indexed copies
from tables made with the context (each row's read places, each position's mask). A leaving token's place is
pointed at the cache's unread column (`trash`); a place a token leaves is mostly taken again before the next step,
so most changes are one write, not two. The context is rebuilt only when a token reaches past the keys every
place reads (the read length grows by doubling, so that is rare).
"""
from __future__ import annotations

import torch

from ..models import AttnContext, KVCache


class PlaceContext:
    def __init__(self, cache: KVCache, places: int):
        self.cache, self.places = cache, places
        # Per place: its row, the position it reads up to (its token's; a free place keeps its last one) and
        # where it writes (its token's position; a free place the trash column).
        self.rows = list(range(places))
        self.reads = [0] * places
        self.writes = [self.trash] * places
        self.base: AttnContext | None = None
        self.length = 0
        self.changed: set[int] = set()  # places whose entries changed since the context was last brought up
        self.read_table: torch.Tensor | None = None  # (rows, length): each row's read places at iteration 0
        self.mask_table: torch.Tensor | None = None  # (length, 1, 1, length): what a token at each position hides

    @property
    def trash(self) -> int:
        """The cache's last position: the run allocates it for free places' writes, and no token reads it."""
        return self.cache.capacity - 1

    def join(self, at: list[int], rows: list[int], positions: list[int]) -> None:
        """Tokens at (rows, positions) took places `at`."""
        for j, row, position in zip(at, rows, positions):
            self.rows[j], self.reads[j], self.writes[j] = row, position, position
            self.changed.add(j)
        if max(positions) >= self.length:
            self.base = None  # built at the next step, as long as the longest read doubled

    def leave(self, at: list[int]) -> None:
        """The tokens at places `at` left: the places write to the trash column from now on."""
        for j in at:
            self.writes[j] = self.trash
            self.changed.add(j)

    def context(self) -> AttnContext:
        """The places' context at iteration 0 (`at_iteration` moves it), with every change since the last step
        in it."""
        if self.base is not None and self.changed:
            self._update(sorted(self.changed))
        self.changed = set()
        if self.base is None:
            self._build()
        return self.base

    def _build(self) -> None:
        cache = self.cache
        self.length = min(max(2 * self.length, max(self.reads) + 1), self.trash)
        # every place masked (a place may read fewer keys than the longest), each reading as if at the longest
        # read so far, so the index has room for the reads still to come
        self.base = AttnContext.tokens(cache, self.rows, self.reads, iteration=None, writes=self.writes,
                                       length=self.length)
        self.base.places.fixed = True
        keys = cache.key_steps(self.length)
        self.read_table = cache.row_ids().view(-1, 1) * cache.capacity + keys
        hidden = keys.view(1, -1) > keys.view(-1, 1)
        self.mask_table = torch.zeros(hidden.shape, dtype=cache.dtype, device=cache.device) \
            .masked_fill_(hidden, float("-inf")).view(self.length, 1, 1, self.length)

    def _update(self, at: list[int]) -> None:
        """Rewrite the index entries of places `at` from the host lists: one host-to-device copy, then a copy
        into each of the context's per-place tensors."""
        ctx, cache = self.base, self.cache
        index = ctx.places
        meta = torch.tensor([at, [self.rows[j] for j in at], [self.writes[j] for j in at],
                             [self.reads[j] for j in at]], device=cache.device)
        where, rows, writes, reads = meta.unbind(0)
        if index.dense:
            index.positions.index_copy_(0, where, writes)
        if index.write is not None:  # (a dense index gets flat places once iterations differ)
            index.write.index_copy_(0, where, rows * cache.capacity + writes)
        ctx.positions.index_copy_(0, where, reads)
        ctx.rotations.clear()  # (each table's rows at the positions, gathered again at the next step)
        if index.read is not None:
            index.read.view(self.places, self.length).index_copy_(0, where, self.read_table.index_select(0, rows))
        index.mask.index_copy_(0, where, self.mask_table.index_select(0, reads))

    def lockstep(self, full: bool) -> int | None:
        """The one position every row's place reads at, when the places are full, in row order and at one
        position (then a step is a cached chunk of the whole batch); else None."""
        if not full or self.places != self.cache.batch or self.rows != list(range(self.places)):
            return None
        return self.reads[0] if min(self.reads) == max(self.reads) else None
