"""Building blocks of the Raven / Huginn-0125 architecture (Geiping et al. 2025, arXiv 2502.05171; reference code github.com/seal-rg/recurrent-pretraining).

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
from torch import nn

if TYPE_CHECKING:
    from .cache import KVCache, TokenIndex


@dataclass
class AttnContext:
    """Where the tokens being computed sit, and which KV entries their attention layers write and read.

    Chunk mode (`places` is None): T consecutive tokens from absolute position `start` in each batch row
    (`rows` picks cache rows; None = all rows, in order). Training, decoding at fixed depth and the prefill.
    Token mode (`places` given): one token per row of `rows`, each at its own position (`positions`), reading
    its row's keys 0 … its position; `places` says where in the cache at iteration 0, worked out once per set
    of tokens, and `index` where they write and read at this slot, shared by the layers of a step. The exit
    engine's loop, where rows advance independently.
    `slot` is the loop iteration (0-based) whose KV entry a layer writes and reads (0 outside loops; the cache
    maps it to a slot of its own): an int shared by every token, or in token mode one per token.
    """

    start: int = 0
    cache: "KVCache | None" = None
    rows: torch.Tensor | None = None
    slot: int | torch.Tensor = 0
    positions: torch.Tensor | None = None
    places: "TokenIndex | None" = None
    index: "TokenIndex | None" = None
    # Token mode: each RoPE table's rows at `positions`, gathered once and shared by every layer and slot.
    rotations: dict[int, torch.Tensor] | None = None

    def at_slot(self, slot: int | torch.Tensor) -> "AttnContext":
        if self.places is None:
            return AttnContext(self.start, self.cache, self.rows, slot)
        return AttnContext(self.start, self.cache, self.rows, slot, self.positions, self.places,
                           self.cache.at_iteration(self.places, slot), self.rotations)

    def rotation(self, table: torch.Tensor) -> torch.Tensor:
        """Token mode: the rows of a RoPE table (positions, pairs, 2) at the tokens' positions."""
        if id(table) not in self.rotations:
            self.rotations[id(table)] = table[self.positions]
        return self.rotations[id(table)]

    @classmethod
    def tokens(cls, cache: "KVCache", rows: list[int], positions: list[int],
               slot: int | torch.Tensor | None = 0) -> "AttnContext":
        """Token mode for one token per entry of `rows` at `positions` (lists), at `slot` (None: no slot yet;
        `at_slot` gives one)."""
        rows_t, pos = torch.tensor(rows, device=cache.device), torch.tensor(positions, device=cache.device)
        length = max(positions) + 1
        places = cache.token_index(rows_t, pos, length, masked=min(positions) != length - 1)
        ctx = cls(cache=cache, rows=rows_t, positions=pos, places=places, rotations={})
        return ctx if slot is None else ctx.at_slot(slot)


