"""KV cache with one entry per (attention layer, loop iteration), laid out for per-token exits.

Each layer owns a tensor of shape (slots, batch, capacity, heads, head_dim): slot i of a core layer holds the
keys written at loop iteration i. Plain layers have one slot. When a token exits the loop at iteration e,
`carry_forward` copies its entry at e into slots e+1 … so that a later token reading slot i finds that
token's deepest entry of the same layer — Huginn's `latest` lookup (huginn-0125.md §3.3) — with plain
indexing instead of a per-read search.

A KV window of c iterations (Huginn's `compress-sN` with N = c × core layers; its vLLM plugin is c = 1)
keeps c slots per loop layer as a rolling buffer: iteration i (counted from 1) writes and reads slot
(i − 1) mod c, so a loop layer costs c slots whatever the depth. The rule a reader then follows: a token at
iteration j finds, for each earlier token that ran e iterations of the loop,
  - the entry of that token's latest iteration i ≤ e with i ≡ j (mod c), when it has one (always when e ≥ c:
    those c iterations filled every slot, so there is nothing to carry);
  - otherwise (e < c and (j − 1) mod c ≥ e) its deepest entry, iteration e: `carry_forward` fills slots
    e … c − 1 with it, which is what Huginn's `latest` finds when it falls back from the missing slot.
With c ≥ the loop's depth every iteration has its own slot and this is the full cache, bit for bit. Tokens
that run in lockstep (the prefill, a chunk) read each other at the same iteration, exactly as without a
window; a token decoded after them reads what their last laps left in the slot.

Two ways in. `update` writes a chunk of consecutive positions (training, fixed-depth decoding, the prefill,
and the engine whenever its tokens share one position and iteration) and reads back a view. `update_tokens`
writes one token per row, each at its own position and slot, and gathers each token's keys: the engine's
loop, whose rows advance independently. A (position, head, dim) block is contiguous, so that gather is one
`index_select` over a flat view, shared by every layer of a step through the context's index. Callers
always name loop iterations (0-based); the cache maps them to slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

# On a CPU, places whose keys and values come to at least this many bytes per place and layer attend to them where
# they lie in the store (`KVCache.attend_in_place`, one attention per place) instead of gathering them into one
# tensor (`write_and_gather`): the gather copies every place's keys at every layer and step, half of them padding
# past the place's position, and on a wide model that copy, not the arithmetic, is what a mixed-iteration step
# adds to a lockstep one; on a narrow one the gather's single dispatch is cheaper than a dispatch per place.
# The crossover measured by bench/in_place.py (bench/RESULTS.md#in-place-attention).
IN_PLACE_FROM = 128 * 1024


def expand_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values (…, H_kv, L, D) repeated to q's H heads (query head h reads group
    h // (H / H_kv), Hugging Face's repeat_kv), after the cache, so the cache stores each group once."""
    if k.shape[-3] == q.shape[-3]:
        return k, v
    n = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(n, dim=-3), v.repeat_interleave(n, dim=-3)


