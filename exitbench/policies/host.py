"""The exit rule of a latent policy for CPU float32 tokens without tensor ops.

On a small model a core iteration is ~180 µs of dispatch, and a probe must stay under 2% of it (3.6 µs);
half a dozen torch ops for the signal and the decision cost 16 µs (bench/RESULTS.md). Here the signal's
arithmetic runs in the C extension exitbench._probe on the states' addresses, and the streaks and the
decision are plain Python lists, one entry per active token. The policy supplies only its formula
(`host_values`) and how many earlier states it reads (`host_history`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import ExitPolicy


class HostProbe:
    """`step(k, s_k)` -> (which tokens leave, their signals) for the tokens in a loop, s_k of shape (n, 1, d).

    "Which tokens leave" is None when none does, else one bool per token. It keeps the states the formula
    needs (so their addresses stay valid) and a streak per token; when some tokens leave, the engine calls
    `keep(rows)` with the positions of those that stay. Written for speed: no tensor ops, one list
    comprehension per call for a batch and none for a lone token (`step` is bound to the right one).
    """

    def __init__(self, policy: ExitPolicy, s0: torch.Tensor):
        self.values = policy.host_values
        self.threshold, self.below = policy.threshold, policy.exits_below
        self.patience, self.min_steps, self.max_steps = policy.patience, policy.min_steps, policy.max_steps
        self.rows, self.width = s0.shape[0], s0.shape[-1]
        # history[0] = s_{k−1}, history[1] = s_{k−2}, … (the policy's host_history of them; None before s_0)
        self.history: list[torch.Tensor | None] = [_contiguous(s0)] + [None] * (policy.host_history - 1)
        self.streaks = [0] * self.rows
        self.step = self._one if self.rows == 1 else self._many

    def _many(self, k: int, s: torch.Tensor) -> tuple[list[bool] | None, list[float]]:
        if not s.is_contiguous():
            s = s.contiguous()
        history = self.history
        values = self.values(s, history, self.rows, self.width)
        history.insert(0, s)
        history.pop()
        th = self.threshold
        if self.below:
            self.streaks = streaks = [st + 1 if v < th else 0 for st, v in zip(self.streaks, values)]
        else:
            self.streaks = streaks = [st + 1 if v >= th else 0 for st, v in zip(self.streaks, values)]
        if k >= self.max_steps:
            return [True] * self.rows, values
        if k < self.min_steps or max(streaks) < self.patience:
            return None, values
        patience = self.patience
        return [st >= patience for st in streaks], values

    def _one(self, k: int, s: torch.Tensor) -> tuple[list[bool] | None, list[float]]:
        """The same for a lone token (batch size 1, the latency benchmark), without list comprehensions."""
        if not s.is_contiguous():
            s = s.contiguous()
        history = self.history
        values = self.values(s, history, 1, self.width)
        history.insert(0, s)
        history.pop()
        v = values[0]
        streak = self.streaks[0] + 1 if (v < self.threshold if self.below else v >= self.threshold) else 0
        self.streaks[0] = streak
        if k >= self.max_steps or (k >= self.min_steps and streak >= self.patience):
            return [True], values
        return None, values

    def keep(self, rows: torch.Tensor) -> None:
        """Only the tokens at `rows` (positions among the current ones) go on looping."""
        self.history = [None if h is None else h[rows] for h in self.history]
        self.streaks = [self.streaks[i] for i in rows.tolist()]
        self.rows = len(self.streaks)
        self.step = self._one if self.rows == 1 else self._many


def _contiguous(s: torch.Tensor) -> torch.Tensor:
    # The C functions read rows by address: a strided state must reach them as a copy.
    return s if s.is_contiguous() else s.contiguous()
