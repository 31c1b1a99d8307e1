"""The depth report: does this checkpoint's answer depend on how long it loops, and do its iterates settle?

Accuracy per difficulty level and answer-token perplexity at fixed r, and the mean step norm ‖s_k − s_{k−1}‖
per iteration k, on held-out programs of the synthetic task the checkpoint was trained on.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import ExitbenchError
from ..harness.documents import heldout_batch
from ..models import Checkpoint, LoopedLM, LoopGroup
from ..models.embedded import recorded_path

DEFAULT_R = (1, 2, 4, 7, 8, 16, 32)


def loop_states(model: LoopedLM, ids: torch.Tensor, steps: int, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """States s_0 … s_steps of the first loop group for every token: (steps + 1, B, T, d)."""
    groups = model.iterates(ids, steps, generator)
    if not groups:
        raise ExitbenchError("the checkpoint has no loop group, so it has no iterates to measure")
    return groups[0]


@torch.no_grad()
def depth_report(ck: Checkpoint, r_values: Sequence[int] = DEFAULT_R, n_programs: int = 256,
                 seed: int = 0) -> dict[str, Any]:
    model = ck.model
    group: LoopGroup = model.loop_groups()[0]
    r_values = sorted({*r_values, group.default_steps, group.max_steps})  # the trained depth is always shown
    if min(r_values) < 1:
        raise ExitbenchError(f"depth report needs r ≥ 1, got {min(r_values)}")
    (inputs, targets, hops), task = heldout_batch(ck, n_programs, seed)
    is_answer = hops > 0
    rows = []
    for r in r_values:
        logits = model(inputs, r, generator=torch.Generator().manual_seed(seed))
        correct = logits.argmax(-1) == targets
        nll = F.cross_entropy(logits[is_answer], targets[is_answer])
        acc = {h: correct[hops == h].float().mean().item() for h in range(1, task.length + 1)}
        rows.append({"r": r, "accuracy_by_hop": acc, "accuracy": correct[is_answer].float().mean().item(),
                     "answer_perplexity": math.exp(nll.item())})
    states = loop_states(model, inputs, group.max_steps, torch.Generator().manual_seed(seed))
    deltas = (states[1:] - states[:-1]).norm(dim=-1)[:, is_answer]
    step_norm = [{"k": k + 1, "mean": deltas[k].mean().item(), "median": deltas[k].median().item()}
                 for k in range(deltas.shape[0])]
    return {"checkpoint": recorded_path(ck.path), "programs": n_programs, "seed": seed, "levels": task.length,
            "default_steps": group.default_steps, "max_steps": group.max_steps, "by_r": rows,
            "step_norm": step_norm}
