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


class _StepNorms(ExitPolicy):
    """Rules that compare consecutive step norms ‖Δ_k‖, ‖Δ_{k−1}‖: defined from k = 2."""

    defined_from = 2

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {"prev": s0, "step": torch.zeros(s0.shape[0], dtype=s0.dtype, device=s0.device)}

    @staticmethod
    def _step_norms(s: torch.Tensor, memory: Memory) -> tuple[torch.Tensor, torch.Tensor]:
        """(‖Δ_k‖, ‖Δ_{k−1}‖) per token, memory moved on to s_k."""
        step, before = _dist(s, memory["prev"]), memory["step"]
        memory["prev"], memory["step"] = s, step
        return step, before


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
class SecondOrderMagnitude(_StepNorms, _StepRule):
    """|‖Δ_k‖ − ‖Δ_{k−1}‖| < τ on `patience` (2) consecutive iterations; relative: divided by ‖s_k‖.

    The abstract's literal wording, "second-order difference in step-size": the change of the step's
    magnitude, blind to its direction. Defined from k = 2.
    """

    name = "second_order_magnitude"
    source = "Pappone, Crisostomi, Rodolà 2025 (arXiv 2509.23314), magnitude reading of the abstract"
    default_threshold = 1e-3
    default_patience = 2

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        step, before = self._step_norms(s, memory)
        return self._scale((step - before).abs(), s)


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


@register
class Contraction(_StepNorms):
    """‖Δ_k‖·r̂/(1 − r̂) / ‖s_k‖ < τ and r̂ < 1, with r̂ = ‖Δ_k‖/‖Δ_{k−1}‖: the distance still to go, relative.

    If the loop contracts at rate r̂, the steps ahead form a geometric series whose sum is the predicted
    remaining distance (r̂ clamped at 0.999 as in the peer, so a barely contracting token reads ~1000 steps
    out, not infinity). A token with r̂ ≥ 1 is not contracting: its signal is +inf (never a hit), and a token
    that reaches max_steps that way is counted as non-converging. Defined from k = 2; 0/0 (a state that
    stopped) reads r̂ = 0.
    """

    name = "contraction"
    source = "IBM vLLM-Hook recurrent-depth exit (PR #30, 2026), contraction-rate rule (its default)"
    default_threshold = 0.02
    default_patience = 1
    default_grid = log_grid(1e-4, 1.0, per_decade=2)
    RATE_CAP = 0.999

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        step, before = self._step_norms(s, memory)
        rate = torch.where(step == 0, torch.zeros_like(step), step / before)  # x/0 → inf: not contracting
        capped = rate.clamp(max=self.RATE_CAP)
        remaining = step * capped / (1 - capped) / _norm(s).clamp_min(1e-12)
        return torch.where(rate < 1, remaining, torch.full_like(remaining, torch.inf))

    def stalled(self, value: float) -> bool:
        return value == float("inf")
