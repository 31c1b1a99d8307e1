"""Decoding-free rules: they read only the latent states, so their probe costs a few vector norms.

On a model of realistic width these are a handful of torch ops over (n, d) states: a fraction of a percent of
a core iteration (bench/RESULTS.md). Signals are per token: each token may be at its own iteration k.
"""
from __future__ import annotations

import torch

from .base import ExitPolicy, Memory, log_grid, register

# Absolute step norms scale with ‖s‖ (≈ sqrt(d) after the core's final RMSNorm), so the grid reaches 1.
LATENT_GRID = log_grid(1e-4, 1.0, per_decade=2)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1)


def _dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a − b‖ per token: one fused op for a lone token, where dispatch is most of a probe's cost."""
    if a.shape[0] == 1:
        return torch.dist(a, b).view(1)
    return _norm(a - b)


class _StepRule(ExitPolicy):
    uses_relative = True
    default_grid = LATENT_GRID

    def _scale(self, value: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return value / _norm(s) if self.relative else value


@register
class FirstOrder(_StepRule):
    """‖Δ_k‖ < τ, with Δ_k = s_k − s_{k−1}; relative: ‖Δ_k‖ / ‖s_k‖ < τ.

    The "naive first-order counterpart" of Pappone et al. 2025; relative is Huginn's `latent-diff` (0.03).
    """

    name = "first_order"
    source = "Pappone, Crisostomi, Rodolà 2025 (arXiv 2509.23314); Huginn latent-diff (Geiping et al. 2025)"
    default_threshold = 1e-3

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        value = _dist(s, memory["prev"])
        memory["prev"] = s
        return self._scale(value, s)


@register
class SecondOrder(_StepRule):
    """‖Δ_k − Δ_{k−1}‖ < τ on `patience` (2) consecutive iterations; relative: divided by ‖s_k‖.

    The second-order exit of Pappone et al. 2025, read as the norm of the change of the step vector
    (Huginn's diffusion sampler calls the relative form `latent-acceleration`). Defined from k = 2.
    """

    name = "second_order"
    source = "Pappone, Crisostomi, Rodolà 2025 (arXiv 2509.23314), vector reading"
    default_threshold = 1e-3
    default_patience = 2
    defined_from = 2

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {"prev": s0, "delta": torch.zeros_like(s0)}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        delta = s - memory["prev"]
        value = _dist(delta, memory["delta"])
        memory["prev"], memory["delta"] = s, delta
        return self._scale(value, s)


@register
class SecondOrderMagnitude(_StepRule):
    """|‖Δ_k‖ − ‖Δ_{k−1}‖| < τ on `patience` (2) consecutive iterations; relative: divided by ‖s_k‖.

    The abstract's literal wording, "second-order difference in step-size": the change of the step's
    magnitude, blind to its direction. Defined from k = 2.
    """

    name = "second_order_magnitude"
    source = "Pappone, Crisostomi, Rodolà 2025 (arXiv 2509.23314), magnitude reading of the abstract"
    default_threshold = 1e-3
    default_patience = 2
    defined_from = 2

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {"prev": s0, "step": torch.zeros(s0.shape[0], dtype=s0.dtype, device=s0.device)}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        step = _dist(s, memory["prev"])
        value = (step - memory["step"]).abs()
        memory["prev"], memory["step"] = s, step
        return self._scale(value, s)


@register
class Cosine(ExitPolicy):
    """1 − cos(s_k, s_{k−1}) < τ: the state stopped turning (Huginn's `cosine`, 1e-3).

    Computed as ½‖s_k/‖s_k‖ − s_{k−1}/‖s_{k−1}‖‖², which equals 1 − cos without the cancellation that loses
    float32 states' 1e-7 thresholds to rounding. A zero state (init_scale = 0) has no direction: cos is 0.
    """

    name = "cosine"
    source = "Geiping et al. 2025, recurrent-pretraining CosineExitEvaluator"
    default_threshold = 1e-3
    default_grid = log_grid(1e-7, 1e-1, per_decade=1)

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        prev = memory["prev"]
        memory["prev"] = s
        ns, npv = _norm(s).unsqueeze(-1), _norm(prev).unsqueeze(-1)
        value = 0.5 * _dist(s / ns.clamp_min(1e-12), prev / npv.clamp_min(1e-12)) ** 2
        return torch.where(torch.minimum(ns, npv).squeeze(-1) < 1e-12, torch.ones_like(value), value)
