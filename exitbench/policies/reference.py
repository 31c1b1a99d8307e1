"""The two reference points every exit policy is compared with: fixed depth, and the oracle bound."""
from __future__ import annotations

import torch

from .base import ExitPolicy, Memory, register


@register
class Fixed(ExitPolicy):
    """Every token runs exactly r = τ iterations: the fixed-depth baseline (signal = k, exit when k ≥ r)."""

    name = "fixed"
    source = "baseline"
    signal_free = True
    exits_below = False
    integer_threshold = True
    default_threshold = 32
    default_grid = (1, 2, 4, 8, 16, 32)

    def bind(self, max_steps: int) -> "Fixed":
        # r is the whole point of this policy: it sets the depth, whatever the group's default. Without
        # one, each loop group runs its own default depth (looped GPT-2 groups may differ).
        if not self.threshold_given:
            self.threshold = max_steps
        self.max_steps = int(self.threshold)
        self._validate()
        return self

    def start(self, s0: torch.Tensor) -> Memory:
        return {}

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        return torch.full(s.shape[:1], float(k), device=s.device)


@register
class Oracle(ExitPolicy):
    """The earliest k from which the prediction already equals the max-depth one, at every later step too.

    Generation: argmax p_j = argmax p_max for all j ≥ k. Scoring (a target token is known):
    log p_j(target) ≥ log p_max(target) − ε for all j ≥ k, with ε = τ. It needs the whole trajectory to
    max_steps (a reference pass), so it is the bound other policies are compared with, not a usable rule.
    """

    name = "oracle"
    source = "bound (cf. Schuster et al. 2022 oracle exits)"
    needs_logits = True
    retrospective = True
    default_threshold = 1e-2
    default_grid = (1e-2,)

    def start(self, s0: torch.Tensor) -> Memory:
        return {}

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(s.shape[:1], device=s.device)

    def retrospective_exit(self, logps: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """Exit steps (n,) from log-probabilities (K, n, V) at iterations 1 … K (K = max_steps)."""
        K = logps.shape[0]
        if target is None:
            top = logps.argmax(-1)
            agrees = top == top[-1]
        else:
            picked = logps.gather(-1, target.view(1, -1, 1).expand(K, -1, 1)).squeeze(-1)
            agrees = picked >= picked[-1] - self.threshold
        # Earliest k with agrees[j] for all j ≥ k: count the trailing run of agreement from the end.
        trailing = torch.flip(torch.cumprod(torch.flip(agrees, [0]).long(), 0), [0]).sum(0)
        first = K - trailing + 1
        return first.clamp(min=self.min_steps)
