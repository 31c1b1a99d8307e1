"""The two reference points every exit policy is compared with: fixed depth, and the oracle bound."""
from __future__ import annotations

from typing import Any

import numpy as np
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

    def bind(self, max_steps: int, group: Any = None) -> "Fixed":
        # r is the whole point of this policy: it sets the depth, whatever the group's default. Without
        # one, each loop group runs its own default depth (looped GPT-2 groups may differ).
        if not self.threshold_given:
            self.threshold = max_steps
        self.max_steps = int(self.threshold)
        self._validate()
        return self

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        raise TypeError("fixed depth exits by counting; the engine asks it for no signal")

    def recorded_exits(self, n: int, signals, top, picked, by_target: bool) -> np.ndarray:
        return np.full(n, self.max_steps)


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

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        raise TypeError("the oracle decides from whole trajectories (exit_steps), not per iteration")

    def exit_steps(self, top: torch.Tensor, picked: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """Exit steps (n,) from each token's argmax (n, K) at iterations 1 … K and its target's log-probability
        there (n, K): by the target where the token is `scored` (n,), by the argmax elsewhere."""
        K = top.shape[1]
        by_target = picked >= picked[:, -1:] - self.threshold
        by_argmax = top == top[:, -1:]
        agrees = torch.where(scored.unsqueeze(1), by_target, by_argmax)
        # Earliest k with agreement at every j ≥ k: count the trailing run of agreement from the end.
        trailing = torch.flip(torch.cumprod(torch.flip(agrees, [1]).long(), 1), [1]).sum(1)
        first = K - trailing + 1
        return first.clamp(min=self.min_steps)

    def recorded_exits(self, n: int, signals, top: np.ndarray, picked: np.ndarray, by_target: bool) -> np.ndarray:
        """By the target where one is given (scoring), by the argmax where the model chose the token."""
        K = self.max_steps
        return self.exit_steps(torch.from_numpy(top[:, :K]), torch.from_numpy(picked[:, :K]),
                               torch.full((n,), by_target)).numpy()
