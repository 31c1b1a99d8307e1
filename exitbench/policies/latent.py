"""Decoding-free rules: they read only the latent states, so their probe costs a few vector norms."""
from __future__ import annotations

import torch

from .base import ExitPolicy, Memory, log_grid, register

LATENT_GRID = log_grid(1e-5, 1e-1, per_decade=2)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1)


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

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        value = _norm(s - memory["prev"])
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

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        delta = s - memory["prev"]
        prev_delta = memory.get("delta")
        memory["prev"], memory["delta"] = s, delta
        if prev_delta is None:
            return torch.full(s.shape[:1], float("inf"), device=s.device)
        return self._scale(_norm(delta - prev_delta), s)


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

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        step = _norm(s - memory["prev"])
        prev_step = memory.get("step")
        memory["prev"], memory["step"] = s, step
        if prev_step is None:
            return torch.full(s.shape[:1], float("inf"), device=s.device)
        return self._scale((step - prev_step).abs(), s)


@register
class Cosine(ExitPolicy):
    """1 − cos(s_k, s_{k−1}) < τ: the state stopped turning (Huginn's `cosine`, 1e-3)."""

    name = "cosine"
    source = "Geiping et al. 2025, recurrent-pretraining CosineExitEvaluator"
    default_threshold = 1e-3
    default_grid = log_grid(1e-6, 1e-1, per_decade=1)

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        value = 1 - torch.nn.functional.cosine_similarity(s, memory["prev"], dim=-1)
        memory["prev"] = s
        return value