def write_and_gather(flats: tuple[torch.Tensor, torch.Tensor], index: "TokenIndex", k: torch.Tensor, v: torch.Tensor,
                     length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (n, H, 1, D) into a layer's flat key and value rows (`flats`) at the index's write places, and
    gather each token's `length` keys and values at its read places, (n, H, length, D): `update_tokens`' flat path,
    and a compiled step's (attention._gathered_attention), which views the stores and sizes the read itself."""
    n, H, _, D = k.shape
    out = []
    for flat, new in zip(flats, (k, v)):
        flat.index_copy_(0, index.write, new[:, :, 0])
        out.append(flat.index_select(0, index.read).view(n, length, H, D).transpose(1, 2))
    return out[0], out[1]


@dataclass
class TokenIndex:
    """Where the tokens of one step write and read, as rows of a layer's flat (slots·batch·capacity) view:
    `write` (n,), `read` (n·length,), and the additive mask (n, 1, 1, length) that hides keys past each token's
    position (None: none are). Another slot is an offset of slot·batch·capacity rows (`KVCache.at_iteration`),
    so the index is worked out once per set of tokens, not once per step."""

    write: torch.Tensor
    read: torch.Tensor | None
    length: int
    mask: torch.Tensor | None
    # Several tokens of a row (a depth-major wave): per row, (its tokens' places in the step, the row, keys to
    # read, the (m, length) mask of what each may see (None: all), its first place), read as one slice of the
    # row instead of a gather per token; and the slot each row reads at this iteration.
    by_row: list[tuple[torch.Tensor, int, int, torch.Tensor | None, int]] | None = None
    row_slots: list[int] | None = None
    # One token per batch row, every row in order (`dense`), all at one slot (`slot`, set per step): each token's
    # keys are then its row's first `length` entries at that slot, one slice of the store, no gather.
    dense: bool = False
    slot: int | None = None
    positions: torch.Tensor | None = None  # dense: each row's position, where its write goes
    # dense: the positions as scatter indices, per (heads, head_dim) of a layer's entries, made once per index
    scatters: dict = field(default_factory=dict)
    # The index of a table of fixed places (continuous depth batching, engine/places.py): its shapes hold from
    # step to step, so a compiled step reads and writes through it inside its graph
    # (`attention.cached_causal_attention`); other token sets' shapes follow their membership.
    fixed: bool = False
    # Set per step when the places attend in place (`KVCache.attend_in_place`): per place holding a token, (its
    # place, its row of the stores' (slots·batch) axis at its slot, the keys it reads); `busy`, those places as a
    # tensor (None: every place holds a token).
    spans: list[tuple[int, int, int]] | None = None
    busy: torch.Tensor | None = None

    def scatter_index(self, heads: int, dim: int) -> torch.Tensor:
        """(n, heads, 1, dim) indices of each row's position along a heads-first store's position axis."""
        got = self.scatters.get((heads, dim))
        if got is None:
            got = self.scatters[(heads, dim)] = self.positions.view(-1, 1, 1, 1).expand(-1, heads, 1, dim)
        return got


class KVCache:
    def __init__(self, batch: int, n_heads: int, head_dim: int, slots: dict[int, int],
                 capacity: int = 64, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window: int | None = None, geometry: dict[int, tuple[int, int]] | None = None, private: int = 0):
        """`slots`: slots per layer; `window`: the loop layers' slots are a rolling buffer of this many
        iterations (their `slots` must then be at most `private + window`), None: one slot per iteration;
        `private`: under a window, the first iterations that keep a slot each before the rolling buffer begins
        (Continuous Depth Batching's first_then_shared layout is private 1, window 1); `geometry`: the (heads,
        head_dim) of layers whose entries are not (n_heads, head_dim), e.g. a model's per-position states kept
        beside its keys (Inkling 2's convolution inputs, one "head" as wide as the input)."""
        self.batch, self.n_heads, self.head_dim = batch, n_heads, head_dim
        self.geometry = dict(geometry or {})
        self.slots = dict(slots)
        self.window, self.private = window, private
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._flats: dict[tuple[int, int], torch.Tensor] = {}
        self._heads_first: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._steps: torch.Tensor | None = None    # key_steps' range
        self._row_ids: torch.Tensor | None = None  # row_ids' range
        self.ensure(capacity)

    def ensure(self, length: int) -> None:
        """Grow every layer's position axis to hold at least `length` tokens (doubling, to amortise)."""
        if length <= self.capacity:
            return
        new_cap = max(length, 2 * self.capacity)
        for layer, n_slots in self.slots.items():
            shape = (n_slots, self.batch, new_cap, *self.shape_of(layer))
            for store in (self.k, self.v):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer in store:
                    grown[:, :, : self.capacity] = store[layer]
                store[layer] = grown
        self.capacity = new_cap
        self._flats.clear()
        self._heads_first.clear()

    def shape_of(self, layer: int) -> tuple[int, int]:
        """(heads, head_dim) of a layer's entries."""
        return self.geometry.get(layer, (self.n_heads, self.head_dim))

    def slot(self, iteration: int | torch.Tensor) -> int | torch.Tensor:
        """The slot loop iteration `iteration` (0-based; an int, or a tensor of one per token) writes and reads.
        Plain layers are always at iteration 0, slot 0."""
        if not self.window:
            return iteration
        if not self.private:
            return iteration % self.window
        shared = self.private + (iteration - self.private) % self.window
        if isinstance(iteration, int):
            return iteration if iteration < self.private else shared
        return torch.where(iteration < self.private, iteration, shared)

    def update(self, layer: int, iteration: int, rows: torch.Tensor | None, start: int,
               k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, H, T, D) of loop iteration `iteration` at positions start… of `rows` (None: every row,
        in order); return keys and values of positions 0 … start+T there, (b, H, start+T, D)."""
        end = start + k.shape[2]
        self.ensure(end)
        slot = self.slot(iteration)
        if rows is None:
            # every row: through the slot's (batch, H, capacity, D) views, made once, so a step's write and
            # read are three slices and a copy per store (a lockstep step's whole cache traffic)
            K, V = self.heads_first(layer, slot)
            K[:, :, start:end] = k
            V[:, :, start:end] = v
            return K[:, :, :end], V[:, :, :end]
        K, V = self.k[layer][slot], self.v[layer][slot]
        K[rows, start:end] = k.transpose(1, 2)
        V[rows, start:end] = v.transpose(1, 2)
        return K[rows, :end].transpose(1, 2), V[rows, :end].transpose(1, 2)

    def heads_first(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's keys and values as (batch, heads, capacity, head_dim) views, made once per store: the views
        are kept with the stores they view, so a store replaced from outside (a copied cache) gets new ones."""
        K, V = self.k[layer], self.v[layer]
        held = self._heads_first.get((layer, slot))
        if held is None or held[0] is not K or held[1] is not V:
            held = self._heads_first[(layer, slot)] = (K, V, K[slot].transpose(1, 2), V[slot].transpose(1, 2))
        return held[2], held[3]

    def _flat(self, rows: torch.Tensor, positions: torch.Tensor | int, iterations: torch.Tensor | int) -> torch.Tensor:
        """Rows of a layer's flat (slots·batch·capacity) view: each token's entry of its iteration."""
        return (self.slot(iterations) * self.batch + rows) * self.capacity + positions

    def flat(self, store: dict[int, torch.Tensor], layer: int) -> torch.Tensor:
        """A layer's keys or values as (slots·batch·capacity, heads, head_dim) rows, the view made once."""
        key = (id(store), layer)
        if key not in self._flats:
            self._flats[key] = store[layer].view(-1, *self.shape_of(layer))
        return self._flats[key]

    def token_index(self, rows: torch.Tensor, positions: torch.Tensor, length: int, masked: bool,
                    by_row: tuple[list[int], list[int]] | None = None, dense: bool = False,
                    writes: torch.Tensor | None = None) -> TokenIndex:
        """The `TokenIndex` at iteration 0 of one token per entry of `rows` at `positions`, each reading its row's
        keys 0 … its position out of `length` (1 + the largest position); `masked`: some token sits below it.
        `by_row` (the rows and positions as host lists): tokens of one row read their row's keys as one slice
        (`attend_by_row`), not one gather each. `writes`: where each token writes, when not at its position (a
        free place of a fixed-shape step writes into a column no token reads)."""
        writes = positions if writes is None else writes
        if by_row:
            base = rows * self.capacity
            groups = []
            row_list, pos_list = by_row
            places: dict[int, list[int]] = {}
            for i, row in enumerate(row_list):
                places.setdefault(row, []).append(i)
            for row, idx in places.items():
                pos = torch.tensor([pos_list[i] for i in idx], device=self.device)
                mine = [pos_list[i] for i in idx]
                n_keys = max(mine) + 1
                sees = torch.arange(n_keys, device=self.device) <= pos.unsqueeze(1)
                # every token sees every key only when the row has one token, at the last position
                whole = len(mine) == 1
                groups.append((torch.tensor(idx, device=self.device), row, n_keys, None if whole else sees, idx[0]))
            return TokenIndex(base + positions, None, length, None, groups)
        # (a context is built at every change of the tokens in flight: each op saved here is saved that often)
        keys = self.key_steps(length)
        mask = None
        if masked:
            hidden = keys > positions.view(-1, 1)
            mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
            mask = mask.view(len(positions), 1, 1, length)
        if dense:  # read through the slot's view; flat places only if the rows' slots ever differ (`at_iteration`)
            return TokenIndex(None, None, length, mask, dense=True, positions=writes)
        return self._flat_places(TokenIndex(None, None, length, mask), rows, writes)

    def key_steps(self, length: int) -> torch.Tensor:
        """0 … length − 1 on the cache's device: a slice of one range kept per capacity."""
        steps = self._steps
        if steps is None or steps.shape[0] < length:
            steps = self._steps = torch.arange(max(length, self.capacity), device=self.device)
        return steps[:length]

    def row_ids(self) -> torch.Tensor:
        """0 … batch − 1 on the cache's device, made once."""
        ids = self._row_ids
        if ids is None:
            ids = self._row_ids = torch.arange(self.batch, device=self.device)
        return ids

    def _flat_places(self, index: TokenIndex, rows: torch.Tensor, positions: torch.Tensor) -> TokenIndex:
        """`index` with its flat `write` and `read` rows at iteration 0 filled in."""
        base = rows * self.capacity
        index.write = base + positions
        index.read = (base.view(-1, 1) + self.key_steps(index.length)).view(-1)
        return index

    def at_iteration(self, index: TokenIndex, iterations: torch.Tensor | int, host: list[int] | None = None
                     ) -> TokenIndex:
        """`index` (at iteration 0) moved to loop iteration(s) `iterations`: an int, or one per token."""
        offset = self.slot(iterations) * (self.batch * self.capacity)
        if index.by_row is not None:
            if isinstance(iterations, int):
                slots = [self.slot(iterations)] * len(index.by_row)
            else:  # the caller's host copy, else one read per step (not one per row: each a device sync)
                host = host if host is not None else iterations.tolist()
                slots = [self.slot(host[first]) for *_, first in index.by_row]
            return TokenIndex(index.write + offset, None, index.length, None, index.by_row, slots)
        if isinstance(offset, int):
            if index.dense:  # writes and reads go through the slot's heads-first view: no flat offsets
                return replace(index, write=None, read=None, slot=self.slot(iterations))
            if offset == 0:
                return index
            return TokenIndex(index.write + offset, index.read + offset, index.length, index.mask, fixed=index.fixed)
        if index.write is None:  # dense until now: its flat places, made once
            self._flat_places(index, self.row_ids(), index.positions)
        read = (index.read.view(-1, index.length) + offset.view(-1, 1)).view(-1)
        return TokenIndex(index.write + offset, read, index.length, index.mask, fixed=index.fixed)

    def update_tokens(self, layer: int, index: TokenIndex, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (n, H, 1, D), one token each, where `index` says; return each token's keys and values,
        (n, H, length, D). The caller masks what lies past a token's position (index.mask)."""
        n, H, _, D = k.shape
        if index.slot is not None:  # every row in order at one slot: a scatter along positions, a slice
            K, V = self.heads_first(layer, index.slot)
            at = index.scatter_index(H, D)
            K.scatter_(2, at, k)
            V.scatter_(2, at, v)
            return K[:, :, :index.length], V[:, :, :index.length]
        return write_and_gather((self.flat(self.k, layer), self.flat(self.v, layer)), index, k, v, index.length)

    def write_tokens(self, layer: int, index: TokenIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (n, H, 1, D), one token each, at the index's flat write places."""
        for store, new in ((self.k, k), (self.v, v)):
            self.flat(store, layer).index_copy_(0, index.write, new[:, :, 0])

    def reads_in_place(self, length: int) -> bool:
        """Whether tokens reading `length` keys each attend in place (`attend_in_place`) rather than through a
        gather: on a CPU, from IN_PLACE_FROM bytes of keys and values per token and layer. Not on a GPU, where a
        loop of small attentions is a launch each: that wants a paged-attention kernel."""
        return self.device.type == "cpu" and \
            2 * length * self.n_heads * self.head_dim * self.dtype.itemsize >= IN_PLACE_FROM

    def in_place(self, index: TokenIndex, tokens: list[tuple[int, int, int, int]]) -> TokenIndex:
        """`index` read in place (`attend_in_place`) by the places holding `tokens`: (place, row, position,
        iteration) each, from the caller's host lists, so no device read."""
        spans = [(j, self.slot(i) * self.batch + row, position + 1) for j, row, position, i in tokens]
        every = len(spans) == index.write.shape[0]
        busy = None if every else torch.tensor([j for j, _, _ in spans], device=self.device)
        return replace(index, spans=spans, busy=busy)

    def attend_in_place(self, layer: int, index: TokenIndex, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                        ) -> torch.Tensor:
        """Write k, v (n, H_kv, 1, D) where `index` says, then attend each place of `index.spans` (q: (n, H, 1, D))
        to exactly its own keys, read where they lie: no copy, no padding, no mask; (n, H, 1, D), zeros at places
        holding no token."""
        self.write_tokens(layer, index, k, v)
        K, V = self.k[layer], self.v[layer]
        groups, D = K.shape[-2:]
        # Each operand one strided view of its store (a select, slice and transpose would be three ops per place,
        # and this loop runs once per place and layer). A place's keys: (1, H_kv, n, D) at its row of the
        # (slots·batch) axis, one stride as the flat view's writes above require. Its query: one token, so the
        # heads of a group, which read the same keys, go along the query axis, unmasked (a token sees all its
        # keys), instead of the keys repeated per head.
        (k_place, k_entries), (v_place, v_entries) = (
            (t.stride(1), (0, t.stride(3), t.stride(2), t.stride(4))) for t in (K, V))
        heads = q.shape[1] // groups
        query = (0, heads * q.stride(1), q.stride(1), q.stride(3))
        outs = []
        for j, at, n in index.spans:
            queries = q.as_strided((1, groups, heads, D), query, q.storage_offset() + j * q.stride(0))
            keys = K.as_strided((1, groups, n, D), k_entries, K.storage_offset() + at * k_place)
            values = V.as_strided((1, groups, n, D), v_entries, V.storage_offset() + at * v_place)
            outs.append(F.scaled_dot_product_attention(queries, keys, values))
        got = torch.cat(outs).view(len(outs), *q.shape[1:])
        if index.busy is None:
            return got
        return q.new_zeros(q.shape).index_copy_(0, index.busy, got)

    def attend_by_row(self, layer: int, index: TokenIndex, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> torch.Tensor:
        """Write k, v (n, H, 1, D) where `index` says, then attend each row's tokens (q: (n, H, 1, D)) to that
        row's keys at its slot, one slice and one masked attention per row; (n, H, 1, D)."""
        self.write_tokens(layer, index, k, v)
        out = torch.empty_like(q)
        for (idx, row, n_keys, sees, _), slot in zip(index.by_row, index.row_slots):
            keys = self.k[layer][slot, row, :n_keys].transpose(0, 1).unsqueeze(0)     # (1, H, L, D)
            values = self.v[layer][slot, row, :n_keys].transpose(0, 1).unsqueeze(0)
            queries = q.index_select(0, idx).transpose(0, 2)                           # (1, H, m, D)
            keys, values = expand_groups(queries, keys, values)
            got = F.scaled_dot_product_attention(queries, keys, values, attn_mask=sees)
            out.index_copy_(0, idx, got.transpose(0, 2))
        return out

    def carry_forward(self, layers: list[int], rows: torch.Tensor | list[int] | int | None,
                      positions: list[int] | int, last_slots: list[int] | int) -> None:
        """Tokens exited after iteration last_slot + 1: make the slots after each one's `last_slot` of `layers`
        at its position equal its entry at `last_slot`. Ints broadcast over tokens; `rows` None means every
        row. Under a window a token whose iterations reached the last slot has filled every slot: nothing to
        carry (its entries there are its latest of each residue)."""
        if rows is None:
            rows = list(range(self.batch))
        elif isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        rows = [rows] if isinstance(rows, int) else list(rows)
        n = max(len(rows), 1 if isinstance(positions, int) else len(positions),
                1 if isinstance(last_slots, int) else len(last_slots))
        expand = lambda x: [x] * n if isinstance(x, int) else list(x)  # noqa: E731
        rows, positions, last_slots = (rows * n if len(rows) == 1 else rows), expand(positions), expand(last_slots)
        if n == 1:  # one token: a strided slice of each store's flat rows per layer, not index tensors
            (b,), (p,), (last,) = rows, positions, last_slots
            stride, at = self.batch * self.capacity, b * self.capacity + p
            for layer in [layer for layer in layers if last + 1 < self.slots[layer]]:
                for store in (self.k, self.v):
                    flat = self.flat(store, layer)  # slot s of (b, p) is row s · stride + at
                    flat[(last + 1) * stride + at::stride].copy_(flat[last * stride + at])
            return
        by_depth: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in layers:
            n_slots = self.slots[layer]
            if n_slots not in by_depth:
                # Every (token, higher slot) pair, as flat rows: one gather and one scatter per store and layer.
                src, dst = [], []
                for b, p, last in zip(rows, positions, last_slots):
                    for s in range(last + 1, n_slots):
                        src.append((last * self.batch + b) * self.capacity + p)
                        dst.append((s * self.batch + b) * self.capacity + p)
                by_depth[n_slots] = (torch.as_tensor(src, device=self.device, dtype=torch.long),
                                     torch.as_tensor(dst, device=self.device, dtype=torch.long))
            src, dst = by_depth[n_slots]
            if dst.numel():
                for store in (self.k, self.v):
                    flat = self.flat(store, layer)
                    flat.index_copy_(0, dst, flat.index_select(0, src))

    def entries(self, layers: list[int], rows: list[int], positions: list[int], iterations: list[int]
                ) -> torch.Tensor:
        """(n, layers, 2, H, D): the key and value each token's iteration left in its slot of each layer."""
        at = self._flat(*(torch.tensor(x, device=self.device) for x in (rows, positions, iterations)))
        return torch.stack([torch.stack([self.flat(store, layer).index_select(0, at)
                                         for store in (self.k, self.v)], 1) for layer in layers], 1)

    def put_entries(self, layers: list[int], rows: list[int], positions: list[int], iterations: list[int],
                    entries: torch.Tensor) -> None:
        """Write back what `entries` read (n, layers, 2, H, D): each token's entries of its iteration, in that
        iteration's slot."""
        at = self._flat(*(torch.tensor(x, device=self.device) for x in (rows, positions, iterations)))
        for j, layer in enumerate(layers):
            for i, store in enumerate((self.k, self.v)):
                self.flat(store, layer).index_copy_(0, at, entries[:, j, i])

    def entry(self, layer: int, slot: int, row: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value (H, D) a reader at `slot` finds for `row`'s token at `position`."""
        return self.k[layer][slot, row, position], self.v[layer][slot, row, position]

    @staticmethod
    def bytes_for(batch: int, capacity: int, n_heads: int, head_dim: int, slots: dict[int, int],
                  dtype: torch.dtype, geometry: dict[int, tuple[int, int]] | None = None) -> int:
        """What a cache of this shape holds (keys and values; a `geometry` layer its own width), without
        allocating it: the memory plan's KV."""
        geometry = geometry or {}
        width = lambda layer: math.prod(geometry.get(layer, (n_heads, head_dim)))  # noqa: E731
        return 2 * sum(n * width(layer) for layer, n in slots.items()) * batch * capacity * dtype.itemsize

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.k, self.v) for t in store.values())
