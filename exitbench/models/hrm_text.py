"""HRM-Text (Sapient Intelligence; HRM: Wang et al., arXiv 2506.21734), a hierarchical looped LM, written from its
published checkpoint's layout (sapientinc/HRM-Text-1B) with no remote code.

    z_H = embed_tokens(ids) · embedding_scale;   z_L = z_L_init           (a learned vector, at every position)
    for each H cycle (H_cycles = 2):
        for each L cycle (L_cycles = 3):   z_L = L_stack(z_L + z_H)
        z_H = H_stack(z_H + z_L)
    logits = lm_head(z_H)                                                  untied, no further norm

The two stacks are Llama pre-norm layers followed by a final norm, every norm parameterless (x · rsqrt(mean x² +
eps)), with gated multi-head attention: sigmoid(gate_proj x) scales the attention output per head channel before
o_proj. On disk the projections are fused (`attn.gqkv_proj`: gate, q, k, v rows; `mlp.gate_up_proj`: gate, up),
and the module tree keeps those names, so `state_dict()` is the file's keys exactly.

The loop step is one H cycle: both states leave it normed, and z_H after any cycle is read out by lm_head alone,
the same function as the final readout, so a token may stop after any cycle. The engine's state is z_H and z_L
side by side (2 · hidden wide): the next cycle reads both, so both are what "settled" means to a latent rule.
Each stack call within a cycle keeps its own keys and values: L_cycles + 1 calls of `num_layers_per_stack` layers,
(L_cycles + 1) · n cache layers per cycle, one slot per cycle (the reference's `(h·(L+1) + l)·n + j`).

Prefix-LM (`prefix_lm`, the trained objective): a prompt's tokens form one bidirectional block, everything after
it is causal. The engine prefills the prompt (a scoring request's context) as that block; `forward(prefix=…)`
gives the same for whole sequences (transformers' `token_type_ids` = 1 on the prompt).

`num_hidden_layers` in a saved config is transformers' slot count, per_stack · H_cycles · (L_cycles + 1) (128 at
release): the layer count is `num_layers_per_stack` (16), as transformers reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from . import limits
from .attention import AttnContext, rotary_attention
from .hf_blocks import HFLoopedLM, normed_loop_grids
from .hf_config import HFNamedConfig, refuse_set
from .looped import LoopGroup


@dataclass
class HrmTextConfig(HFNamedConfig):
    head_dim: int | None = 128
    rope_theta: float = 1e4
    max_position_embeddings: int = 2048
    num_layers_per_stack: int | None = None
    H_cycles: int = 2
    L_cycles: int = 3
    L_bp_cycles: list[int] | None = None  # which L cycles train with gradients: kept, no effect at inference
    embedding_scale: float | None = None
    initializer_range: float = 0.02
    prefix_lm: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_parameters: dict | None = None
    # exitbench's own: the deepest H-cycle count a run may ask for. Only H_cycles was trained; nothing published
    # says whether more cycles help, so deeper runs are extrapolation, allowed because that is a question.
    max_H_cycles: int | None = None

    model_type = "hrm_text"
    family = "HRM-Text"
    hf_class = "HrmTextForCausalLM"
    loop_positive = ("num_layers_per_stack", "H_cycles", "L_cycles", "max_H_cycles")
    depth_field, max_depth_field = "H_cycles", "max_H_cycles"

    def __post_init__(self):
        if self.num_layers_per_stack is None:
            # A config written before the split (or by hand): num_hidden_layers is then the per-stack count, as
            # transformers reads it on first construction.
            self.num_layers_per_stack = self.num_hidden_layers
            if all(isinstance(v, int) for v in (self.num_hidden_layers, self.H_cycles, self.L_cycles)):
                self.num_hidden_layers = self.slots_per_token
        if self.embedding_scale is None and isinstance(self.initializer_range, (int, float)) \
                and self.initializer_range > 0:
            self.embedding_scale = 1.0 / self.initializer_range
        if self.rope_parameters:
            self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
        self.fill_depth()
        self.num_key_value_heads = self.num_attention_heads  # multi-head attention: the class has no such field
        self.validate()

    @property
    def slots_per_token(self) -> int:
        """Attention invocations of one token at the trained depth: what transformers calls num_hidden_layers."""
        return self.num_layers_per_stack * self.H_cycles * (self.L_cycles + 1)

    def validate(self) -> None:
        super().validate()
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(f"config hidden_size={self.hidden_size} must be a multiple of num_attention_heads="
                                  f"{self.num_attention_heads} (the reference refuses to build it otherwise)")
        if not isinstance(self.embedding_scale, (int, float)) or isinstance(self.embedding_scale, bool):
            raise CheckpointError(f"config embedding_scale must be a number (or null with initializer_range > 0), "
                                  f"got {self.embedding_scale!r}")
        limits.loop_steps("L_cycles", self.L_cycles)

    @classmethod
    def refuse(cls, raw: dict[str, Any]) -> None:
        refuse_set(raw, ("attention_bias", "mlp_bias"),
                   "HRM-Text's projections have no biases (the released checkpoint has none)")
        rope = raw.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind != "default":
            raise CheckpointError(f"config rope_parameters={rope!r}: only plain RoPE (rope_type default) is "
                                  "implemented, which is what HRM-Text-1B uses")


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The parameterless RMSNorm every norm of HRM-Text is, in float32 and cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class HrmTextAttention(nn.Module):
    """Multi-head attention with a per-channel output gate; `layer_id` is the layer's place in its stack (a stack
    call's cache layer is that plus the call's offset, `cache_id`)."""

    def __init__(self, c: HrmTextConfig, layer_id: int):
        super().__init__()
        self.n_heads, self.head_dim, self.layer_id = c.num_attention_heads, c.head_dim, layer_id
        width = c.num_attention_heads * c.head_dim
        self.gqkv_proj = nn.Linear(c.hidden_size, 4 * width, bias=False)
        self.o_proj = nn.Linear(width, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext, cache_id: int) -> torch.Tensor:
        B, T, _ = x.shape
        gate, q, k, v = self.gqkv_proj(x).chunk(4, dim=-1)
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim)  # noqa: E731
        y = rotary_attention(heads(q), heads(k), heads(v), rope, ctx, cache_id, halves=True)
        return self.o_proj(torch.sigmoid(gate) * y)


class HrmTextMLP(nn.Module):
    def __init__(self, c: HrmTextConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HrmTextLayer(nn.Module):
    def __init__(self, c: HrmTextConfig, layer_id: int):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.attn = HrmTextAttention(c, layer_id)
        self.mlp = HrmTextMLP(c)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext, cache_id: int) -> torch.Tensor:
        h = x + self.attn(rms_norm(x, self.eps), rope, ctx, cache_id)
        return h + self.mlp(rms_norm(h, self.eps))


class HrmTextStack(nn.Module):
    """The H or the L module: its layers, then a final (parameterless) norm."""

    def __init__(self, c: HrmTextConfig):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.layers = nn.ModuleList(HrmTextLayer(c, i) for i in range(c.num_layers_per_stack))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext, offset: int) -> torch.Tensor:
        for j, layer in enumerate(self.layers):
            x = layer(x, rope, ctx, offset + j)
        return rms_norm(x, self.eps)


class HrmText(HFLoopedLM):
    config_class = HrmTextConfig

    def __init__(self, config: HrmTextConfig):
        super().__init__(config)
        # Frozen in transformers, a persistent buffer in the original: a weight either way, never trained here.
        self.model.z_L_init = nn.Parameter(torch.zeros(config.hidden_size), requires_grad=False)

    def family_modules(self, c: HrmTextConfig) -> dict[str, nn.Module]:
        return dict(H_module=HrmTextStack(c), L_module=HrmTextStack(c))

    @property
    def prefix_lm(self) -> bool:
        return bool(self.config.prefix_lm)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """N(0, std) for every matrix and the embedding; z_L_init N(0, 1), as the original draws it (transformers
        zeroes it, which would hide it from a parity test)."""
        for name, p in self.named_parameters():
            nn.init.normal_(p, 0.0, 1.0 if name.endswith("z_L_init") else std, generator=generator)

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        """The state is two normed vectors side by side: a normed loop's grids at twice the width."""
        return normed_loop_grids(2 * self.config.hidden_size)

    # ---- the stage view the engine uses ----------------------------------------------------------
    def _init(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([x, self.model.z_L_init.to(x.dtype).expand_as(x)], dim=-1)

    def _cycle(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """One H cycle: L_cycles calls of the L stack, then the H stack (each call its own cache layers)."""
        c, m = self.config, self.model
        n = c.num_layers_per_stack
        z_h, z_l = s.chunk(2, dim=-1)
        for low in range(c.L_cycles):
            z_l = m.L_module(z_l + z_h, self.rope, ctx, low * n)
        z_h = m.H_module(z_h + z_l, self.rope, ctx, c.L_cycles * n)
        return torch.cat([z_h, z_l], dim=-1)

    def _finish(self, s: torch.Tensor) -> torch.Tensor:
        return s[..., : self.config.hidden_size]

    def _build_stages(self) -> list[LoopGroup]:
        c, m = self.config, self.model
        calls = c.L_cycles + 1
        return [LoopGroup("cycles", init=self._init, step=self._cycle, finish=self._finish,
                          attn_layers=list(range(calls * c.num_layers_per_stack)),
                          n_layers=2 * c.num_layers_per_stack, default_steps=c.H_cycles, max_steps=c.max_H_cycles,
                          modules=[m.L_module] * c.L_cycles + [m.H_module])]

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.embed_tokens(ids) * self.config.embedding_scale

    # head: HFLoopedLM's; z_H leaves every H stack normed.
    def layer_split(self) -> dict[str, int]:
        n = self.config.num_layers_per_stack
        return {"L_module": n, "H_module": n}
