"""Raven, the architecture of Huginn-0125 (Geiping et al. 2025), written from the paper (arXiv 2502.05171)
and its released checkpoint's layout (tomg-group-umd/huginn-0125).

    e  = prelude(sqrt(h) · wte(x))
    s0 ~ TruncNormal(0, (0.632 · init_scale)²)        (zeros when init_scale = 0)
    s_k = core(adapter([s_{k-1}; e]))                  k = 1 … r
    logits = lm_head(ln_f(coda(ln_f(s_r))))            lm_head tied to wte

The module tree mirrors Huginn's, so `state_dict()` has exactly its key names.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from .attention import AttnContext, apply_rope, cached_causal_attention, rope_table
from .looped import LoopedLM, LoopGroup, Stage, trunc_normal_

# Huginn's state: trunc-normal with variance 2/5 (huginn-0125.md §1.4).
STATE_STD = math.sqrt(2 / 5)

_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_heads"}


@dataclass
class RavenConfig:
    n_embd: int
    n_heads: int
    vocab_size: int
    intermediate_size: int
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    padded_vocab_size: int | None = None
    block_size: int = 4096
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    bias: bool = False
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    # exitbench's own: the deepest r the checkpoint is meant to run (sweeps, policy caps).
    max_recurrence: int | None = None
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "huginn_raven"

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.max_recurrence is None:
            self.max_recurrence = 2 * self.mean_recurrence
        self.validate()

    def validate(self) -> None:
        positive = ["n_embd", "n_heads", "vocab_size", "intermediate_size", "block_size", "padded_vocab_size",
                    "n_layers_in_recurrent_block", "mean_recurrence", "max_recurrence"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        for name in ["n_layers_in_prelude", "n_layers_in_coda", "mean_backprop_depth"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointError(f"config field {name} must be a non-negative integer, got {value!r}")
        if self.n_embd % self.n_heads or (self.n_embd // self.n_heads) % 2:
            raise CheckpointError(
                f"config n_embd={self.n_embd} must split into n_heads={self.n_heads} heads of even size")
        if self.padded_vocab_size < self.vocab_size:
            raise CheckpointError(f"config padded_vocab_size={self.padded_vocab_size} is below "
                                  f"vocab_size={self.vocab_size}")
        if self.bias:
            raise CheckpointError("config bias=true: Raven has no linear biases (only qk_bias); set bias to false")
        if self.max_recurrence < self.mean_recurrence:
            raise CheckpointError(f"config max_recurrence={self.max_recurrence} is below "
                                  f"mean_recurrence={self.mean_recurrence}")
        if self.init_scale < 0 or not math.isfinite(self.init_scale):
            raise CheckpointError(f"config init_scale must be a finite number ≥ 0, got {self.init_scale}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def n_layers(self) -> int:
        return self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda

    @property
    def effective_expected_depth(self) -> int:
        return self.n_layers_in_prelude + self.n_layers_in_coda + \
            self.n_layers_in_recurrent_block * self.mean_recurrence

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RavenConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            if key in known:
                kwargs[key] = value
            elif key not in _ALIASES:
                extra[key] = value
        for alias, name in _ALIASES.items():
            if alias in raw and name in raw and raw[alias] != raw[name]:
                raise CheckpointError(f"config.json has {name}={raw[name]!r} but {alias}={raw[alias]!r}; "
                                      "they name the same thing and must agree")
            if alias in raw:
                kwargs.setdefault(name, raw[alias])
        for required in ("n_embd", "n_heads", "vocab_size", "intermediate_size"):
            if required not in kwargs:
                raise CheckpointError(f"config.json lacks the field {required!r}, which a Raven model needs")
        for name in ("rope_base", "norm_eps", "init_scale"):
            if name in kwargs:
                value = kwargs[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CheckpointError(f"config field {name} must be a number, got {value!r}")
                kwargs[name] = float(value)
        for name in ("qk_bias", "bias", "tie_embeddings"):
            if name in kwargs and not isinstance(kwargs[name], bool):
                raise CheckpointError(f"config field {name} must be true or false, got {kwargs[name]!r}")
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update({
            "model_type": self.model_type,
            "architectures": ["RavenForCausalLM"],
            "n_layers": self.n_layers,
            "hidden_size": self.n_embd,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
        })
        extra = {k: v for k, v in self.extra.items() if k not in out}
        return {**extra, **out}


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


class Raven(LoopedLM):
    architecture = RavenConfig.model_type
    config_class = RavenConfig

    def __init__(self, config: RavenConfig):
        super().__init__()
        self.config = c = config
        n_pre, n_core = c.n_layers_in_prelude, c.n_layers_in_recurrent_block

        def block(layer_id: int) -> SandwichBlock:
            return SandwichBlock(c.n_embd, c.n_heads, c.intermediate_size, c.qk_bias, c.norm_eps, layer_id)

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.padded_vocab_size, c.n_embd),
            prelude=nn.ModuleList(block(i) for i in range(n_pre)),
            adapter=nn.Linear(2 * c.n_embd, c.n_embd, bias=False),
            core_block=nn.ModuleList(block(n_pre + j) for j in range(n_core)),
            coda=nn.ModuleList(block(n_pre + n_core + k) for k in range(c.n_layers_in_coda)),
            ln_f=RMSNorm(c.n_embd, c.norm_eps),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.padded_vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # Huginn stores this (1, block_size, 1, head_dim/2, 2) table in checkpoints; we recompute it.
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        self.emb_scale = math.sqrt(c.n_embd)
        self._stages = self._build_stages()

    def _freqs(self) -> torch.Tensor:
        c = self.config
        return rope_table(c.head_dim, c.block_size, c.rope_base)[None, :, None]

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device)."""
        self.freqs_cis = self._freqs().to(self.transformer.wte.weight.device)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        takase_init_(self, self.config.n_embd, self.config.effective_expected_depth, generator)

    # ---- the stage view the engine uses ----------------------------------------------------------
    @property
    def rope(self) -> torch.Tensor:
        return self.freqs_cis[0, :, 0]

    def _run_layers(self, layers: nn.ModuleList, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        rope = self.rope
        for layer in layers:
            x = layer(x, rope, ctx)
        return x

    def _init_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        std = STATE_STD * self.config.init_scale
        if noise is None or std == 0:
            return torch.zeros_like(e)
        return noise * std

    def _core_step(self, s: torch.Tensor, e: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self._run_layers(self.transformer.core_block, self.transformer.adapter(torch.cat([s, e], -1)), ctx)

    def _build_stages(self) -> list[Stage | LoopGroup]:
        t, c = self.transformer, self.config
        ids = lambda layers: [blk.attn.layer_id for blk in layers]  # noqa: E731
        return [
            Stage("prelude", lambda x, ctx: self._run_layers(t.prelude, x, ctx.at_iteration(0)), ids(t.prelude),
                  modules=[t.prelude]),
            LoopGroup("core_block", init=self._init_state, step=self._core_step, finish=t.ln_f,
                      attn_layers=ids(t.core_block), n_layers=len(t.core_block),
                      default_steps=c.mean_recurrence, max_steps=c.max_recurrence,
                      random_init=c.init_scale > 0, modules=[t.adapter, t.core_block]),
            Stage("coda", lambda x, ctx: self._run_layers(t.coda, x, ctx.at_iteration(0)), ids(t.coda), modules=[t.coda]),
        ]

    def stages(self) -> list[Stage | LoopGroup]:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer.wte(ids) * self.emb_scale  # positions enter through RoPE, in attention

    def layer_split(self) -> dict[str, int]:
        c = self.config
        return {"prelude": c.n_layers_in_prelude, "core": c.n_layers_in_recurrent_block, "coda": c.n_layers_in_coda}

    def parameter_breakdown(self) -> dict[str, int]:
        t = self.transformer
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        parts = {"embedding": count(t.wte), "prelude": count(t.prelude), "adapter": count(t.adapter),
                 "core": count(t.core_block), "coda": count(t.coda), "ln_f": count(t.ln_f)}
        if not self.config.tie_embeddings:
            parts["lm_head"] = count(self.lm_head)
        return parts

    @property
    def tied_head(self) -> bool:
        return self.config.tie_embeddings

    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """Tensors Huginn's files carry beyond our parameters: the RoPE table (and the tied head, via state_dict)."""
        return {"freqs_cis": self.freqs_cis}
