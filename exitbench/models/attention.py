"""Attention that knows where its tokens sit in the KV cache, and rotary position embeddings: what every
architecture's attention layers share.

Every attention layer takes an `AttnContext` so the same code serves three callers: training on whole
sequences (no cache), incremental decoding at fixed depth, and the exit engine, which runs only the
still-active rows of a batch and must read and write the KV entry of one loop iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .cache import expand_groups, write_and_gather

if TYPE_CHECKING:
    from .cache import KVCache, TokenIndex


# The functions a compiled loop step calls eagerly: their cache bookkeeping is host work dynamo cannot trace (the
# chunk and one-slot paths specialise on positions and slots; a mixed-iteration step's flat places are traced,
# `cached_causal_attention`). They are marked (`torch.compiler.disable`) when a loop step is first compiled
# (`keep_outside_graphs`), not at import: the decorator imports torch._dynamo, 1.1 s of every exitbench process's
# start that only --compile needs. So other modules call them through this one (`attention.<name>(…)`), never by
# a name of their own, and call the marked ones once they are marked (tests/test_compile.py holds it).
OUTSIDE_GRAPHS = ("_cache_attention", "sliding_window_attention")


def keep_outside_graphs() -> None:
    """Mark the OUTSIDE_GRAPHS functions for dynamo, once, before any compilation."""
    for name in OUTSIDE_GRAPHS:
        fn = globals()[name]
        if not getattr(fn, "_torchdynamo_disable", False):
            globals()[name] = torch.compiler.disable(fn)


@dataclass
class AttnContext:
    """Where the tokens being computed sit, and which KV entries their attention layers write and read.

    Chunk mode (`places` is None): T consecutive tokens from absolute position `start` in each batch row
    (`rows` picks cache rows; None = all rows, in order). Training, decoding at fixed depth and the prefill.
    Token mode (`places` given): one token per row of `rows`, each at its own position (`positions`), reading
    its row's keys 0 … its position; `places` says where in the cache at iteration 0, worked out once per set
    of tokens, and `index` where they write and read at this iteration, shared by the layers of a step. The exit
    engine's loop, where rows advance independently.
    `iteration` is the loop iteration (0-based) whose KV entry a layer writes and reads (0 outside loops; the
    cache maps it to a slot of its own, `KVCache.slot`): an int shared by every token, or in token mode one
    per token.
    """

    start: int = 0
    cache: "KVCache | None" = None
    rows: torch.Tensor | None = None
    iteration: int | torch.Tensor = 0
    positions: torch.Tensor | None = None
    places: "TokenIndex | None" = None
    index: "TokenIndex | None" = None
    # Token mode: each RoPE table's rows at `positions`, gathered once and shared by every layer and iteration.
    rotations: dict[int, torch.Tensor] | None = None
    # Chunk mode, a prefix-LM's prompt: per row (B,) or for all rows (int), how many leading positions form one
    # bidirectional block (they attend to each other; every later position is causal). None: all causal.
    prefix: torch.Tensor | int | None = None

    def at_iteration(self, iteration: int | torch.Tensor, host: list[int] | None = None) -> "AttnContext":
        """At `iteration`; `host`: the same per-token iterations as a list, so no device read is needed."""
        if self.places is None:
            return AttnContext(self.start, self.cache, self.rows, iteration, prefix=self.prefix)
        return AttnContext(self.start, self.cache, self.rows, iteration, self.positions, self.places,
                           self.cache.at_iteration(self.places, iteration, host), self.rotations)

    def rotation(self, table: torch.Tensor, halves: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token mode: a RoPE table's rows at the tokens' positions: the (cos, signed sin) pair `spread_rope`
        makes, (n, 1, 1, D) each, gathered once and shared by every layer and iteration of the step."""
        if torch.compiler.is_compiling():
            # Dynamo cannot carry an id()-keyed dict across the cache's graph break (and would guard on the
            # table's identity, recompiling whenever a caller passes a new view of it); compiled, the gather
            # fuses into the rotation, so sharing it buys nothing.
            return table[self.positions]
        key = (id(table), halves)
        if key not in self.rotations:
            # as many rows as the tokens' positions reach, where the index says (a caller's own `places`, as
            # the vLLM bridge's, may not: then every row)
            cos, sin = spread_rope(table, halves, getattr(self.places, "length", None))
            shape = (-1, 1, *cos.shape[1:])  # (a view: one op where unsqueeze is two, at every context built)
            self.rotations[key] = (cos[self.positions].view(shape), sin[self.positions].view(shape))
        return self.rotations[key]

    @classmethod
    def tokens(cls, cache: "KVCache", rows: list[int], positions: list[int],
               iteration: int | torch.Tensor | None = 0, by_row: bool = False,
               writes: list[int] | None = None, length: int | None = None) -> "AttnContext":
        """Token mode for one token per entry of `rows` at `positions` (lists), at `iteration` (None: none yet;
        `at_iteration` gives one). `by_row`: a row's tokens read its keys as one slice (KVCache.attend_by_row),
        for sets with several tokens per row whose tokens share an iteration. `writes`: where each token writes
        its keys, where that is not its position (a fixed-shape step's free places write into a column past
        every position read, and read as the longest token does); `length`: the keys each token reads, when more
        than its position needs (room for later tokens of a context kept across steps; then always masked)."""
        dense = not by_row and list(rows) == list(range(cache.batch))
        # (as_tensor: a list becomes a tensor in three ops where torch.tensor takes four)
        rows_t = cache.row_ids() if dense else torch.as_tensor(rows, device=cache.device)
        pos = torch.as_tensor(positions, device=cache.device)
        masked = length is not None or min(positions) != max(positions)
        length = length or max(positions) + 1
        places = cache.token_index(rows_t, pos, length, masked=masked,
                                   by_row=(list(rows), list(positions)) if by_row else None, dense=dense,
                                   writes=None if writes is None else torch.as_tensor(writes, device=cache.device))
        ctx = cls(cache=cache, rows=rows_t, positions=pos, places=places, rotations={})
        return ctx if iteration is None else ctx.at_iteration(iteration)


