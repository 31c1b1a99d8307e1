"""Ouro (LoopLM; Zhu et al. 2025, arXiv 2510.25741), ByteDance's looped LM with a trained exit gate, written
from the paper and its published checkpoints' layout (ByteDance/Ouro-1.4B, -2.6B and their -Thinking variants).

    h_0 = embed_tokens(ids)                                     no scaling, no prelude
    h_t = norm(layers(h_{t-1}))                                  every decoder layer is the loop, t = 1 … T
    logits_t = lm_head(h_t)                                      untied; reads no other token
    λ_t = σ(early_exit_gate(h_t))                                the gate: stop after step t

Each layer is a sandwich, h = x + N_in2(Attn(N_in x)), y = h + N_post2(MLP(N_post h)), with Qwen2's attention
(no biases, rotate-half RoPE, multi-head or grouped-query). The module tree mirrors the published one, so
`state_dict()` has its key names exactly and a download loads with no remote code.

The exit distribution the gate defines, p_t = λ_t ∏_{j<t}(1 − λ_j) with the last step taking what is left, and
its Q-exit (the first step whose cumulative probability reaches q) are exit rules over this signal:
exitbench/policies/gate.py. Unlike Ouro's own code, which runs every token through all T steps and only picks
which step's output it reads, the engine stops an exited token (later tokens read its entries at its exit step,
Huginn's `latest` rule), so an exit saves compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from . import limits
from .attention import AttnContext, rope_table, rotary_attention
from .hf_config import HFNamedConfig
from .looped import LoopedLM, LoopGroup, frozen_layers, on_rows
from .raven import RMSNorm


@dataclass
class OuroConfig(HFNamedConfig):
    layer_types: list[str] | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    total_ut_steps: int = 4
    # exitbench's own: the deepest loop a run may ask for. Ouro was trained at T = 4 and degrades past it (its
    # paper, T = 5…8); deeper runs are allowed because measuring that is a question users ask.
    max_ut_steps: int | None = None
    early_exit_threshold: float | None = None

    model_type = "ouro"
    family = "Ouro"
    hf_class = "OuroForCausalLM"
    loop_positive = ("total_ut_steps", "max_ut_steps")

    def __post_init__(self):
        self.fill_heads()
        if self.max_ut_steps is None and isinstance(self.total_ut_steps, int):
            self.max_ut_steps = 2 * self.total_ut_steps
        self.validate()

    def validate(self) -> None:
        self.validate_common()
        if self.max_ut_steps < self.total_ut_steps:
            raise CheckpointError(f"config max_ut_steps={self.max_ut_steps} is below total_ut_steps="
                                  f"{self.total_ut_steps}")
        limits.loop_steps("total_ut_steps", self.total_ut_steps)
        limits.loop_steps("max_ut_steps", self.max_ut_steps)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise CheckpointError(f"config layer_types lists {len(self.layer_types)} layers but "
                                      f"num_hidden_layers is {self.num_hidden_layers}")
            other = sorted(set(self.layer_types) - {"full_attention"})
            if other:
                raise CheckpointError(f"config layer_types has {other[0]!r} layers: only full_attention is "
                                      "implemented (the published Ouro checkpoints use it everywhere)")
        elif self.use_sliding_window:
            raise CheckpointError("config use_sliding_window=true: sliding-window attention is not implemented "
                                  "(the published Ouro checkpoints set it false)")

    @classmethod
    def refuse(cls, raw: dict[str, Any]) -> None:
        if raw.get("attention_bias"):
            raise CheckpointError("config attention_bias=true: Ouro's attention has no biases; set it false")


def normed_loop_grids(hidden_size: int) -> dict[str, tuple[float, ...]]:
    """Latent rules' grids for a loop that ends in an RMSNorm: ‖h‖ ≈ sqrt(d) (unit norm weights) after every
    step, so the step-norm grids span 1% … 100% of that; cosine's 1 − cos spans 1e-4 … 0.5."""
    scale = hidden_size ** 0.5
    steps = tuple(float(f"{scale * 10 ** (i / 3 - 2):.3g}") for i in range(7))
    return {"first_order": steps, "second_order": steps, "second_order_magnitude": steps,
            "cosine": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)}


