"""Analytic FLOPs per token, by component: what a token's exit saves, independent of the machine.

A linear layer costs 2·(weights) per token; attention over a context of L tokens costs 4·L·d per layer
(scores and weighted sum). Norms, activations and RoPE are left out: they are O(d), not O(d²).
"""
from __future__ import annotations

from torch import nn

from ..models import LoopedLM, LoopGroup
from ..models.gpt2 import Conv1D


def _linear_flops(modules: list[nn.Module]) -> float:
    return float(sum(2 * m.weight.numel() for root in modules for m in root.modules()
                     if isinstance(m, (nn.Linear, Conv1D))))


class FlopModel:
    def __init__(self, model: LoopedLM, readout_steps: list[int] | None = None):
        n_heads, head_dim = model.cache_geometry()
        self.attn_width = n_heads * head_dim
        self.head = _linear_flops(model.head_modules())
        # Per stage: (is_loop, matmul flops per pass, attention layers per pass)
        self.parts = [(isinstance(s, LoopGroup), _linear_flops(s.modules), len(s.attn_layers))
                      for s in model.stages()]
        # How many passes a readout makes through each stage after a loop group: a later loop group runs at
        # its readout depth (default steps, unless the run caps it), a plain stage once.
        groups = model.loop_groups()
        depth = iter(readout_steps if readout_steps is not None else [g.default_steps for g in groups])
        self.readout_passes = [next(depth) if is_loop else 1 for is_loop, _, _ in self.parts]

    def _cost(self, part: tuple[bool, float, int], context: int) -> float:
        _, matmul, attn = part
        return matmul + 4.0 * context * self.attn_width * attn

    def token(self, context: int, exit_steps: list[int], probes: list[int]) -> dict[str, float]:
        """FLOPs of one token attending to `context` tokens, exiting each loop group at `exit_steps`, with
        `probes[g]` readouts (each runs every stage after group g, plus the head)."""
        out = {"prelude": 0.0, "core": 0.0, "probe": 0.0, "coda": self.head}
        g = 0
        seen_loop = False
        for i, part in enumerate(self.parts):
            cost = self._cost(part, context)
            if part[0]:
                out["core"] += exit_steps[g] * cost
                rest = sum(n * self._cost(p, context)
                           for p, n in zip(self.parts[i + 1:], self.readout_passes[i + 1:])) + self.head
                out["probe"] += probes[g] * rest
                g += 1
                seen_loop = True
            else:
                out["coda" if seen_loop else "prelude"] += cost
        out["total"] = sum(out.values())
        return out
