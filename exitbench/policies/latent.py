"""Decoding-free rules: they read only the latent states, so their probe costs a few vector norms."""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import ExitPolicy, Memory, log_grid, register

# Absolute step norms scale with ‖s‖ (≈ sqrt(d) after the core's final RMSNorm), so the grid reaches 1.
LATENT_GRID = log_grid(1e-4, 1.0, per_decade=2)


# The helpers take torch tensors (n, d), or, for a lone token on the CPU, a numpy view (d,) of its state,
# for which they return Python floats: at batch size 1 a torch op costs a microsecond or more of dispatch,
# as much as its arithmetic, and the probe must stay a small fraction of a core iteration. Same formulas.
def _norm(x):
    if isinstance(x, np.ndarray):
        return math.sqrt(np.vdot(x, x))
    return torch.linalg.vector_norm(x, dim=-1)


def _dist(a, b):
    """‖a − b‖ per token."""
    if isinstance(a, np.ndarray):
        d = a - b
        return math.sqrt(np.vdot(d, d))
    if a.shape[0] == 1:
        return torch.dist(a, b).view(1)
    return _norm(a - b)


def _undefined(like):
    if isinstance(like, np.ndarray):
        return math.inf
    return torch.full((like.shape[0],), math.inf, device=like.device)


class _LatentRule(ExitPolicy):
    host_arrays = True


class _StepRule(_LatentRule):
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

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        delta = s - memory["prev"]
        prev_delta = memory.get("delta")
        memory["prev"], memory["delta"] = s, delta
        if prev_delta is None:
            return _undefined(s)
        return self._scale(_dist(delta, prev_delta), s)


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
        step = _dist(s, memory["prev"])
        prev_step = memory.get("step")
        memory["prev"], memory["step"] = s, step
        if prev_step is None:
            return _undefined(s)
        return self._scale(abs(step - prev_step), s)


@register
class Cosine(_LatentRule):
    """1 − cos(s_k, s_{k−1}) < τ: the state stopped turning (Huginn's `cosine`, 1e-3)."""

    name = "cosine"
    source = "Geiping et al. 2025, recurrent-pretraining CosineExitEvaluator"
    default_threshold = 1e-3
    default_grid = log_grid(1e-7, 1e-1, per_decade=1)

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        prev = memory["prev"]
        memory["prev"] = s
        # 1 − cos(a, b) = ½‖a/‖a‖ − b/‖b‖‖²: no cancellation near 1, so float32 states give float32-accurate
        # values even at the 1e-7 thresholds (computing 1 − a·b/(‖a‖‖b‖) loses them to rounding).
        # A zero state (init_scale = 0) has no direction: cos is taken as 0 there, as torch's cosine_similarity does.
        if isinstance(s, np.ndarray):
            ns, npv = _norm(s), _norm(prev)
            return 1.0 if min(ns, npv) < 1e-12 else 0.5 * _dist(s / ns, prev / npv) ** 2
        ns, npv = _norm(s).unsqueeze(-1), _norm(prev).unsqueeze(-1)
        value = 0.5 * _dist(s / ns.clamp_min(1e-12), prev / npv.clamp_min(1e-12)) ** 2
        return torch.where(torch.minimum(ns, npv).squeeze(-1) < 1e-12, torch.ones_like(value), value)