def rope_table(head_dim: int, length: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """(length, head_dim/2, 2) table of (cos, sin), Huginn's `freqs_cis` without its singleton dims; with
    `scaling` (a config's `rope_scaling`, rope_type llama3), the frequencies Llama 3.x rescales."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x's long-context RoPE: wavelengths longer than original/low_freq_factor are stretched by
    `factor`, those shorter than original/high_freq_factor are kept, and the band between is interpolated
    linearly in original/wavelength. In float32, as Hugging Face computes it, so the tables agree bit for bit."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, stretched)


def spread_rope(table: torch.Tensor, halves: bool, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A RoPE table (length, pairs, 2) spread over a head's D coordinates: cos (rows, 1, D) and sin with the
    sign each coordinate's rotation gives it, so that rotating x is x·cos + partner(x)·sin, three ops. Kept on the
    table object (a model passes the same table every call), and only as many rows as asked for so far (at least
    `length`; None: all), grown by doubling: spread over every position of a long context, the two would be
    twice the table's bytes (Ouro-1.4B's 65,536 positions: 64 MB) for positions a run never reaches."""
    key = "_spread_halves" if halves else "_spread_pairs"
    spread = table.__dict__.get(key)
    want = table.shape[0] if length is None else min(table.shape[0], length)
    if spread is None or spread[0].shape[0] < want:
        have = 0 if spread is None else spread[0].shape[0]
        rows = min(table.shape[0], max(want, 2 * have, 256))
        cos, sin = table[:rows, :, 0], table[:rows, :, 1]
        if halves:   # coordinate i pairs with i ± D/2: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin)
            spread = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        else:        # coordinate 2i pairs with 2i + 1
            spread = cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)
        spread = tuple(t.unsqueeze(-2).contiguous() for t in spread)
        table.__dict__[key] = spread
    return spread


