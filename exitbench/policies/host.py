"""The exit rule of a latent policy for CPU float32 tokens without tensor ops.

On a small model a core iteration is ~180 µs of dispatch, and a probe must stay under 2% of it (3.6 µs);
half a dozen torch ops for the signal and the decision cost 16 µs (bench/RESULTS.md). Here the signal is one
call of the policy's C function in exitbench._probe (`host_kernel`) on the states' addresses, and the streaks
and the decision are Python values. A lone token (batch size 1, the latency benchmark) gets a closure over
local variables, measured at about 1 µs; a batch gets lists, one entry per token.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .base import ExitPolicy

# (k, s_k) -> (None when no token leaves, else one bool per token; the tokens' signals)
Step = Callable[[int, torch.Tensor], tuple["list[bool] | None", "list[float]"]]


class HostProbe:
    """`step(k, s_k)` for the tokens in a loop, s_k of shape (n, 1, d) on the CPU in float32.

    It keeps the states the formula reads (so their addresses stay valid) and a streak per token; when some
    tokens leave, the engine calls `keep(rows)` with the positions of those that stay.
    """

    def __init__(self, policy: ExitPolicy, s0: torch.Tensor):
        from . import latent

        self.kernel = getattr(latent.native, policy.host_kernel)
        self.relative = policy.relative
        self.threshold, self.below = policy.threshold, policy.exits_below
        self.patience, self.min_steps, self.max_steps = policy.patience, policy.min_steps, policy.max_steps
        self.rows, self.width = s0.shape[0], s0.shape[-1]
        # history[0] = s_{k−1}, history[1] = s_{k−2}: the policy's host_history of them, None before s_0.
        self.history: list[torch.Tensor | None] = [_contiguous(s0)] + [None] * (policy.host_history - 1)
        self.streaks = [0] * self.rows
        self.step: Step = self._lone() if self.rows == 1 else self._many

    def _many(self, k: int, s: torch.Tensor) -> tuple[list[bool] | None, list[float]]:
        if not s.is_contiguous():
            s = s.contiguous()
        history = self.history
        if history[-1] is None:  # the formula needs states before s_0: undefined, never a hit
            values = [math.inf] * self.rows
        else:
            values = self.kernel(s.data_ptr(), *[h.data_ptr() for h in history], self.rows, self.width,
                                 self.relative)
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

    def _lone(self) -> Step:
        """`step` for one token: the same rule over closure variables, with no list work but the result."""
        kernel, relative, width = self.kernel, self.relative, self.width
        threshold, below = self.threshold, self.below
        patience, min_steps, max_steps = self.patience, self.min_steps, self.max_steps
        streak = self.streaks[0]
        leave_all = [True]
        if len(self.history) == 1:
            prev = self.history[0]

            def step(k: int, s: torch.Tensor) -> tuple[list[bool] | None, list[float]]:
                nonlocal prev, streak
                if not s.is_contiguous():
                    s = s.contiguous()
                values = kernel(s.data_ptr(), prev.data_ptr(), 1, width, relative)
                prev = s
                v = values[0]
                streak = streak + 1 if (v < threshold if below else v >= threshold) else 0
                return leave_all if k >= max_steps or (k >= min_steps and streak >= patience) else None, values
            return step
        prev, older = self.history

        def step2(k: int, s: torch.Tensor) -> tuple[list[bool] | None, list[float]]:
            nonlocal prev, older, streak
            if not s.is_contiguous():
                s = s.contiguous()
            values = [math.inf] if older is None else kernel(s.data_ptr(), prev.data_ptr(), older.data_ptr(), 1,
                                                             width, relative)
            older, prev = prev, s
            v = values[0]
            streak = streak + 1 if (v < threshold if below else v >= threshold) else 0
            return leave_all if k >= max_steps or (k >= min_steps and streak >= patience) else None, values
        return step2

    def keep(self, rows: torch.Tensor) -> None:
        """Only the tokens at `rows` (positions among the current ones) go on looping."""
        self.history = [None if h is None else h[rows] for h in self.history]
        self.streaks = [self.streaks[i] for i in rows.tolist()]
        self.rows = len(self.streaks)
        if self.rows == 1:
            self.step = self._lone()


def _contiguous(s: torch.Tensor) -> torch.Tensor:
    # The C functions read rows by address: a strided state must reach them as a copy.
    return s if s.is_contiguous() else s.contiguous()
