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
from torch import nn

from ..errors import CheckpointError
from .attention import AttnContext
from .hf_blocks import HFLoopedLM, LlamaAttention, LlamaLayer, LlamaMLP, RMSNorm, normed_loop_grids
from .hf_config import HFNamedConfig
from .looped import LoopGroup


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
    depth_field, max_depth_field = "total_ut_steps", "max_ut_steps"

    def validate(self) -> None:
        super().validate()
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


class OuroLayer(LlamaLayer):
    """h = x + N_in2(Attn(N_in x)); y = h + N_post2(MLP(N_post h)): a norm on each side of each sublayer, around
    Qwen2's attention without biases (Llama's, with the same key names)."""

    def __init__(self, c: OuroConfig, layer_id: int):
        nn.Module.__init__(self)  # the published order, which state_dict() and named_parameters() keep
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c, layer_id)
        self.input_layernorm_2 = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c)
        self.post_attention_layernorm_2 = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), rope, ctx))

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Ouro(HFLoopedLM):
    config_class = OuroConfig
    part_names = {"embed_tokens": "embedding", "early_exit_gate": "exit_gate"}

    def family_modules(self, c: OuroConfig) -> dict[str, nn.Module]:
        return dict(layers=nn.ModuleList(OuroLayer(c, i) for i in range(c.num_hidden_layers)),
                    norm=RMSNorm(c.hidden_size, c.rms_norm_eps), early_exit_gate=nn.Linear(c.hidden_size, 1))

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        """Ouro's steps do not contract within its 4 trained steps (a third party measured ‖Δh‖/‖h‖ ≈ 0.2 at the
        last one), so the latent rules' grids, tuned on contracting models, would never fire: a normed loop's."""
        return normed_loop_grids(self.config.hidden_size)

    # ---- the stage view the engine uses ----------------------------------------------------------
    # The norm runs after every step: both step t's output and step t+1's input (HFLoopedLM._layers_step).
    def _gate(self, s: torch.Tensor) -> torch.Tensor:
        return self.model.early_exit_gate(s).squeeze(-1).float()

    def _build_stages(self) -> list[LoopGroup]:
        c, m = self.config, self.model
        return [LoopGroup("layers", init=lambda x, noise: x, step=self._layers_step, finish=lambda s: s,
                          attn_layers=list(range(c.num_hidden_layers)), n_layers=c.num_hidden_layers,
                          default_steps=c.total_ut_steps, max_steps=c.max_ut_steps,
                          modules=[m.layers, m.norm], gate=self._gate, frozen_step=self._frozen_layers_step)]
