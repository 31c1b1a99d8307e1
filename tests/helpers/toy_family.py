"""A toy family added with the family kit (docs/adding-a-family.md): a Llama whose last layers loop. Its config
(the schema: fields, names, loop depth fields) and its module are all it takes; tests/test_adding_a_family.py
registers it, saves, loads, runs and exits it, and holds this file under 150 lines.

    h = prelude(embed_tokens(ids))            the first num_hidden_layers − num_loop_layers layers, once
    s_k = norm(core(s_{k-1})), s_0 = h        the last num_loop_layers layers, k = 1 … num_loops
    logits = lm_head(s_K)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from exitbench.models.attention import AttnContext
from exitbench.models.hf_blocks import HFLoopedLM, llama_stack
from exitbench.models.hf_config import HFNamedConfig
from exitbench.models.looped import LoopGroup, Stage


@dataclass
class ToyLoopConfig(HFNamedConfig):
    num_loop_layers: int = 1
    num_loops: int = 3
    max_loops: int | None = None  # exitbench's own: the deepest a run may ask for (default twice num_loops)

    model_type = "toy_loop"
    family = "ToyLoop"
    hf_class = "ToyLoopForCausalLM"
    loop_positive = ("num_loop_layers", "num_loops", "max_loops")
    depth_field, max_depth_field = "num_loops", "max_loops"

    def validate(self) -> None:
        super().validate()
        if self.num_loop_layers > self.num_hidden_layers:
            from exitbench.errors import CheckpointError

            raise CheckpointError(f"config num_loop_layers={self.num_loop_layers} exceeds num_hidden_layers="
                                  f"{self.num_hidden_layers}")


class ToyLoop(HFLoopedLM):
    config_class = ToyLoopConfig

    def family_modules(self, c: ToyLoopConfig) -> dict[str, nn.Module]:
        return llama_stack(c)  # Llama's layers and final norm, with its key names

    @property
    def first_loop_layer(self) -> int:
        return self.config.num_hidden_layers - self.config.num_loop_layers

    def _run(self, layers, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        for i in layers:
            x = self.model.layers[i](x, self.rope, ctx)
        return x

    def _build_stages(self) -> list:
        c, m, first = self.config, self.model, self.first_loop_layer
        prelude, core = list(range(first)), list(range(first, c.num_hidden_layers))
        return [Stage("prelude", lambda x, ctx: self._run(prelude, x, ctx.at_iteration(0)), prelude,
                      modules=[m.layers[i] for i in prelude]),
                LoopGroup("core", init=lambda x, noise: x, step=lambda s, x, ctx: m.norm(self._run(core, s, ctx)),
                          finish=lambda s: s, attn_layers=core, n_layers=len(core), default_steps=c.num_loops,
                          max_steps=c.max_loops, modules=[m.layers[i] for i in core] + [m.norm])]

    def layer_split(self) -> dict[str, int]:
        return {"prelude": self.first_loop_layer, "loop": self.config.num_loop_layers}