class RMSNorm(nn.Module):
    """Learned RMSNorm computed in fp32; Huginn casts back to the input dtype *before* the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """(length, head_dim/2, 2) table of (cos, sin), Huginn's `freqs_cis` without its singleton dims."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor, start: int = 0,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of x (B, T, H, D): the GPT-J / original-LLaMA layout, in fp32. Token t
    of row b sits at position start + t, or (one token per row, T = 1) at `positions`: either its positions
    (b,) or the table's rows there already, (b, pairs, 2)."""
    T = x.shape[1]
    if positions is not None:
        rot = (positions if positions.dim() == 3 else table[positions]).view(-1, 1, 1, table.shape[1], 2)
    else:
        if start + T > table.shape[0]:
            raise ValueError(f"position {start + T} exceeds the model's context of {table.shape[0]} tokens")
        rot = table[start : start + T].view(1, T, 1, -1, 2)
    cos, sin = rot[..., 0], rot[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def cached_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
                            layer_id: int) -> torch.Tensor:
    """Causal attention of q, k, v (B, H, T, D), through the cache when there is one.

    The cache stores this layer's keys at loop iteration ctx.slot and returns every earlier position's keys
    of that iteration, so one function serves plain layers and loop iterations of any architecture.
    """
    T = q.shape[2]
    if ctx.index is not None:
        k, v = ctx.cache.update_tokens(layer_id, ctx.index, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.index.mask)
    if ctx.cache is not None:
        k, v = ctx.cache.update(layer_id, ctx.slot, ctx.rows, ctx.start, k, v)
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if k.shape[2] == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # A chunk after cached tokens: query i sees keys up to start + i.
    L = k.shape[2]
    mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Conv1D(nn.Module):
    """GPT-2's linear layer: y = x W + b with W stored (in, out), so Hugging Face GPT-2 weights load as they are."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class CausalSelfAttention(nn.Module):
    """Fused Wqkv, learned q/k bias added before RoPE, full multi-head attention, output `proj`."""

    def __init__(self, n_embd: int, n_heads: int, qk_bias: bool, layer_id: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = n_embd // n_heads
        self.layer_id = layer_id
        self.Wqkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, n_heads, self.head_dim)) if qk_bias else None
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        if self.qk_bias is not None:
            q = q + self.qk_bias[0]
            k = k + self.qk_bias[1]
        rotation = ctx.rotation(rope) if ctx.positions is not None else None
        q = apply_rope(q, rope, ctx.start, rotation).transpose(1, 2)
        k = apply_rope(k, rope, ctx.start, rotation).transpose(1, 2)
        y = cached_causal_attention(q, k, v.transpose(1, 2), ctx, self.layer_id)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GatedMLP(nn.Module):
    """proj(SiLU(gate) * up) with `fc` holding the gate rows first, then the up rows."""

    def __init__(self, n_embd: int, intermediate_size: int):
        super().__init__()
        self.fc = nn.Linear(n_embd, 2 * intermediate_size, bias=False)
        self.proj = nn.Linear(intermediate_size, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """x̂ = n2(x + Attn(n1 x)); out = n4(x̂ + MLP(n3 x̂)), four learned RMSNorms (Huginn's layout)."""

    def __init__(self, n_embd: int, n_heads: int, intermediate_size: int, qk_bias: bool, eps: float,
                 layer_id: int):
        super().__init__()
        self.norm_1 = RMSNorm(n_embd, eps)
        self.attn = CausalSelfAttention(n_embd, n_heads, qk_bias, layer_id)
        self.norm_2 = RMSNorm(n_embd, eps)
        self.mlp = GatedMLP(n_embd, intermediate_size)
        self.norm_3 = RMSNorm(n_embd, eps)
        self.norm_4 = RMSNorm(n_embd, eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), rope, ctx))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


def trunc_normal_(t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Truncated normal at ±3σ, drawn with an explicit generator so runs are reproducible."""
    if std == 0:
        return t.zero_()
    with torch.no_grad():
        return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


def takase_init_(model: nn.Module, n_embd: int, effective_depth: int,
                 generator: torch.Generator | None = None) -> None:
    """Huginn's "takase" init: σ = sqrt(2/(5h)) everywhere, σ/sqrt(2·depth) on output projections."""
    std = math.sqrt(2 / (5 * n_embd))
    out_std = std / math.sqrt(2 * effective_depth)
    for name, p in model.named_parameters():
        if ".norm_" in name or name.endswith("ln_f.weight"):
            nn.init.ones_(p)
        elif name.endswith("qk_bias"):
            nn.init.zeros_(p)
        elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
            trunc_normal_(p.data, out_std, generator)
        elif name.endswith("mlp.fc.weight"):
            half = p.shape[0] // 2
            trunc_normal_(p.data[:half], std, generator)
            trunc_normal_(p.data[half:], out_std, generator)
        elif p.dim() >= 2:
            trunc_normal_(p.data, std, generator)
