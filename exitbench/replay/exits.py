"""A policy's exit rule applied to whole recorded signal trajectories at once.

`ExitPolicy.decide` walks iterations one by one for tokens in flight; a recording holds every token's signal
at every iteration, so the same rule (patience consecutive hits at k ≥ min_steps, or k = max_steps) is a few
array operations over an (n, K) table. `tests/test_replay.py` checks it against `ExitPolicy.first_exit`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..policies import ExitPolicy

if TYPE_CHECKING:
    from ..engine.recorder import Trajectories


def first_exits(policy: ExitPolicy, values: np.ndarray) -> np.ndarray:
    """Exit step (1-based) of each token from its signals (n, K) at iterations 1 … K, as the policy reads them
    (`defined` already applied: +inf / −inf where undefined). K ≥ policy.max_steps."""
    n, K = values.shape
    K = min(K, policy.max_steps)
    v = values[:, :K]
    with np.errstate(invalid="ignore"):
        hits = v < policy.threshold if policy.exits_below else v >= policy.threshold  # NaN never hits
    p = policy.patience
    # A run of p hits ends at k when the hit count over (k − p, k] is p.
    counts = np.concatenate([np.zeros((n, 1), dtype=np.int64), np.cumsum(hits, axis=1, dtype=np.int64)], axis=1)
    ends = np.zeros_like(hits)
    if p <= K:
        ends[:, p - 1:] = (counts[:, p:] - counts[:, :-p]) == p
    steps = np.arange(1, K + 1)
    leave = ends & (steps >= policy.min_steps)
    leave[:, K - 1] = True  # k = max_steps
    return leave.argmax(axis=1) + 1


def trajectory_exits(policies: Sequence[ExitPolicy], traj: "Trajectories", member: int = 0,
                     by_target: bool = True) -> np.ndarray:
    """Exit step per scored token and loop group, (n, G), one policy per group. The oracle agrees with full depth
    by the target's log-probability where a target is given (scoring), by the argmax where the model chose the
    token (generation)."""
    from ..engine.recorder import variant_key

    n = len(traj.positions)
    out = []
    for g, policy in enumerate(policies):
        if policy.signal_free:
            out.append(np.full(n, policy.max_steps))
        elif policy.retrospective:
            top = torch.from_numpy(traj.top[g][:, :policy.max_steps])
            picked = torch.from_numpy(traj.picked[member][g][:, :policy.max_steps])
            out.append(policy.exit_steps(top, picked, torch.full((n,), by_target)).numpy())
        else:
            out.append(first_exits(policy, traj.signals[g][variant_key(policy)]))
    return np.stack(out, 1)
