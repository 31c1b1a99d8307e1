"""Analytic FLOPs per token, by component: what a token's exit saves, independent of the machine.

A linear layer costs 2·(weights) per token; attention over a context of L tokens costs 4·L·d per layer
(scores and weighted sum). Norms, activations and RoPE are left out: they are O(d), not O(d²). Under exit mode
freeze a pinned token's attention (its projections and the attention itself) runs every iteration and the rest
of an iteration's matmuls (MLP, input adapter) only to its exit, so a loop group's cost is split in those two.
"""
from __future__ import annotations

from torch import nn

from ..models import LoopedLM, LoopGroup
from ..models.gpt2 import Conv1D


def _linear_flops(modules: list[nn.Module]) -> float:
    """2 · weights of every linear layer among `modules`, plus what a module that multiplies by bare parameters
    says one token costs it (`token_flops`: routed experts, whose token uses only its chosen few)."""
    return float(sum(2 * m.weight.numel() if isinstance(m, (nn.Linear, Conv1D)) else m.token_flops
                     for root in modules for m in root.modules()
                     if isinstance(m, (nn.Linear, Conv1D)) or hasattr(m, "token_flops")))


def _attention_flops(modules: list[nn.Module]) -> float:
    """The matmuls of the attention sublayers among `modules` (q, k, v and output projections): an attention
    module is one that names its cache layer (`layer_id`), in every architecture."""
    return _linear_flops([m for root in modules for m in root.modules() if hasattr(m, "layer_id")])


class FlopModel:
    def __init__(self, model: LoopedLM, readout_steps: list[int] | None = None):
        self.attn_width = model.attention_width
        self.head = _linear_flops(model.head_modules())
        # Per stage: (is_loop, matmul flops per pass, attention layers per pass)
        self.parts = [(isinstance(s, LoopGroup), _linear_flops(s.modules), len(s.attn_layers))
                      for s in model.stages()]
        attention = [_attention_flops(s.modules) for s in model.stages() if isinstance(s, LoopGroup)]
        # How many passes a readout makes through each stage after a loop group: a later loop group runs at
        # its readout depth (default steps, unless the run caps it), a plain stage once.
        groups = model.loop_groups()
        depth = iter(readout_steps if readout_steps is not None else [g.default_steps for g in groups])
        self.readout_passes = [next(depth) if is_loop else 1 for is_loop, _, _ in self.parts]

        # Every cost is a + b · context (FLOPs are whole numbers below 2^53, so float sums of them are exact and
        # their order does not matter): fixed per part, so a token's count is a few multiplications, not a
        # walk over the stages (it runs once per scored token).
        line = lambda part: (part[1], 4.0 * self.attn_width * part[2])  # noqa: E731
        # per loop group: its a, b; its readout's A, B; the part of a its attention sublayers compute
        self.loops: list[tuple[float, float, float, float, float]] = []
        self.prelude = [0.0, 0.0]
        self.coda = [self.head, 0.0]
        seen_loop = False
        for i, part in enumerate(self.parts):
            a, b = line(part)
            if part[0]:
                later = list(zip(self.parts[i + 1:], self.readout_passes[i + 1:]))
                rest_a = self.head + sum(n * line(p)[0] for p, n in later)
                rest_b = sum(n * line(p)[1] for p, n in later)
                self.loops.append((a, b, rest_a, rest_b, attention[len(self.loops)]))
                seen_loop = True
            else:
                side = self.coda if seen_loop else self.prelude
                side[0] += a
                side[1] += b

    def token(self, context: int, exit_steps: list[int], probes: list[int], mlp_steps: list[int] | None = None
              ) -> dict[str, float]:
        """FLOPs of one token attending to `context` tokens, exiting each loop group at `exit_steps`, with
        `probes[g]` readouts (each runs every stage after group g, plus the head); with `mlp_steps`, loop group g
        ran its attention for exit_steps[g] iterations and the rest for mlp_steps[g] (exit mode freeze)."""
        core = probe = 0.0
        mlp_steps = exit_steps if mlp_steps is None else mlp_steps
        for (a, b, rest_a, rest_b, attention), k, m, n in zip(self.loops, exit_steps, mlp_steps, probes):
            core += k * (attention + b * context) + m * (a - attention)
            probe += n * (rest_a + rest_b * context)
        out = {"prelude": self.prelude[0] + self.prelude[1] * context, "core": core, "probe": probe,
               "coda": self.coda[0] + self.coda[1] * context}
        out["total"] = out["prelude"] + out["core"] + out["probe"] + out["coda"]
        return out
