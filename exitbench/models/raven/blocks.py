"""The blocks a Raven checkpoint can hold, one class per variant (variants.py says which a checkpoint has).

All share Huginn's key names inside a block (`norm_1`, `attn.Wqkv`, `attn.proj`, `norm_2`, `mlp.fc`,
`mlp.proj`) and differ in where the norms sit:

    huginn   x̂ = n2(x + Attn(n1 x));   out = n4(x̂ + MLP(n3 x̂))      Huginn-0125's four-norm sandwich
    llama    x̂ = x + Attn(n1 x);       out = x̂ + MLP(n2 x̂)          Llama pre-norm (retrofitted)
    olmo     x̂ = x + n1(Attn(x));      out = x̂ + n2(MLP(x̂))          OLMo-2 post-norm, q/k RMSNorm in Attn

Every block is built as `Block(config, layer_id, rotate_half)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttnContext, rotary_attention, rotary_attention_qk
from ..hf_blocks import RMSNorm  # one RMSNorm for every family (Huginn's arithmetic)
from ..linear import FlatLinear

if TYPE_CHECKING:
    from .config import RavenConfig


class CausalSelfAttention(nn.Module):
    """Fused Wqkv whose rows are q (n_heads · head_dim), then k and v (n_kv_heads · head_dim each); a learned
    q/k bias added before RoPE (Huginn); RMSNorm over the whole q and k projections before the split into
    heads (`qk_norm`, OLMo-2); RoPE on interleaved pairs (Huginn) or on rotate-half pairs (Hugging Face's,
    the retrofitted models'); grouped-query heads (attention.rotary_attention); output `proj`."""

    def __init__(self, n_embd: int, n_heads: int, qk_bias: bool, layer_id: int, *, n_kv_heads: int | None = None,
                 head_dim: int | None = None, qk_norm_eps: float | None = None, rotate_half: bool = False):
        super().__init__()
        self.n_heads, self.layer_id, self.rotate_half = n_heads, layer_id, rotate_half
        self.n_kv = n_kv_heads or n_heads
        self.head_dim = head_dim or n_embd // n_heads
        self.split = [n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
        self.Wqkv = FlatLinear(n_embd, sum(self.split), bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, n_heads, self.head_dim)) if qk_bias else None
        # Identity when absent: no parameters, so no keys, and no branch in forward.
        self.q_norm = RMSNorm(self.split[0], qk_norm_eps) if qk_norm_eps is not None else nn.Identity()
        self.k_norm = RMSNorm(self.split[1], qk_norm_eps) if qk_norm_eps is not None else nn.Identity()
        self.proj = FlatLinear(self.split[0], n_embd, bias=False)
        # q and k rotated as one tensor, straight from the fused projection (the same arithmetic, half the
        # rotation's ops), unless a norm sits between them or a per-head bias differs in width between them.
        self.fused_qk = qk_norm_eps is None and (not qk_bias or self.n_kv == n_heads)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused_qk:
            heads = self.Wqkv(x).view(B, T, -1, self.head_dim)  # q, k and v heads side by side
            qk, v = heads[:, :, : self.n_heads + self.n_kv], heads[:, :, self.n_heads + self.n_kv:]
            if self.qk_bias is not None:
                qk = qk + self._fused_bias()
            return self.proj(rotary_attention_qk(qk, v, self.n_heads, rope, ctx, self.layer_id, self.rotate_half))
        q, k, v = self.Wqkv(x).split(self.split, dim=-1)
        q = self.q_norm(q).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(k).view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.qk_bias is not None:
            q = q + self.qk_bias[0]
            k = k + self.qk_bias[1]
        return self.proj(rotary_attention(q, k, v, rope, ctx, self.layer_id, self.rotate_half))


    def _fused_bias(self) -> torch.Tensor:
        """The q and k biases as one (1, 1, H + H_kv, D) view, kept while the parameter stays the same tensor."""
        bias = self.qk_bias
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # a kept view would not carry gradients
            return bias.view(1, 1, 2 * self.n_heads, self.head_dim)
        held = self.__dict__.get("_fused_bias_view")
        if held is None or held[0] is not bias or held[1] != bias.data_ptr():
            held = (bias, bias.data_ptr(), bias.view(1, 1, 2 * self.n_heads, self.head_dim))
            self.__dict__["_fused_bias_view"] = held
        return held[2]


class GatedMLP(nn.Module):
    """proj(SiLU(gate) * up) with `fc` holding the gate rows first, then the up rows."""

    def __init__(self, n_embd: int, intermediate_size: int):
        super().__init__()
        self.fc = FlatLinear(n_embd, 2 * intermediate_size, bias=False)
        self.proj = FlatLinear(intermediate_size, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fc(x)
        half = both.shape[-1] // 2  # two slices: chunk's split dispatches twice the ops for the same views
        return self.proj(F.silu(both[..., :half]) * both[..., half:])


def attention(c: "RavenConfig", layer_id: int, rotate_half: bool, qk_norm: bool = False) -> CausalSelfAttention:
    return CausalSelfAttention(c.n_embd, c.n_heads, c.qk_bias, layer_id, n_kv_heads=c.num_key_value_heads,
                               head_dim=c.head_dim, qk_norm_eps=c.norm_eps if qk_norm else None,
                               rotate_half=rotate_half)


class SandwichBlock(nn.Module):
    """x̂ = n2(x + Attn(n1 x)); out = n4(x̂ + MLP(n3 x̂)), four learned RMSNorms (Huginn-0125)."""

    def __init__(self, c: "RavenConfig", layer_id: int, rotate_half: bool = False):
        super().__init__()
        self.norm_1 = RMSNorm(c.n_embd, c.norm_eps)
        self.attn = attention(c, layer_id, rotate_half)
        self.norm_2 = RMSNorm(c.n_embd, c.norm_eps)
        self.mlp = GatedMLP(c.n_embd, c.intermediate_size)
        self.norm_3 = RMSNorm(c.n_embd, c.norm_eps)
        self.norm_4 = RMSNorm(c.n_embd, c.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.feed(self.attend(x, rope, ctx))

    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.norm_2(x + self.attn(self.norm_1(x), rope, ctx))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class _TwoNormBlock(nn.Module):
    """The retrofitted blocks' modules: two RMSNorms, attention (with q/k norm where `qk_norm`), the MLP. A block
    is its attention sublayer, then its MLP sublayer (`attend`, `feed`: exit mode freeze runs them apart)."""

    qk_norm = False

    def __init__(self, c: "RavenConfig", layer_id: int, rotate_half: bool = True):
        super().__init__()
        self.norm_1 = RMSNorm(c.n_embd, c.norm_eps)
        self.attn = attention(c, layer_id, rotate_half, qk_norm=self.qk_norm)
        self.norm_2 = RMSNorm(c.n_embd, c.norm_eps)
        self.mlp = GatedMLP(c.n_embd, c.intermediate_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.feed(self.attend(x, rope, ctx))


class PreNormBlock(_TwoNormBlock):
    """x̂ = x + Attn(n1 x); out = x̂ + MLP(n2 x̂): a Llama decoder layer under Huginn's names (`norm_1` is
    Llama's input_layernorm, `norm_2` its post_attention_layernorm)."""

    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.attn(self.norm_1(x), rope, ctx)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm_2(x))


class PostNormBlock(_TwoNormBlock):
    """x̂ = x + n1(Attn(x)); out = x̂ + n2(MLP(x̂)), q and k RMSNormed: an OLMo-2 decoder layer under Huginn's
    names (`norm_1` is OLMo's post_attention_layernorm, `norm_2` its post_feedforward_layernorm)."""

    qk_norm = True

    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.norm_1(self.attn(x, rope, ctx))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm_2(self.mlp(x))
