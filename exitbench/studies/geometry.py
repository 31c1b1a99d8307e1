"""The two-scale geometry of loop iterates (Pappone, Crisostomi and Rodolà 2025, "Two-Scale Latent Dynamics
for Recurrent-Depth Transformers", arXiv 2509.23314).

Within a loop group g, with states s_0 … s_K and steps Δ_k = s_k − s_{k−1} (k = 1 … K), per iteration k and
over many tokens:

    step          ‖Δ_k‖
    rel_step      ‖Δ_k‖ / ‖s_k‖
    cosine        cos(Δ_k, Δ_{k−1})                         k ≥ 2
    accel         ‖Δ_k − Δ_{k−1}‖                           k ≥ 2   (the second-order exit signal)
    accel_mag     |‖Δ_k‖ − ‖Δ_{k−1}‖|                        k ≥ 2   (the abstract's literal wording)

Between groups g and g+1, the drift-to-loop ratio compares the move at the hand-off with group g's typical
step: DLR = ‖h − s_g^(K)‖ / mean_k ‖Δ_g^(k)‖. Two hand-off points h are reported:
- `entry`: the next group's initial state x_{g+1}^(0) (the issue's literal formula). Without input injection
  and with no plain layer between the groups this is s_g^(K) itself, so the ratio is exactly 0;
- `first_step`: the next group's first iterate x_{g+1}^(1), i.e. the move the next block makes on the state
  it is handed. This is the drift the paper's picture is about whenever groups are adjacent.

Every token contributes one value per (group, k); means and medians are over tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ExitbenchError
from ..harness import documents
from ..models import Checkpoint, LoopedLM
from ..models.embedded import recorded_path

QUANTITIES = ("step", "rel_step", "cosine", "accel", "accel_mag")
SCHEMA = "exitbench.geometry"
SCHEMA_VERSION = 1


def step_quantities(states: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-iteration quantities of trajectories `states` (K+1, n, d): each (K, n), NaN where undefined (k = 1)."""
    if states.dim() != 3 or states.shape[0] < 2:
        raise ExitbenchError(f"trajectories must be (steps + 1, tokens, dim) with ≥ 1 step, got {tuple(states.shape)}")
    s = states.double()
    delta = s[1:] - s[:-1]
    norm = delta.norm(dim=-1)
    K, n = norm.shape
    nan = torch.full((1, n), math.nan, dtype=torch.float64)
    prev, cur = delta[:-1], delta[1:]
    denom = (prev.norm(dim=-1) * cur.norm(dim=-1))
    cosine = (prev * cur).sum(-1) / denom
    cosine = torch.where(denom > 0, cosine, torch.full_like(cosine, math.nan))
    return {
        "step": norm,
        "rel_step": norm / s[1:].norm(dim=-1),
        "cosine": torch.cat([nan, cosine]),
        "accel": torch.cat([nan, (cur - prev).norm(dim=-1)]),
        "accel_mag": torch.cat([nan, (norm[1:] - norm[:-1]).abs()]),
    }


def drift_to_loop(states: torch.Tensor, handoff: torch.Tensor) -> torch.Tensor:
    """Per token: ‖handoff − s_K‖ / mean_k ‖Δ_k‖ for trajectories `states` (K+1, n, d) and `handoff` (n, d)."""
    s = states.double()
    loop = (s[1:] - s[:-1]).norm(dim=-1).mean(0)
    return (handoff.double() - s[-1]).norm(dim=-1) / loop


@dataclass
class Trajectories:
    """States of every loop group for a batch of tokens, one row per token: groups[g] is (steps + 1, n, d);
    entries[g] is the group's initial state s_0 (n, d), where the hand-off from group g − 1 lands."""

    names: list[str]
    groups: list[torch.Tensor] = field(default_factory=list)
    entries: list[torch.Tensor] = field(default_factory=list)