class OuroAttention(nn.Module):
    """Qwen2's attention without biases: q/k/v/o projections, rotate-half RoPE, grouped-query heads
    (attention.rotary_attention: repeated before the cache, so a grouped model's cache is n_heads /
    n_kv_heads times larger than it needs to be)."""

    def __init__(self, c: OuroConfig, layer_id: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.layer_id = (c.num_attention_heads, c.num_key_value_heads,
                                                                 c.head_dim, layer_id)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        return self.o_proj(rotary_attention(q, k, v, rope, ctx, self.layer_id, halves=True))


class OuroMLP(nn.Module):
    def __init__(self, c: OuroConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroLayer(nn.Module):
    """h = x + N_in2(Attn(N_in x)); y = h + N_post2(MLP(N_post h)): a norm on each side of each sublayer."""

    def __init__(self, c: OuroConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = OuroAttention(c, layer_id)
        self.input_layernorm_2 = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = OuroMLP(c)
        self.post_attention_layernorm_2 = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.feed(self.attend(x, rope, ctx))

    # The attention sublayer, then the MLP sublayer: exit mode freeze runs them apart (looped.frozen_layers).
    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), rope, ctx))

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Ouro(LoopedLM):
    architecture = OuroConfig.model_type
    config_class = OuroConfig

    def __init__(self, config: OuroConfig):
        super().__init__()
        self.config = c = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(c.vocab_size, c.hidden_size),
            layers=nn.ModuleList(OuroLayer(c, i) for i in range(c.num_hidden_layers)),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps),
            early_exit_gate=nn.Linear(c.hidden_size, 1),
        ))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # (positions, head_dim/2, 2) cos/sin, recomputed, never stored (Ouro's checkpoints store none either).
        self.register_buffer("rope", rope_table(c.head_dim, c.max_position_embeddings, c.rope_theta),
                             persistent=False)
        self._stages = self._build_stages()

    def reset_buffers(self) -> None:
        c = self.config
        self.rope = rope_table(c.head_dim, c.max_position_embeddings, c.rope_theta).to(self.lm_head.weight.device)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Qwen2's init: N(0, std) for every matrix and the embedding, unit norms, zero gate bias."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(p)
            elif name.endswith("early_exit_gate.bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        """Ouro's steps do not contract within its 4 trained steps (a third party measured ‖Δh‖/‖h‖ ≈ 0.2 at the
        last one), so the latent rules' grids, tuned on contracting models, would never fire."""
        return normed_loop_grids(self.config.hidden_size)

    def tie_head(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    # ---- the stage view the engine uses ----------------------------------------------------------
    def _step(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        for layer in self.model.layers:
            s = layer(s, self.rope, ctx)
        return self.model.norm(s)  # after every step: both step t's output and step t+1's input

    def _frozen_step(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext, keep: torch.Tensor) -> torch.Tensor:
        out = frozen_layers(self.model.layers, s, s, keep, lambda layer, h: layer.attend(h, self.rope, ctx))
        return on_rows(s, keep, self.model.norm, out)  # a pinned state is not normed again

    def _gate(self, s: torch.Tensor) -> torch.Tensor:
        return self.model.early_exit_gate(s).squeeze(-1).float()

    def _build_stages(self) -> list[LoopGroup]:
        c, m = self.config, self.model
        return [LoopGroup("layers", init=lambda x, noise: x, step=self._step, finish=lambda s: s,
                          attn_layers=list(range(c.num_hidden_layers)), n_layers=c.num_hidden_layers,
                          default_steps=c.total_ut_steps, max_steps=c.max_ut_steps,
                          modules=[m.layers, m.norm], gate=self._gate, frozen_step=self._frozen_step)]

    def stages(self) -> list[LoopGroup]:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # positions enter through RoPE, in attention

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x).float()  # the state is already normed (the loop's last `norm`)


    def layer_split(self) -> dict[str, int]:
        return {"loop": self.config.num_hidden_layers}

    def parameter_breakdown(self) -> dict[str, int]:
        m = self.model
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        parts = {"embedding": count(m.embed_tokens), "layers": count(m.layers), "norm": count(m.norm),
                 "exit_gate": count(m.early_exit_gate)}
        if not self.config.tie_word_embeddings:
            parts["lm_head"] = count(self.lm_head)
        return parts
