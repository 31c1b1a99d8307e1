"""Nanbeige4.2 (Nanbeige LLM Lab, arXiv 2607.22083), a Llama whose whole layer stack is looped, written from its
published checkpoints' layout (Nanbeige/Nanbeige4.2-3B and -Base) with no remote code.

    h_0 = embed_tokens(ids)                                  no scaling
    h_k = norm(layers(h_{k-1}))                              all layers, shared weights, k = 1 … num_loops (2)
    logits = lm_head(h_L)                                    untied

Each layer is Llama's pre-norm block, h = x + Attn(N_in x), y = h + MLP(N_post h), with grouped-query attention
whose head_dim (128) is not hidden_size / heads, rotate-half RoPE and no biases. The residual stream is carried
across loops with no re-injection; `model.norm` ends every loop, so the state after loop 1 is both loop 2's input
and, through lm_head alone, the readout "if the token stopped here": the loop step is one pass of the stack.
With `skip_loop_final_norm` the loops chain unnormed and the norm runs once, after the last (and before a
readout). Each loop keeps its own keys and values (one cache slot per loop and layer, as the reference's
`layer + loop · layers`), which is the engine's one slot per iteration.

The reference carries research options that are off in the released configs and have no weights; a config that
turns one on is refused in one line rather than loaded into something else (`REFUSED`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .hf_blocks import HFLoopedLM, llama_stack
from .hf_config import HFNamedConfig
from .looped import LoopGroup

# Reference options a loader must not ignore: (field, the value that is off, what it would change).
REFUSED = (
    ("enable_double_loop_split", False, "LoopSplit runs a middle block of layers several times within one loop"),
    ("loop_share_kv", False, "loops would share one KV cache (the report tried and dropped it)"),
    ("enable_depth_attention", False, "attention across loop depths"),
    ("enable_hyper_connection", False, "hyper-connections replace the residual stream"),
    ("enable_mhc", False, "manifold hyper-connections replace the residual stream"),
    ("qk_layernorm", False, "a norm on queries and keys"),
    ("emb_neighbor_num", 0, "n-gram embeddings add neighbouring tokens' embeddings"),
    ("attention_bias", False, "biases on q, k, v and o (the released checkpoints have none)"),
    ("mlp_bias", False, "biases on the MLP (the released checkpoints have none)"),
)


@dataclass
class NanbeigeConfig(HFNamedConfig):
    rms_norm_eps: float = 1e-5
    rope_theta: float = 7e7
    max_position_embeddings: int = 262144
    num_loops: int = 2
    loop_loss_weights: list[float] | None = None
    skip_loop_final_norm: bool = False
    # exitbench's own: the deepest loop count a run may ask for. Only num_loops was trained (the report found more
    # loops destabilised training); deeper runs are extrapolation, allowed because measuring it is a question.
    max_loops: int | None = None

    model_type = "nanbeige"
    family = "Nanbeige4.2"
    hf_class = "NanbeigeForCausalLM"
    depth_field, max_depth_field = "num_loops", "max_loops"

    @property
    def trained_depth(self) -> int:
        """The trained loop count, as the reference reads it: one per per-loop loss weight plus one, when the
        checkpoint lists them, else num_loops."""
        return len(self.loop_loss_weights) + 1 if self.loop_loss_weights else self.num_loops

    loops = trained_depth

    @classmethod
    def refuse(cls, raw: dict[str, Any]) -> None:
        for name, off, what in REFUSED:
            if raw.get(name) is not None and raw[name] != off:
                raise CheckpointError(f"config {name}={raw[name]!r}: {what}, which exitbench does not implement; "
                                      f"the released Nanbeige4.2 checkpoints set {name}={off!r}")


class Nanbeige(HFLoopedLM):
    """Each layer is Llama's pre-norm block (hf_blocks.LlamaLayer)."""
    config_class = NanbeigeConfig

    def family_modules(self, c: NanbeigeConfig) -> dict[str, nn.Module]:
        # The RoPE table comes from rope_theta over head_dim; a checkpoint's rotary_emb.inv_freq, where one has it,
        # is dropped by adapt_checkpoint.
        return llama_stack(c)

    @classmethod
    def adapt_checkpoint(cls, tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tensors.items() if not k.endswith("self_attn.rotary_emb.inv_freq")}

    # Its loop ends in its norm, as Ouro's does: HFLoopedLM's grids (normed_loop_grids).

    # ---- the stage view the engine uses ----------------------------------------------------------
    def _loop_norm(self, s: torch.Tensor) -> torch.Tensor:
        return s if self.config.skip_loop_final_norm else self.model.norm(s)

    def _finish(self, s: torch.Tensor) -> torch.Tensor:
        # Normed after every loop already, unless the loops chain unnormed and one norm ends the last.
        return self.model.norm(s) if self.config.skip_loop_final_norm else s

    def _build_stages(self) -> list[LoopGroup]:
        c, m = self.config, self.model
        return [LoopGroup("loops", init=lambda x, noise: x, step=self._layers_step, finish=self._finish,
                          attn_layers=list(range(c.num_hidden_layers)), n_layers=c.num_hidden_layers,
                          default_steps=c.loops, max_steps=c.max_loops, modules=[m.layers, m.norm],
                          frozen_step=self._frozen_layers_step)]