def trajectories(model: LoopedLM, ids: torch.Tensor, steps: int, generator: torch.Generator | None = None
                 ) -> Trajectories:
    """Run `ids` (B, T) with every loop group at `steps` iterations; keep every iterate of every token."""
    per_group = model.iterates(ids, steps, generator)
    if not per_group:
        raise ExitbenchError(f"the {model.architecture} checkpoint has no loop group, so it has no iterates to measure")
    groups = [states.flatten(1, 2) for states in per_group]
    return Trajectories([g.name for g in model.loop_groups()], groups, [g[0] for g in groups])


# ---- the measurement --------------------------------------------------------------------------------------
def _summary(values: torch.Tensor) -> dict[str, float | None]:
    """Mean and median over tokens of one (group, k) cell, ignoring undefined entries."""
    ok = values[~torch.isnan(values)]
    if ok.numel() == 0:
        return {"mean": None, "median": None}
    return {"mean": ok.mean().item(), "median": ok.median().item()}


@torch.no_grad()
def measure(ck: Checkpoint, batches: Sequence[torch.Tensor], steps: int, seed: int = 0, pca_tokens: int = 4,
            on_batch: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every quantity per group and k, the drift-to-loop ratio at each hand-off, and 2-D PCA paths of a few tokens."""
    if steps < 1:
        raise ExitbenchError(f"--steps must be ≥ 1 (iterations per loop group), got {steps}")
    model = ck.model
    gen = torch.Generator().manual_seed(seed)
    per_group: list[dict[str, list[torch.Tensor]]] | None = None
    dlr: list[dict[str, list[torch.Tensor]]] = []
    pca_paths: list[list[torch.Tensor]] = []
    n_tokens = 0
    for ids in batches:
        ids = ids.view(-1, ids.shape[-1]).to(model.device)
        traj = trajectories(model, ids, steps, gen)
        if per_group is None:
            per_group = [{q: [] for q in QUANTITIES} for _ in traj.groups]
            dlr = [{"entry": [], "first_step": []} for _ in traj.groups[1:]]
        for g, states in enumerate(traj.groups):
            for q, v in step_quantities(states.cpu()).items():
                per_group[g][q].append(v)
        for g in range(len(traj.groups) - 1):
            dlr[g]["entry"].append(drift_to_loop(traj.groups[g].cpu(), traj.entries[g + 1].cpu()))
            dlr[g]["first_step"].append(drift_to_loop(traj.groups[g].cpu(), traj.groups[g + 1][1].cpu()))
        wanted = min(pca_tokens - len(pca_paths), ids.numel())
        if wanted > 0:
            # A few tokens drawn at random (keyed by the seed), not the first positions, which are all BOS.
            picks = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))[:wanted]
            for idx in picks.tolist():
                # A random initial state (Raven's s_0) is noise, far from everything after it: leave it out.
                pca_paths.append([g[1 if group.random_init else 0:, idx].cpu()
                                  for g, group in zip(traj.groups, model.loop_groups())])
        n_tokens += ids.numel()
        if on_batch is not None:
            on_batch()
    groups_out = []
    names = [g.name for g in model.loop_groups()]
    for g, cells in enumerate(per_group):
        values = {q: torch.cat(v, dim=1) for q, v in cells.items()}
        per_k = [{"k": k + 1, **{q: _summary(values[q][k]) for q in QUANTITIES}} for k in range(steps)]
        groups_out.append({"name": names[g], "per_k": per_k})
    handoffs = []
    for g, cells in enumerate(dlr):
        handoffs.append({"from": names[g], "to": names[g + 1],
                         **{kind: _summary(torch.cat(v)) for kind, v in cells.items()}})
    return {"tokens": n_tokens, "steps": steps, "groups": groups_out, "handoffs": handoffs,
            "pca": [pca_path(p) for p in pca_paths]}


def pca_path(group_states: list[torch.Tensor]) -> dict[str, Any]:
    """A token's whole path through the loops (each group's iterates in turn) projected on its top-2 PCs."""
    points = torch.cat(group_states).double()
    centered = points - points.mean(0)
    _, sing, vh = torch.linalg.svd(centered, full_matrices=False)
    # Always two columns and no 0/0: a path of one point (or of identical points) sits at the origin.
    coords = torch.zeros(len(points), 2, dtype=torch.float64)
    coords[:, : min(2, vh.shape[0])] = centered @ vh[:2].T
    total = (sing ** 2).sum()
    explained = [(sing[i] ** 2 / total).item() if i < sing.numel() and total > 0 else 0.0 for i in range(2)]
    bounds = torch.tensor([0] + [len(s) for s in group_states]).cumsum(0).tolist()
    return {"explained_variance": explained,
            "groups": [coords[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]}


def checkpoint_label(ck: Checkpoint) -> dict[str, Any]:
    training = ck.provenance.get("training", {})
    return {"path": recorded_path(ck.path), "architecture": ck.model.architecture,
            "training_step": training.get("steps_done")}


def check_compatible(cks: Sequence[Checkpoint]) -> None:
    """Curves across checkpoints only mean something when the checkpoints are the same model at different times."""
    first = cks[0]

    def layout(ck: Checkpoint) -> tuple:
        m = ck.model
        return (m.architecture, m.config.n_embd, tuple((g.name, g.n_layers) for g in m.loop_groups()),
                m.output_size)

    for ck in cks[1:]:
        if layout(ck) != layout(first):
            raise ExitbenchError(f"--checkpoints must be one model across training: {ck.path} "
                                 f"({_describe(layout(ck))}) differs from {first.path} ({_describe(layout(first))})")


def _describe(layout: tuple) -> str:
    arch, width, groups, vocab = layout
    return f"{arch}, width {width}, loop groups {[name for name, _ in groups]}, vocab {vocab}"


def write_report(report: dict[str, Any], path: Path) -> Path:
    from ..runtime.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda fh: json.dump(report, fh, indent=1))


def geometry_report(cks: Sequence[Checkpoint], *, task: str | None = None, text: str | None = None,
                    data_dir: str | None = None, steps: int | None = None, max_tokens: int = 4096,
                    programs: int = 128, seed: int = 0,
                    on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Measure every checkpoint on the same tokens: a task's documents, a text file, or (for a checkpoint trained
    on the synthetic chains) its held-out programs."""
    from ..runtime.provenance import run_metadata

    if not cks:
        raise ExitbenchError("geometry needs at least one checkpoint")
    if steps is not None and steps < 1:
        raise ExitbenchError(f"--steps must be ≥ 1 (iterations per loop group), got {steps}")
    if max_tokens < 1:
        raise ExitbenchError(f"--tokens must be ≥ 1, got {max_tokens}")
    check_compatible(cks)
    # The checkpoint's configured maximum, where `run` caps --max-steps: every iterate of every token is kept,
    # so an unbounded --steps runs out of memory minutes in instead of failing here.
    deepest = min((max(g.max_steps for g in ck.model.loop_groups()), str(ck.path)) for ck in cks)
    if steps is not None and steps > deepest[0]:
        raise ExitbenchError(f"--steps {steps} exceeds the maximum of {deepest[0]} iterations per loop group of "
                             f"{deepest[1]} (its configured maximum, as for run --max-steps); give --steps ≤ "
                             f"{deepest[0]} or leave it out")
    steps = steps or deepest[0]
    docs, source = documents.document_source(task, text, data_dir, programs, seed)
    # every checkpoint's batches first, so bad input fails before any measuring
    plans = [(ck, documents.token_batches(ck, docs, max_tokens, programs, seed, "measure on")) for ck in cks]
    total, done = sum(len(b) for _, b in plans), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            on_progress(done, total)

    entries = [{**checkpoint_label(ck), **measure(ck, batches, steps, seed, on_batch=tick)} for ck, batches in plans]
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "source": source, "steps": steps,
            "checkpoints": entries, "run": run_metadata(seed=seed)}