def rope_rows(table: torch.Tensor, halves: bool, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The spread cos and sin rows of positions start … start + T − 1, (T, 1, D) each. Views, kept per (start,
    T) beside the spread table: a decoding step asks for the same one-position rows at every iteration."""
    if start + T > table.shape[0]:
        raise ValueError(f"position {start + T} exceeds the model's context of {table.shape[0]} tokens")
    key = "_rows_halves" if halves else "_rows_pairs"
    rows = table.__dict__.setdefault(key, {})
    got = rows.get((start, T))
    if got is None:
        cos, sin = spread_rope(table, halves, start + T)
        got = rows[(start, T)] = (cos[start : start + T], sin[start : start + T])
    return got


def partner(x: torch.Tensor, halves: bool) -> torch.Tensor:
    """Each coordinate's RoPE partner: (x2, x1) for rotate-half pairs, (x_{2i+1}, x_{2i}) for adjacent ones."""
    # a flip of the last axis split in two (halves) or in pairs: splitting an axis is always a view, and the
    # flip's fresh output always views back (roll and unflatten/flatten dispatch twice the ops)
    split = (2, -1) if halves else (-1, 2)
    return x.view(*x.shape[:-1], *split).flip(-2 if halves else -1).view(x.shape)


def apply_rope(x: torch.Tensor, table: torch.Tensor, start: int = 0,
               positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
               halves: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of x (B, T, H, D): the GPT-J / original-LLaMA layout, in fp32; with
    `halves`, the pairs (i, i + D/2) instead: Hugging Face's rotate-half layout (Llama, Qwen2, Ouro), the same
    rotation of differently paired coordinates. Token t of row b sits at position start + t, or (one token per
    row, T = 1) at `positions`: either its positions (b,) or their rotation (`AttnContext.rotation`).

    x·cos + partner(x)·(±sin) is the pair rotation's own arithmetic term for term (a − b·s is a + b·(−s) in
    IEEE arithmetic), so this equals `rope_reference` bit for bit in a third of the ops
    (tests/test_engine_ops.py)."""
    if torch.compiler.is_compiling():
        return rope_reference(x, table, start, positions, halves)
    if isinstance(positions, tuple):
        cos, sin = positions
    else:
        if positions is not None:
            cos, sin = spread_rope(table, halves)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        else:
            cos, sin = rope_rows(table, halves, start, x.shape[1])
    xf = x if x.dtype == torch.float32 else x.float()
    out = (xf * cos).add_(partner(xf, halves).mul_(sin))
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rope_reference(x: torch.Tensor, table: torch.Tensor, start: int = 0,
                   positions: torch.Tensor | None = None, halves: bool = False) -> torch.Tensor:
    """`apply_rope` written out pair by pair, as Huginn and Hugging Face write it: the reference it is held to,
    and the form a compiled step traces (`positions` may also be the table's rows there, (b, pairs, 2))."""
    T = x.shape[1]
    if positions is not None:
        rot = (positions if positions.dim() == 3 else table[positions]).view(-1, 1, 1, table.shape[1], 2)
    else:
        if start + T > table.shape[0]:
            raise ValueError(f"position {start + T} exceeds the model's context of {table.shape[0]} tokens")
        rot = table[start : start + T].view(1, T, 1, -1, 2)
    cos, sin = rot[..., 0], rot[..., 1]
    if halves:
        even, odd = x.float().chunk(2, dim=-1)
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def rotary_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor, ctx: AttnContext,
                     layer_id: int, halves: bool) -> torch.Tensor:
    """Heads q (B, T, H, D) and k, v (B, T, H_kv, D): RoPE on q and k (`halves`: rotate-half pairs), then
    causal attention through the cache; (B, T, H · D). The cache holds the H_kv grouped heads as they are."""
    B, T = q.shape[:2]
    rotation = ctx.rotation(rope, halves) if ctx.positions is not None else None
    q = apply_rope(q, rope, ctx.start, rotation, halves=halves).transpose(1, 2)
    k = apply_rope(k, rope, ctx.start, rotation, halves=halves).transpose(1, 2)
    return cached_causal_attention(q, k, v.transpose(1, 2), ctx, layer_id).transpose(1, 2).reshape(B, T, -1)


def rotary_attention_qk(qk: torch.Tensor, v: torch.Tensor, n_heads: int, rope: torch.Tensor, ctx: AttnContext,
                        layer_id: int, halves: bool) -> torch.Tensor:
    """`rotary_attention` for q and k side by side in one tensor (B, T, H + H_kv, D), as a fused projection
    leaves them: one rotation for both instead of one each (the same arithmetic, elementwise)."""
    B, T = qk.shape[:2]
    rotation = ctx.rotation(rope, halves) if ctx.positions is not None else None
    qk = apply_rope(qk, rope, ctx.start, rotation, halves=halves).transpose(1, 2)
    q, k = qk[:, :n_heads], qk[:, n_heads:]
    out = cached_causal_attention(q, k, v.transpose(1, 2), ctx, layer_id)
    if T == 1 and out.is_contiguous():  # (B, H, 1, D) is (B, 1, H, D) in memory: one view, no transpose
        return out.view(B, 1, -1)
    return out.transpose(1, 2).reshape(B, T, -1)


def prefix_mask(prefix: torch.Tensor | int, start: int, T: int, L: int, device: torch.device) -> torch.Tensor:
    """(B or 1, 1, T, L) mask of queries at start … start+T−1 over keys 0 … L−1: causal, except that positions
    below a row's `prefix` see each other whatever their order (a prefix-LM's bidirectional prompt block)."""
    blocks = torch.as_tensor(prefix, device=device).view(-1, 1, 1, 1)
    query = torch.arange(start, start + T, device=device).view(1, 1, T, 1)
    key = torch.arange(L, device=device).view(1, 1, 1, L)
    return (key <= query) | ((key < blocks) & (query < blocks))


def cached_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                            layer_id: int) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) and k, v (B, H_kv, T, D), through the cache when there is one
    (`_cache_attention`). Compiled (`--compile`), a step of fixed places whose keys are read through flat places
    (continuous depth batching: each place at its own position and slot) writes and gathers them as tensor ops of
    the graph instead (`_gathered_attention`), so that step traces whole. Only fixed places: a token set whose
    shapes follow its membership (scoring's waves) would compile this call apart, once per layer and shape, and
    exhaust dynamo's recompile limit."""
    index = ctx.index
    if torch.compiler.is_compiling() and index is not None and index.fixed and index.slot is None:
        return _gathered_attention(q, k, v, ctx.cache, layer_id, index)
    return _cache_attention(q, k, v, ctx, layer_id)


def _gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "KVCache", layer: int,
                        index: "TokenIndex") -> torch.Tensor:
    """`KVCache.update_tokens` and the masked attention after it, as dynamo traces them: the layer's stores viewed
    flat in the graph (`KVCache.flat` keeps its views in a dict keyed by id(), which would break it), every place
    from the index's tensors, so the graph holds for any places, positions and slots. The read length comes from
    the read places' size, not the index's int (an int read off an object is a constant to dynamo: each new length
    would compile the step again, and soon hit its recompile limit)."""
    n, H, _, D = k.shape
    flats = (cache.k[layer].view(-1, H, D), cache.v[layer].view(-1, H, D))
    keys, values = write_and_gather(flats, index, k, v, index.read.shape[0] // n)
    keys, values = expand_groups(q, keys, values)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=index.mask)


