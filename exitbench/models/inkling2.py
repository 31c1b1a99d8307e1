"""Inkling 2 Mini (Thinking Machines, 2026; text model), a looped sparse-MoE transformer, written from the release's
checkpoint layout (`model.llm.*`, the names `save_pretrained` writes) with no remote code. The reference is
transformers' `inkling2_loop` (its model file; tests/test_inkling2.py holds parity with its outputs).

    prelude   layers [0, s)                      once
    core      layers [s, e), P passes (3)        every pass restarts from the prelude's output; pass p ≥ 2 reads
                                                 the previous pass's blocks through "messages" and their gates
    coda      layers [e, N)                      on the last pass's blocks
    logits  = 30 · tanh(unembed(norm(final_input(blocks))) / 30)

No residual stream: a layer's input is attention over depth ("block attention residuals"), a learned query attending
over the completed blocks and the current partial sum, each RMS-normalised; every `n_layers_per_attn_res_block`
layers (6) the partial sum becomes a block and a new one starts. Attention has no RoPE: a learned relative position
bias (per backward distance), sinks, L2-clipped queries and keys (full layers also log-scaled with position), keys
and values through short causal convolutions (dynamic, per-token taps in full layers), a gated output; sliding
layers see the last `sliding_window_size` positions. Each layer's MLP is 128 routed experts (top 8, sigmoid scores,
softcapped SwiGLU), and each output passes a short convolution too.

The loop step is one pass. The state is the blocks a pass leaves, [emb, b1, b2, b3] side by side: the coda reads
them (a readout after pass p is the coda on pass p's blocks) and the next pass's messages read b2 and b3.
The module tree keeps the release's names and layouts: the experts' `w13_weight` with gate and up rows interleaved,
the head padded to `vocab_size` rows (the first `unpadded_vocab_size` are read), the block-residual queries under
`attn_res`, the message queries as the two stacks the release stores.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from . import limits
from .attention import AttnContext, token_entries
from .hf_config import HFNames
from .looped import LoopedLM, LoopGroup, Stage

SLIDING, FULL = "hybrid_sliding", "hybrid"


@dataclass
class Inkling2Config(HFNames):
    hidden_size: int = 2304
    num_hidden_layers: int = 24
    vocab_size: int = 201024
    unpadded_vocab_size: int = 200058
    num_attention_heads: int = 24
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 24
    swa_num_key_value_heads: int = 8
    swa_head_dim: int = 128
    sliding_window_size: int = 1024
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int = 8192
    log_scaling_alpha: float = 0.1
    layer_types: list[str] | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    hidden_act: str = "silu"
    moe_intermediate_size: int = 1152
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    route_scale: float = 8.0
    qk_l2_clip_threshold: float = 22.627416997969522
    rel_l2_clip_threshold: float = 8.0
    n_layers_per_attn_res_block: int = 6
    mlp_gate_softcap: float = 4.0
    mlp_up_softcap: float = 25.0
    final_logit_softcapping: float = 30.0
    scoring_func: str = "sigmoid"
    loop_layer_index_start: int = 6
    loop_layer_index_end: int = 18
    loop_num_passes: int = 3
    loop_gate_rank: int = 64
    bos_token_id: int | None = None
    eos_token_id: int | None = 200006
    pad_token_id: int | None = None
    # exitbench's own: the most passes a run may ask for. Three were trained; more is extrapolation.
    max_passes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "inkling2_loop_text"
    hf_class = "Inkling2LoopForCausalLM"
    # The multimodal release: its text model's config under text_config (from_dict reads it there).
    model_type_aliases = ("inkling2_loop",)
    hf_aliases = ("Inkling2LoopForConditionalGeneration",)
    # The release's own names for some fields, read by from_dict (the multimodal file's blocks typed as such).
    read_also = {"sliding_window": int, "num_local_experts": int, "intermediate_size": int,
                 "routed_scaling_factor": float, "sconv_kernel_size": int, "loop_config": dict, "text_config": dict}

    def __post_init__(self):
        if self.layer_types is None and isinstance(self.num_hidden_layers, int):
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        if self.max_passes is None and isinstance(self.loop_num_passes, int):
            self.max_passes = self.loop_num_passes
        self.validate()

    def validate(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "unpadded_vocab_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads",
                     "swa_head_dim", "sliding_window_size", "d_rel", "rel_extent", "conv_kernel_size",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_layers_per_attn_res_block",
                     "loop_num_passes", "loop_gate_rank", "max_passes", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        block, start, end = self.n_layers_per_attn_res_block, self.loop_layer_index_start, self.loop_layer_index_end
        if not (0 < start < end <= self.num_hidden_layers) or start % block or end % block:
            raise CheckpointError(f"config loop layers [{start}, {end}) must lie within the {self.num_hidden_layers} "
                                  f"layers, after the first, at multiples of n_layers_per_attn_res_block={block}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise CheckpointError(f"config layer_types must name each of the {self.num_hidden_layers} layers "
                                  f"{SLIDING!r} or {FULL!r}, got {self.layer_types!r}")
        if self.unpadded_vocab_size > self.vocab_size:
            raise CheckpointError(f"config unpadded_vocab_size={self.unpadded_vocab_size} exceeds vocab_size="
                                  f"{self.vocab_size} (the head keeps the first unpadded_vocab_size rows)")
        if self.scoring_func != "sigmoid" or self.hidden_act != "silu":
            raise CheckpointError(f"config scoring_func={self.scoring_func!r}, hidden_act={self.hidden_act!r}: only "
                                  "Inkling 2's sigmoid router and SiLU-gated experts are implemented")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise CheckpointError(f"config num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts="
                                  f"{self.n_routed_experts}")
        if self.max_passes < self.loop_num_passes:
            raise CheckpointError(f"config max_passes={self.max_passes} is below loop_num_passes="
                                  f"{self.loop_num_passes}")
        limits.loop_steps("max_passes", self.max_passes)
        limits.norm_eps("rms_norm_eps", self.rms_norm_eps)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Inkling2Config":
        if raw.get("model_type") == "inkling2_loop":  # the multimodal release: its text model's config
            raw = {**raw.get("text_config", {}), **{k: raw[k] for k in ("max_passes",) if k in raw}}
        raw = dict(raw)
        loop = raw.pop("loop_config", None) or {}  # the release's loop fields, as transformers reads them
        for ours, theirs in (("loop_layer_index_start", "core_start"), ("loop_layer_index_end", "core_end"),
                             ("loop_num_passes", "num_passes"), ("loop_gate_rank", "gate_rank")):
            if theirs in loop:
                raw[ours] = loop[theirs]
        for alias, name in (("sliding_window", "sliding_window_size"), ("num_local_experts", "n_routed_experts"),
                            ("intermediate_size", "moe_intermediate_size"), ("routed_scaling_factor", "route_scale"),
                            ("sconv_kernel_size", "conv_kernel_size")):
            if alias in raw and name not in raw:
                raw[name] = raw.pop(alias)
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in raw.items() if k in known},
                   extra={k: v for k, v in raw.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update({"model_type": self.model_type, "architectures": [self.hf_class]})
        return {**{k: v for k, v in self.extra.items() if k not in out}, **out}


# ---- the pieces ---------------------------------------------------------------------------------------------------

def unweighted_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each vector scaled down to norm `threshold` when longer, in float32."""
    h = x.float()
    norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    return (h * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def log_scale(x: torch.Tensor, positions: torch.Tensor, c: Inkling2Config) -> torch.Tensor:
    """× (1 + α · log(max((pos + 1) / n_floor, 1))) per position: full layers' queries and relative states."""
    scale = 1.0 + c.log_scaling_alpha * torch.log(((positions + 1).float() / c.log_scaling_n_floor).clamp(min=1.0))
    return (x.float() * scale[..., None, None]).to(x.dtype)


def depth_attention(queries: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """Attention over depth: (…, q, H) learned queries over the RMS-normalised blocks (…, n, H) and the current
    partial sum (…, H), in float32; (…, q, H), a weighted mix of the normalised states."""
    stacked = unweighted_rms(torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).float())
    weights = torch.softmax(queries.float() @ stacked.transpose(-1, -2) * stacked.shape[-1] ** -0.5, dim=-1,
                            dtype=torch.float32)
    return weights @ stacked


def state_layer(c: Inkling2Config, layer: int, which: int) -> int:
    """The cache layer of layer `layer`'s convolution inputs `which` (0 keys, 1 values, 2 after attention, 3 after
    the MLP): after the attention layers' ids, four per layer."""
    return c.num_hidden_layers + 4 * layer + which


def conv_context(x: torch.Tensor, ctx: AttnContext, state_id: int, kernel: int) -> torch.Tensor:
    """A short convolution's window: (B, K − 1 + T, C) float32 of the K − 1 inputs before each row's chunk at the
    same layer visit (zeros before the sequence) and the chunk's own x (B, T, C). With a cache, x is kept in cache
    layer `state_id` at the visit's slot, where later tokens read it, as they read keys; one token per row in token
    mode (T = 1), each at its own position."""
    B, T, C = x.shape
    if ctx.cache is None:
        return F.pad(x.float(), (0, 0, kernel - 1, 0))
    entry = x.unsqueeze(1)  # one "head" as wide as the input
    if ctx.index is None:
        kept, _ = ctx.cache.update(state_id, ctx.iteration, ctx.rows, ctx.start, entry, entry)
        kept = kept[:, 0, max(0, ctx.start - kernel + 1):].float()
        return F.pad(kept, (0, 0, kernel - 1 + T - kept.shape[1], 0))
    kept, _ = token_entries(ctx, state_id, entry, entry)  # (n, 1, length, C)
    back = ctx.positions.unsqueeze(1) - torch.arange(kernel - 1, -1, -1, device=x.device)  # oldest … own
    window = kept[:, 0].gather(1, back.clamp(min=0).unsqueeze(-1).expand(-1, -1, C)).float()
    return window.masked_fill((back < 0).unsqueeze(-1), 0.0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Scale(nn.Module):
    """A learned per-(head, dim) scale before an L2 clip (the release's `*_l2_clip.scale`)."""

    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(heads, dim))


class Projection(nn.Module):
    """The release's `rel_logits_proj`: relative states (d_rel) → a logit per backward distance."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, extent))


class StaticConv(nn.Module):
    """A depthwise causal convolution of kernel K over positions plus the input, / √(K + 1), in float32."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x: torch.Tensor, ctx: AttnContext, state_id: int) -> torch.Tensor:
        h = x.float()
        K = self.weight.shape[-1]
        window = conv_context(x, ctx, state_id, K).transpose(1, 2)
        out = F.conv1d(window.to(self.weight.dtype), self.weight, groups=h.shape[-1]).to(h.dtype).transpose(1, 2)
        return ((out + h) / math.sqrt(K + 1)).to(x.dtype)


class DynamicConv(nn.Module):
    """Full layers' key / value convolution: static taps (K, C) plus per-token, per-head taps projected from the
    projection's input, then the input added, / √(2K + 1), in float32."""

    @property
    def token_flops(self) -> int:
        return 2 * self.weight_proj.numel()  # the per-token taps (the convolution itself is O(width))

    def __init__(self, channels: int, heads: int, input_size: int, kernel: int):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        self.static_w = nn.Parameter(torch.zeros(kernel, channels))
        self.weight_proj = nn.Parameter(torch.empty(heads * kernel, input_size))

    def forward(self, x: torch.Tensor, source: torch.Tensor, ctx: AttnContext, state_id: int) -> torch.Tensor:
        B, T, C = x.shape
        K = self.kernel
        taps = F.linear(source, self.weight_proj).float().view(B, T, self.heads, 1, K)
        taps = self.static_w.float().T.view(self.heads, -1, K) + taps
        h = x.float()
        context = conv_context(x, ctx, state_id, K).transpose(1, 2)
        windows = context.unfold(-1, K, 1).flip(-1).transpose(1, 2).reshape(B, T, self.heads, -1, K)
        out = (windows * taps).sum(-1).reshape(B, T, C)
        return ((out + h) / math.sqrt(2 * K + 1)).to(x.dtype)


class Attention(nn.Module):
    """Sliding or full attention with relative position bias and sinks; no RoPE. Nothing is computed from positions
    but the bias's distances, the full layers' log scaling and the sliding window."""

    def __init__(self, c: Inkling2Config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.sliding = c.layer_types[layer_id] == SLIDING
        self.n_heads = c.swa_num_attention_heads if self.sliding else c.num_attention_heads
        self.n_kv = c.swa_num_key_value_heads if self.sliding else c.num_key_value_heads
        self.head_dim = c.swa_head_dim if self.sliding else c.head_dim
        self.extent = c.sliding_window_size if self.sliding else c.rel_extent
        self.c = c
        H, q, kv = c.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.wq_du = nn.Linear(H, q, bias=False)
        self.wk_dv = nn.Linear(H, kv, bias=False)
        self.wv_dv = nn.Linear(H, kv, bias=False)
        self.wo_ud = nn.Linear(q, H, bias=False)
        self.gate_attn = nn.Linear(H, q, bias=False)
        self.attn_sink_proj = nn.Linear(H, self.n_heads, bias=False)
        self.wr_du = nn.Linear(H, self.n_heads * c.d_rel, bias=False)
        self.q_l2_clip = Scale(self.n_heads, self.head_dim)
        self.rel_l2_clip = Scale(self.n_heads, c.d_rel)
        self.rel_logits_proj = Projection(c.d_rel, self.extent)
        if self.sliding:
            self.k_sconv, self.v_sconv = StaticConv(kv, c.conv_kernel_size), StaticConv(kv, c.conv_kernel_size)
        else:
            self.k_sconv = DynamicConv(kv, self.n_kv, H, c.conv_kernel_size)
            self.v_sconv = DynamicConv(kv, self.n_kv, H, c.conv_kernel_size)

    def _clipped(self, x: torch.Tensor, scale: torch.Tensor, threshold: float, positions: torch.Tensor) -> torch.Tensor:
        out = l2_clip(x.float() * scale.float(), threshold).to(x.dtype)
        return out if self.sliding else log_scale(out, positions, self.c)

    def _conv(self, conv: nn.Module, x: torch.Tensor, source: torch.Tensor, ctx: AttnContext, which: int
              ) -> torch.Tensor:
        state = state_layer(self.c, self.layer_id, which)
        return conv(x, ctx, state) if self.sliding else conv(x, source, ctx, state)

    def forward(self, hq: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        c = self.c
        B, T, _ = hq.shape
        token_mode = ctx.index is not None
        # (B, T) positions of the queries: a chunk's from its start, or one per row in token mode
        positions = ctx.positions.view(B, 1) if token_mode else \
            torch.arange(ctx.start, ctx.start + T, device=hq.device)[None]
        q = self._clipped(self.wq_du(hq).view(B, T, self.n_heads, -1), self.q_l2_clip.scale, c.qk_l2_clip_threshold,
                          positions).transpose(1, 2)
        k = self._conv(self.k_sconv, self.wk_dv(hk), hk, ctx, 0).view(B, T, self.n_kv, -1)
        k = l2_clip(k, c.qk_l2_clip_threshold).transpose(1, 2)
        v = unweighted_rms(self._conv(self.v_sconv, self.wv_dv(hv), hv, ctx, 1).view(B, T, self.n_kv, -1),
                           c.rms_norm_eps).transpose(1, 2)
        if token_mode:
            k, v = token_entries(ctx, self.layer_id, k, v)
        elif ctx.cache is not None:
            k, v = ctx.cache.update(self.layer_id, ctx.iteration, ctx.rows, ctx.start, k, v)
        group = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(2, 3) * self.head_dim ** -0.5
        # (B or 1, T, keys): how far back each key lies from each query (keys are positions 0 … in both modes)
        distance = positions[:, :, None] - torch.arange(k.shape[2], device=hq.device)
        scores = scores + self._position_bias(hq, distance.unsqueeze(1), positions)
        distance = distance.unsqueeze(1)
        allowed = distance >= 0
        if self.sliding:
            allowed &= distance < c.sliding_window_size
        # an additive mask of 0 and the dtype's minimum, as the reference adds it
        scores = scores + torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device).masked_fill(
            ~allowed, torch.finfo(scores.dtype).min)
        sinks = self.attn_sink_proj(hq).transpose(1, 2).unsqueeze(-1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
        out = (weights @ v).transpose(1, 2).reshape(B, T, -1)
        gate = torch.sigmoid(self.gate_attn(hq).float())
        return self.wo_ud((out.float() * gate).to(out.dtype))

    def _position_bias(self, h: torch.Tensor, distance: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, heads, T, keys): a learned logit per backward distance below the extent, read per query."""
        B, T, _ = h.shape
        rel = self._clipped(self.wr_du(h).view(B, T, self.n_heads, -1), self.rel_l2_clip.scale,
                            self.c.rel_l2_clip_threshold, positions)
        logits = (rel @ self.rel_logits_proj.proj).transpose(1, 2)
        index = distance.clamp(0, self.extent - 1).expand(logits.shape[0], logits.shape[1], -1, -1)
        bias = logits.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= self.extent), 0.0)


class Experts(nn.Module):
    """The routed experts as the release stores them: w13 with gate and up rows interleaved, w2."""

    def __init__(self, c: Inkling2Config):
        super().__init__()
        E, H, inner = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * inner, H))
        self.w2_weight = nn.Parameter(torch.empty(E, H, inner))


class Router(nn.Module):
    def __init__(self, c: Inkling2Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.bias = nn.Parameter(torch.zeros(c.n_routed_experts))  # steers the choice only (e_score_correction)


class MoE(nn.Module):
    def __init__(self, c: Inkling2Config):
        super().__init__()
        self.c = c
        self.gate = Router(c)
        self.experts = Experts(c)

    @property
    def token_flops(self) -> int:
        """A token's matmuls here: the router over every expert, then its chosen experts' w13 and w2."""
        c = self.c
        return 2 * (c.n_routed_experts * c.hidden_size + c.num_experts_per_tok * 3 * c.moe_intermediate_size
                    * c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, shape = self.c, x.shape
        flat = x.reshape(-1, shape[-1])
        scores = torch.sigmoid(F.linear(flat.float(), self.gate.weight.float()))
        chosen = torch.topk(scores + self.gate.bias.float(), c.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * c.route_scale
        out = torch.zeros_like(flat, dtype=torch.float32)
        # Experts in ascending order, each adding its tokens' outputs: the reference's summation order.
        for e in torch.unique(chosen).tolist():
            slot, token = torch.where(chosen.T == e)
            # w13's rows interleave gate and up: the product's even and odd columns, no copy of the weights
            gate_up = F.linear(flat[token], self.experts.w13_weight[e]).float()
            g, u = gate_up[:, 0::2], gate_up[:, 1::2]
            act = (softcap(g, c.mlp_gate_softcap) * torch.sigmoid(g) * softcap(u, c.mlp_up_softcap)).to(x.dtype)
            y = F.linear(act, self.experts.w2_weight[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.to(x.dtype).view(shape)


class MessageGate(nn.Module):
    """The release's "controller": (1 − tanh(F z)) · h + tanh(G z) · m with z = down([rms h; rms m]). It halts
    nothing: it mixes the previous pass's message m into the layer's input h."""

    @property
    def token_flops(self) -> int:
        return 2 * (self.down_weight.numel() + self.forget_weight.numel() + self.gain_weight.numel())

    def __init__(self, c: Inkling2Config):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.down_weight = nn.Parameter(torch.empty(c.loop_gate_rank, 2 * c.hidden_size))
        self.forget_weight = nn.Parameter(torch.empty(c.hidden_size, c.loop_gate_rank))
        self.gain_weight = nn.Parameter(torch.empty(c.hidden_size, c.loop_gate_rank))

    def forward(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h, m = h.float(), m.float()
        z = torch.cat([unweighted_rms(h, self.eps), unweighted_rms(m, self.eps)], dim=-1)
        z = F.linear(z.to(self.down_weight.dtype), self.down_weight).float()
        forget = torch.tanh(F.linear(z, self.forget_weight.float()))
        gain = torch.tanh(F.linear(z, self.gain_weight.float()))
        return (1 - forget) * h + gain * m


class Layer(nn.Module):
    def __init__(self, c: Inkling2Config, i: int):
        super().__init__()
        self.c, self.index, self.boundary = c, i, i % c.n_layers_per_attn_res_block == 0
        self.sliding = c.layer_types[i] == SLIDING
        self.attn = Attention(c, i)
        if self.sliding:
            self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        else:
            self.q_input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.k_input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.v_input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_sconv = StaticConv(c.hidden_size, c.conv_kernel_size)
        self.mlp_sconv = StaticConv(c.hidden_size, c.conv_kernel_size)
        self.mlp = MoE(c)
        if c.loop_layer_index_start <= i < c.loop_layer_index_end:
            self.controllers = nn.ModuleDict({name: MessageGate(c) for name in ("attn", "k", "v", "mlp")})

    def forward(self, h: torch.Tensor, blocks: torch.Tensor, attn_query: torch.Tensor | None,
                mlp_query: torch.Tensor, ctx: AttnContext, messages: torch.Tensor | None = None,
                unmessaged: torch.Tensor | None = None) -> torch.Tensor:
        """`messages` (…, 4, H): the previous pass's, for a pass after the first; `unmessaged` (rows,): rows that
        are on their first pass all the same (tokens at different passes in one step)."""
        dtype = h.dtype
        partial = h
        # layer 0 reads the embedding itself; every other layer its input from depth
        hq, hk, hv = (h, h, h) if attn_query is None else self._inputs(attn_query, blocks, h)

        def gate(name: str, x: torch.Tensor, which: int) -> torch.Tensor:
            if messages is None:
                return x
            mixed = self.controllers[name](x, messages[..., which, :])
            return mixed if unmessaged is None else torch.where(unmessaged.view(-1, 1, 1), x.float(), mixed)

        if self.sliding:
            hq, hk, hv = (self.attn_norm(gate(n, hq, w)) for w, n in enumerate(("attn", "k", "v")))
        else:
            hq, hk, hv = gate("attn", hq, 0), gate("k", hk, 1), gate("v", hv, 2)
            hq, hk, hv = self.q_input_norm(hq), self.k_input_norm(hk), self.v_input_norm(hv)
        out = self.attn_sconv(self.attn(hq.to(dtype), hk.to(dtype), hv.to(dtype), ctx), ctx,
                              state_layer(self.c, self.index, 2)).float()
        if self.boundary:
            blocks = torch.cat([blocks, partial.unsqueeze(-2)], dim=-2)
            residual = out
        else:
            residual = out = partial.float() + out
        x = gate("mlp", depth_attention(mlp_query.view(1, -1), blocks, out)[..., 0, :], 3)
        y = self.mlp_sconv(self.mlp(self.mlp_norm(x).to(dtype)), ctx, state_layer(self.c, self.index, 3))
        return (residual + y).to(dtype)

    def _inputs(self, query: torch.Tensor, blocks: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The attention's inputs from depth: one (sliding: q = k = v before the gates) or three (full)."""
        mixed = depth_attention(query.view(-1, h.shape[-1]), blocks, h)
        return (mixed[..., 0, :],) * 3 if self.sliding else mixed.unbind(-2)


class AttnRes(nn.Module):
    """The block-residual queries as the release names them: per layer > 0 its attention input's (index i − 1;
    three in full layers), per layer its MLP input's, and the final one."""

    def __init__(self, c: Inkling2Config):
        super().__init__()
        H = c.hidden_size
        self.attn_queries = nn.ParameterList(
            nn.Parameter(torch.zeros(H) if c.layer_types[i] == SLIDING else torch.zeros(3, H))
            for i in range(1, c.num_hidden_layers))
        self.mlp_queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(c.num_hidden_layers))
        self.output_query = nn.Parameter(torch.zeros(H))


class Inkling2Text(nn.Module):
    def __init__(self, c: Inkling2Config):
        super().__init__()
        H, loop = c.hidden_size, c.loop_layer_index_end - c.loop_layer_index_start
        self.embed = nn.Embedding(c.vocab_size, H)
        self.embed_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.unembed = nn.Linear(H, c.vocab_size, bias=False)
        self.attn_res = AttnRes(c)
        # Message queries, as stored: per loop layer its [q, mlp] pair, and its [k, v] pair.
        self.middle_cycle_cross_pass_queries = nn.Parameter(torch.zeros(2 * loop, H))
        self.middle_cycle_cross_pass_kv_queries = nn.Parameter(torch.zeros(2 * loop, H))


class Inkling2(LoopedLM):
    config_class = Inkling2Config

    def __init__(self, config: Inkling2Config):
        super().__init__(config)
        self.model = nn.ModuleDict(dict(llm=Inkling2Text(config)))
        self._stages = self._build_stages()

    @property
    def llm(self) -> Inkling2Text:
        return self.model.llm

    # What the reference keeps in float32 under any dtype (its _keep_in_fp32_modules_strict), by the release's names:
    # the router and its bias, the post-attention and post-MLP convolutions, the sliding layers' key and value
    # convolutions, every depth query (block residuals and messages) and the message gates' output projections.
    FLOAT32 = ("mlp.gate.weight", "mlp.gate.bias", "attn_sconv.weight", "mlp_sconv.weight", "attn.k_sconv.weight",
               "attn.v_sconv.weight", "forget_weight", "gain_weight")

    @property
    def dtype(self) -> torch.dtype:
        """The run's dtype: the embedding's (its first parameters are depth queries, float32 under any dtype)."""
        return self.llm.embed.weight.dtype

    def float32_keys(self) -> set[str]:
        return {k for k in self.state_dict() if k.endswith(self.FLOAT32) or ".attn_res." in k
                or ".middle_cycle_cross_pass_" in k}

    @classmethod
    def adapt_checkpoint(cls, tensors: dict, config) -> dict:
        """The text model's tensors: the release's vision tower (`model.visual.*`) is left out."""
        return {k: v for k, v in tensors.items() if not k.startswith("model.visual.")}

    # ---- blocks, packed: a stage boundary carries the blocks and the partial sum side by side ----------------
    def _unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = x.unflatten(-1, (-1, self.config.hidden_size))
        return parts[..., :-1, :], parts[..., -1, :]

    @staticmethod
    def _pack(blocks: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).flatten(-2)

    def _layers(self, lo: int, hi: int, x: torch.Tensor, ctx: AttnContext,
                messages: list[torch.Tensor] | None = None, unmessaged: torch.Tensor | None = None) -> torch.Tensor:
        """Layers [lo, hi) on packed (blocks, partial); returns the same packing one layer group on."""
        llm = self.llm
        blocks, h = self._unpack(x)
        for n, i in enumerate(range(lo, hi)):
            query = llm.attn_res.attn_queries[i - 1] if i else None
            layer = llm.layers[i]
            out = layer(h, blocks, query, llm.attn_res.mlp_queries[i], ctx,
                        None if messages is None else messages[n], unmessaged)
            if layer.boundary:
                blocks = torch.cat([blocks, h.unsqueeze(-2)], dim=-2)
            h = out
        return self._pack(blocks, h)

    def _messages(self, s: torch.Tensor) -> list[torch.Tensor]:
        """Per loop layer, four messages (q, k, v, mlp) from the previous pass's blocks after b1 and its output."""
        c, llm = self.config, self.llm
        blocks, h = self._unpack(s)
        first = c.loop_layer_index_start // c.n_layers_per_attn_res_block + 1
        pairs = llm.middle_cycle_cross_pass_queries.unflatten(0, (-1, 2))
        kv = llm.middle_cycle_cross_pass_kv_queries.unflatten(0, (-1, 2))
        queries = torch.cat([pairs[:, :1], kv, pairs[:, 1:]], dim=1)  # (loop layers, 4, H): q, k, v, mlp
        return [depth_attention(q, blocks[..., first:, :], h) for q in queries]

    def _prelude(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        no_blocks = x.new_zeros(*x.shape[:-1], 0, x.shape[-1])
        return self._layers(0, self.config.loop_layer_index_start, self._pack(no_blocks, x), ctx.at_iteration(0))

    def _init(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Before the first pass: the prelude's blocks and output, zeros where the pass's blocks will be."""
        c = self.config
        later = (c.loop_layer_index_end - c.loop_layer_index_start) // c.n_layers_per_attn_res_block
        return torch.cat([x, x.new_zeros(*x.shape[:-1], later * c.hidden_size)], dim=-1)

    def _pass(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """One pass of the core from the prelude's output x; from the second on, with messages from s."""
        c = self.config
        if isinstance(ctx.iteration, int):
            messages, unmessaged = (None if ctx.iteration == 0 else self._messages(s)), None
        else:  # one iteration per token (the engine's rows advance on their own): first passes take none
            unmessaged = ctx.iteration == 0
            messages = self._messages(s)
        return self._layers(c.loop_layer_index_start, c.loop_layer_index_end, x, ctx, messages, unmessaged)

    def _coda(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        c, llm = self.config, self.llm
        # (a plain stage: its one slot, whichever iteration a probe reads it after)
        blocks, h = self._unpack(self._layers(c.loop_layer_index_end, c.num_hidden_layers, x, ctx.at_iteration(0)))
        # (float32, as the final norm reads it: the head casts after the norm)
        return depth_attention(llm.attn_res.output_query.view(1, -1), blocks, h)[..., 0, :]

    def _build_stages(self) -> list:
        c, llm = self.config, self.llm
        s, e = c.loop_layer_index_start, c.loop_layer_index_end
        ids = lambda lo, hi: list(range(lo, hi))  # noqa: E731
        states = lambda lo, hi: [state_layer(c, i, w) for i in range(lo, hi) for w in range(4)]  # noqa: E731
        return [Stage("prelude", self._prelude, ids(0, s), modules=list(llm.layers[:s]), state_layers=states(0, s)),
                LoopGroup("core", init=self._init, step=self._pass, finish=lambda state: state, attn_layers=ids(s, e),
                          n_layers=e - s, default_steps=c.loop_num_passes, max_steps=c.max_passes,
                          modules=list(llm.layers[s:e]), state_layers=states(s, e)),
                Stage("coda", self._coda, ids(e, c.num_hidden_layers), modules=list(llm.layers[e:]),
                      state_layers=states(e, c.num_hidden_layers))]

    def state_geometry(self) -> dict[int, tuple[int, int]]:
        """Each layer's four convolution inputs, one "head" each: keys' and values' (key/value width), after
        attention and after the MLP (hidden width)."""
        c, out = self.config, {}
        for i, layer in enumerate(self.llm.layers):
            width = layer.attn.n_kv * layer.attn.head_dim
            out.update({state_layer(c, i, w): (1, width if w < 2 else c.hidden_size) for w in range(4)})
        return out

    def stages(self) -> list:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.llm.embed_norm(self.llm.embed(ids))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        llm = self.llm
        weight = llm.unembed.weight[: self.config.unpadded_vocab_size]
        logits = F.linear(llm.norm(x).to(weight.dtype), weight).float()
        return softcap(logits, self.config.final_logit_softcapping)

    def head_modules(self) -> list[nn.Module]:
        return [self.llm.unembed]

    @property
    def output_size(self) -> int:
        return self.config.unpadded_vocab_size

    def cache_geometry(self) -> tuple[int, int]:
        return self.config.num_key_value_heads, self.config.head_dim

    def layer_split(self) -> dict[str, int]:
        c = self.config
        return {"prelude": c.loop_layer_index_start, "core": c.loop_layer_index_end - c.loop_layer_index_start,
                "coda": c.num_hidden_layers - c.loop_layer_index_end}

    def parameter_breakdown(self) -> dict[str, int]:
        llm = self.llm
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        experts = sum(count(layer.mlp.experts) for layer in llm.layers)
        return {"embedding": count(llm.embed), "experts": experts,
                "layers": count(llm.layers) - experts, "unembed": count(llm.unembed),
                "norms and queries": count(llm.embed_norm) + count(llm.norm) + count(llm.attn_res)
                + llm.middle_cycle_cross_pass_queries.numel() + llm.middle_cycle_cross_pass_kv_queries.numel()}

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """N(0, std) for every weight, norms 1, clip scales 1 + N(0, 0.1); the parameters the reference starts at
        zero (block and message queries, dynamic-conv static taps, router bias) drawn too, so a parity test
        exercises them."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".scale"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
                elif "queries" in name or name.endswith("output_query"):
                    p.normal_(0.0, 1.0, generator=generator)
                else:
                    p.normal_(0.0, std, generator=generator)
