"""Rules over a trained exit gate: the model's own estimate, after each step, of whether to stop (Ouro's).

The gate gives step t the stopping probability λ_t = σ(g_t). Ouro reads it as an exit distribution over the
T trained steps, p_t = λ_t ∏_{j<t}(1 − λ_j) for t < T, with p_T what is left, and its Q-exit leaves at the first
step whose cumulative probability Σ_{i≤t} p_i reaches q (arXiv 2510.25741; the reference's `exit_threshold`),
else at T. The gate reads only the token's own state, so these rules are decoding-free: their probe is one
(d → 1) linear head per token, timed as probe time like every signal.
"""
from __future__ import annotations

import torch

from ..errors import ExitbenchError
from .base import ExitPolicy, Memory, register

# The gate's probabilities live in (0, 1); the cumulative one reaches 1 at the last trained step.
PROBABILITY_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def exit_mass(lam: torch.Tensor, remaining: torch.Tensor, last: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gate's exit distribution: (p_t, the mass left after t) from λ_t and the mass left before
    it, p_t = λ_t · remaining, or all of it at the last step (`last`, per token). The reference's order of
    operations, so a q that sits on a step's cumulative probability falls on the same side in both."""
    p = lam * remaining if last is None else torch.where(last, remaining, lam * remaining)
    return p, remaining * (1.0 - lam)


class _GateRule(ExitPolicy):
    exits_below = False
    needs_gate = True
    default_grid = PROBABILITY_GRID

    def _validate(self) -> None:
        super()._validate()
        if self.threshold > 1:
            raise ExitbenchError(f"{self.name}: threshold is a probability and must be in (0, 1], got {self.threshold:g}")

    def _lambda(self, s: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(s))


@register
class QExit(_GateRule):
    """Σ_{i≤t} p_i ≥ q: Ouro's Q-exit over the exit distribution its trained gate defines (the last step
    takes the remaining mass, so every token leaves by T). q = 1 reads the last step, as the shipped config's
    early_exit_threshold 1.0 does."""

    name = "qexit"
    source = "Zhu et al. 2025, Ouro / LoopLM (arXiv 2510.25741) §3, Q-exit"
    default_threshold = 0.5

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        n = s0.shape[0]
        return {"remaining": torch.ones(n, device=s0.device), "cdf": torch.zeros(n, device=s0.device)}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        p, memory["remaining"] = exit_mass(self._lambda(s), memory["remaining"])
        memory["cdf"] = memory["cdf"] + p  # a running sum, as the reference's cumsum
        return memory["cdf"]


@register
class Gate(_GateRule):
    """λ_t ≥ τ: the gate's stopping probability of this step alone, without the survival product."""

    name = "gate"
    source = "Zhu et al. 2025, Ouro / LoopLM (arXiv 2510.25741): the exit gate's per-step λ"
    default_threshold = 0.5

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        return self._lambda(s)
