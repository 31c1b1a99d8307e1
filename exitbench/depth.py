"""The depth report: does this checkpoint's answer depend on how long it loops, and do its iterates settle?

Accuracy per difficulty level and answer-token perplexity at fixed r, and the mean step norm ‖s_k − s_{k−1}‖
per iteration k, on held-out programs of the synthetic task the checkpoint was trained on.
"""
from __future__ import annotations

import math
import random
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from . import synthetic
from .errors import ExitbenchError
from .models import Checkpoint, LoopedLM, LoopGroup

DEFAULT_R = (1, 2, 4, 7, 8, 16, 32)


def loop_states(model: LoopedLM, ids: torch.Tensor, steps: int, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """States s_0 … s_steps of the first loop group for every token: (steps + 1, B, T, d)."""
    groups = model.iterates(ids, steps, generator)
    if not groups:
        raise ExitbenchError("the checkpoint has no loop group, so it has no iterates to measure")
    return groups[0]


def synthetic_training(ck: Checkpoint) -> dict[str, Any] | None:
    """The training config of a checkpoint `exitbench train` made on a synthetic task (None for text models)."""
    training = ck.provenance.get("training", {}).get("train_config")
    if not training or training.get("arch", "huginn_raven") != "huginn_raven" or not training.get("task"):
        return None
    return training


def heldout_batch(ck: Checkpoint, n_programs: int, seed: int):
    training = synthetic_training(ck)
    if not training:
        raise ExitbenchError(f"{ck.path} records no synthetic training task; the depth report needs a checkpoint "
                             "made by `exitbench train` on chains (for a text model, compare the fixed-depth "
                             "baselines of `exitbench run --tasks gsm8k_text`)")
    task = synthetic.make_task(training["task"], n_chains=training["n_chains"], length=training["max_hop"])
    if ck.tokenizer is None:
        raise ExitbenchError(f"{ck.path} has no tokenizer.json")
    # A string seed keeps held-out programs on a stream the trainer's integer-keyed streams never use.
    return synthetic.batch(task, ck.tokenizer, n_programs, random.Random(f"heldout-{seed}")), task


@torch.no_grad()
def depth_report(ck: Checkpoint, r_values: Sequence[int] = DEFAULT_R, n_programs: int = 256,
                 seed: int = 0) -> dict[str, Any]:
    model = ck.model
    group: LoopGroup = model.loop_groups()[0]
    r_values = sorted({*r_values, group.max_steps})
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
    return {"checkpoint": str(ck.path), "programs": n_programs, "seed": seed, "levels": task.length,
            "default_steps": group.default_steps, "max_steps": group.max_steps, "by_r": rows,
            "step_norm": step_norm}


def depth_tables(report: dict[str, Any]) -> list:
    """Rich tables of a depth report: accuracy by hop and perplexity per r, then step norms per k."""
    from rich.table import Table

    levels = range(1, report["levels"] + 1)
    rows = report["by_r"]
    acc = Table(title=f"accuracy by hop vs r ({report['programs']} held-out programs)")
    acc.add_column("", justify="right")
    for row in rows:
        acc.add_column(f"r={row['r']}", justify="right")
    for h in levels:
        acc.add_row(f"hop {h}", *[f"{row['accuracy_by_hop'][h]:.3f}" for row in rows])
    acc.add_row("all", *[f"{row['accuracy']:.3f}" for row in rows], style="bold")
    acc.add_row("answer ppl", *[f"{row['answer_perplexity']:.3f}" for row in rows], style="bold")
    norms = Table(title="mean step norm ‖s_k − s_{k−1}‖")
    norms.add_column("k", justify="right")
    norms.add_column("mean", justify="right")
    norms.add_column("median", justify="right")
    for row in report["step_norm"]:
        norms.add_row(str(row["k"]), f"{row['mean']:.4g}", f"{row['median']:.4g}")
    return [acc, norms]