def _cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                     layer_id: int) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) and k, v (B, H_kv, T, D), through the cache when there is one.

    The cache stores this layer's keys at loop iteration ctx.iteration and returns every earlier position's keys
    of that iteration, so one function serves plain layers and loop iterations of any architecture.

    Never compiled (`--compile`): the cache is host bookkeeping (dicts of stores, per-row slices, in-place
    writes whose shapes follow the schedule), and tracing it would specialise on positions and slots. A
    compiled step breaks here cleanly and compiles the arithmetic on either side once, with dynamic shapes;
    a step of flat places does not come here when compiled (`cached_causal_attention`).
    """
    T = q.shape[2]
    if ctx.index is not None and ctx.index.spans is not None:
        return ctx.cache.attend_in_place(layer_id, ctx.index, q, k, v)
    if ctx.index is not None and ctx.index.by_row is not None:
        return ctx.cache.attend_by_row(layer_id, ctx.index, q, k, v)
    if ctx.index is not None:
        k, v = expand_groups(q, *ctx.cache.update_tokens(layer_id, ctx.index, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.index.mask)
    if ctx.cache is not None:
        k, v = ctx.cache.update(layer_id, ctx.iteration, ctx.rows, ctx.start, k, v)
    k, v = expand_groups(q, k, v)
    if ctx.prefix is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prefix_mask(ctx.prefix, ctx.start, T, k.shape[2],
                                                                            q.device))
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if k.shape[2] == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # A chunk after cached tokens: query i sees keys up to start + i.
    L = k.shape[2]
    mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def token_entries(ctx: AttnContext, layer: int, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token mode: write each token's k, v (n, H, 1, D) at its place, and return its row's entries of positions
    0 … length − 1 at its slot, (n, H, length, D); what lies past a token's position is for its caller to mask.
    Tokens of one row together (`by_row`) read their row's slice, as KVCache.attend_by_row does."""
    cache, index = ctx.cache, ctx.index
    if index.by_row is None:
        return cache.update_tokens(layer, index, k, v)
    cache.write_tokens(layer, index, k, v)
    out = []
    for store, new in ((cache.k, k), (cache.v, v)):
        rows = new.new_zeros(new.shape[0], index.length, *new.shape[1:2], new.shape[-1])
        for (idx, row, n_keys, _, _), slot in zip(index.by_row, index.row_slots):
            rows[idx, :n_keys] = store[layer][slot, row, :n_keys]
        out.append(rows.transpose(1, 2))
    return out[0], out[1]


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, layer_id: int,
                             window: int) -> torch.Tensor:
    """`cached_causal_attention` in which a query at position i sees only the keys j with i − j < window, itself
    included (vLLM's sliding window, Mistral's and Gemma's). The mask is built from positions alone, so it holds in
    both modes and for tokens of one row read together; never compiled, for the cache's reasons."""
    T = q.shape[2]
    if ctx.index is not None:
        k, v = token_entries(ctx, layer_id, k, v)
        queries = ctx.positions.view(-1, 1, 1, 1)  # one token per row
    else:
        if ctx.cache is not None:
            k, v = ctx.cache.update(layer_id, ctx.iteration, ctx.rows, ctx.start, k, v)
        queries = torch.arange(ctx.start, ctx.start + T, device=q.device).view(1, 1, T, 1)
    distance = queries - torch.arange(k.shape[2], device=q.device)
    k, v = expand_groups(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance >= 0) & (distance < window))
