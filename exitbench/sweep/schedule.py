"""Scheduling a sweep's cells: the plan (this shard's cells, those already on disk), claims that let several
processes share one directory, and ranks that agree under torchrun.

A cell already on disk is skipped, so an interrupted sweep resumes where it stopped, and `--shard i/n` lets a
scheduler fan cells out. Under torchrun every rank runs every cell on its share of the documents (lm-eval
shards them) and only rank 0 writes.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import ExitConfig
from ..errors import ExitbenchError
from ..harness.task_set import TaskSet, output_type
from ..policies import REGISTRY
from ..models import Checkpoint
from ..runtime.distributed import init_distributed
from ..store import cells, disk
from .config import SweepConfig, check_depths, grid, reachable
from .exact import evaluation_error, run_config
from .keys import cell_key, model_record
from ..analysis.labels import exit_config_label


@dataclass
class SweepPlan:
    cells: list[tuple[int, ExitConfig, dict[str, Any]]]   # (task index, exit config, key) of this shard
    done: dict[str, disk.Stored]                       # cell_id → a finished cell on disk
    model: dict[str, Any]                                 # model_record of the checkpoint
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    n_docs: dict[str, int] = field(default_factory=dict)  # task → evaluation documents, where a limit needs them
    full: ExitConfig | None = None  # the deepest fixed depth: what each cell's repeated timings are paired with
    configs: list[ExitConfig] = field(default_factory=list)  # the sweep's exit configs, every task's alike

    def reused(self) -> list[dict[str, Any]]:
        """The cells of this shard already on disk: a rerun reuses them instead of computing them again."""
        return [self.done[cells.cell_id(key)].cell for _, _, key in self.cells if cells.cell_id(key) in self.done]


def exit_configs(ck: Checkpoint, cfg: SweepConfig) -> list[ExitConfig]:
    """The sweep's exit configs on this checkpoint: its default depth and grids (or those `--thresholds
    quantiles:N` derived), within its loop groups' depths, each a rule that can exit before full depth there."""
    grids = {**ck.model.exit_grids(), **(cfg.derived or {}).get("grids", {})}
    groups = ck.model.loop_groups()
    configs = grid(cfg, groups[0].default_steps, grids, ck.model.gated)
    check_depths(configs, groups)
    return reachable(configs, cfg, groups)


def plan(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str,
         configs: list[ExitConfig] | None = None) -> SweepPlan:
    """This shard's cells with their keys, and those of them already on disk."""
    configs = exit_configs(ck, cfg) if configs is None else configs
    model = model_record(ck)
    world = init_distributed()[1]
    n_docs = document_counts(tasks, cfg)
    everything = [(t, c, cell_key(model, name, tasks.fingerprints[name], c, cfg, device, world, n_docs.get(name)))
                  for t, name in enumerate(tasks.names) for c in configs]
    i, n = cfg.shard
    mine = [cell for j, cell in enumerate(everything) if j % n == i]
    # A cell asked for with samples is finished only with its samples file beside it.
    done = {cid: stored for cid, stored in disk.existing(out).items()
            if stored.has_samples or not cfg.samples_required}
    full = full_depth(configs, ck.model.loop_groups())
    return SweepPlan(mine, done, model, n_docs=n_docs, full=full, configs=configs)


def full_depth(configs: list[ExitConfig], groups: list[Any]) -> ExitConfig:
    """The baseline each cell's repeated timings are paired with: the fixed depth the rules are capped at (their
    first loop group's max_steps), as the readers take full depth (analysis/frontier.py), else the deepest."""
    fixed = [c for c in configs if c.policy == "fixed"]
    caps = {c.bound_policies(groups)[0].max_steps for c in configs if c.policy != "fixed"}
    return max([c for c in fixed if c.threshold in caps] or fixed, key=lambda c: c.threshold)


def document_counts(tasks: TaskSet, cfg: SweepConfig) -> dict[str, int]:
    """Each task's evaluation documents (lm-eval's `eval_docs`; a group's largest subtask), which only a limit
    needs: without one, no task is built here."""
    if cfg.limit is None:
        return {}
    counts = {}
    for name, built in loaded_tasks(tasks):
        sizes = [len(task.eval_docs) for task in built]
        if sizes:
            counts[name] = max(sizes)
    return counts


def check_output_types(tasks: TaskSet, configs: list[ExitConfig]) -> None:
    """Refuse, before any cell runs, a policy on a task whose requests it cannot serve, in one line naming both:
    speculation drafts generated tokens, so a scoring task has none; a budgeted prefill exit ranks a scored
    sequence's positions, and a generated token comes alone. The task's output type is read from lm-eval's task
    index, or, for a group (which declares none), from its built subtasks."""
    limited = {c.policy: REGISTRY[c.policy].output_types for c in configs if REGISTRY[c.policy].output_types}
    if not limited:
        return
    declared = {name: output_type(tasks, name) for name in tasks.names}
    kinds = {name: {kind} for name, kind in declared.items() if kind is not None}
    groups = [i for i, name in enumerate(tasks.names) if declared[name] is None]
    if groups:
        subset = TaskSet(tasks.manager, [tasks.specs[i] for i in groups], [tasks.names[i] for i in groups],
                         tasks.fingerprints)
        kinds.update((name, {getattr(t, "OUTPUT_TYPE", None) for t in built} - {None})
                     for name, built in loaded_tasks(subset))
    for name in tasks.names:
        for policy, allowed in limited.items():
            wrong = sorted(kinds.get(name, set()) - set(allowed))
            if wrong:
                what = "generation" if allowed == ("generate_until",) else "scoring"
                raise ExitbenchError(f"--policy {policy} runs {what} tasks ({', '.join(allowed)}); task {name} is "
                                     f"{', '.join(wrong)}: run it with an exit rule, and {policy} on a {what} task "
                                     "(e.g. " + ("chains" if what == "generation" else "chains_mc or chains_lambada")
                                     + ")")


def loaded_tasks(tasks: TaskSet):
    """(name, its lm-eval task objects: a group's subtasks) for each task, built before any cell runs. Quiet:
    whatever lm-eval warns of while loading a task it warns of again when the cells load it, and datasets' bars
    belong to the data the cells read next."""
    from ..harness.quiet import lm_eval_output

    with lm_eval_output(quiet=True):
        for name, spec in zip(tasks.names, tasks.specs):
            try:
                loaded = tasks.manager.load([spec])
            except (ConnectionError, OSError, ValueError) as exc:
                raise evaluation_error([name], exc) from None
            yield name, list(loaded["tasks"].values())


def run_cells(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str,
              progress: Any | None = None, sweep: SweepPlan | None = None, poll_s: float = 1.0
              ) -> list[dict[str, Any]]:
    """Run every cell of this shard that is not on disk yet; return all of this shard's cells.

    Cells of one exit config share a single lm-eval call over their tasks (lm-eval's per-call setup would
    otherwise dominate a small model's sweep); each task still gets its own cell file. A cell another process
    has claimed is left to it and collected once written (or computed here, should that process die).
    """
    sweep = sweep or plan(ck, tasks, cfg, out, device)
    rank0 = init_distributed()[0] == 0
    finished: dict[str, dict[str, Any]] = {}
    waiting: list[tuple[int, ExitConfig, dict]] = []
    for t, exit_cfg, key in sweep.cells:
        cid = cells.cell_id(key)
        if cid in sweep.done:
            finished[cid] = sweep.done[cid].cell
            if progress:
                progress.cell_skipped(cid)
        else:
            waiting.append((t, exit_cfg, key))
    if rank0:
        disk.clear_stale_claims(out)
        if waiting:
            out.mkdir(parents=True, exist_ok=True)
    settled: set[str] = set()
    while waiting:
        computed_any = False
        for group in _by_exit_config(waiting):
            # Claim a group's cells right before computing them, so a second sweep into the same directory
            # takes the next group instead of idling. Rank 0 claims; every rank then runs the same cells,
            # since lm-eval's calls are collective.
            claims = [disk.Claim(out, cells.cell_id(key)) for _, _, key in group] if rank0 else []
            granted = _agree(claim_cells(claims, out, cfg.samples_required) if rank0 else None)
            mine = [(*item, claims[j] if rank0 else None) for j, item in enumerate(group) if granted[j]]
            try:
                if mine:
                    _run_group(ck, tasks, cfg, out, sweep, mine, progress, finished)
                    settled.update(cells.cell_id(key) for _, _, key, _ in mine)  # on every rank alike
                    computed_any = True
            finally:
                for *_, claim in mine:
                    if claim is not None:
                        claim.release()
        # What is left was claimed by another process: collect what it wrote, retry the rest (its owner may
        # have died and freed the claim).
        stored = disk.existing(out) if rank0 else {}
        left = []
        for t, exit_cfg, key in waiting:
            cid = cells.cell_id(key)
            if cid in settled:
                continue
            there = stored.get(cid)
            if _agree(there is not None and (there.has_samples or not cfg.samples_required)):
                if there is not None:
                    finished[cid] = there.cell
                if progress:
                    progress.cell_finished(f"{exit_config_label(exit_cfg)} on {tasks.names[t]} "
                                           "(computed by another run)")
            else:
                left.append((t, exit_cfg, key))
        waiting = left
        if waiting and not computed_any:
            time.sleep(poll_s)  # every remaining cell is another process's: wait until it writes them
    return [finished[cells.cell_id(key)] for _, _, key in sweep.cells if cells.cell_id(key) in finished]


def claim_cells(claims: list[disk.Claim], out: Path, samples_required: bool) -> list[bool]:
    """Which cells this process now owns. A cell written by another run between our look at the directory and
    our claim is let go: it is done, and left for the collection step."""
    granted = [c.acquire() for c in claims]
    if any(granted):
        stored = disk.written(out, [c.cid for c, ok in zip(claims, granted) if ok])
        for j, claim in enumerate(claims):
            there = stored.get(claim.cid)
            if granted[j] and there is not None and (there.has_samples or not samples_required):
                claim.release()
                granted[j] = False
    return granted


def _by_exit_config(items: list[tuple[int, ExitConfig, dict]]) -> list[list[tuple[int, ExitConfig, dict]]]:
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(cells.cell_id(item[1].to_dict()), []).append(item)
    return list(groups.values())


def _agree(value: Any) -> Any:
    """Rank 0's value on every rank (itself in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_group(ck, tasks, cfg, out, sweep, group, progress, finished) -> None:
    exit_cfg = group[0][1]
    label = f"{exit_config_label(exit_cfg)} on {', '.join(tasks.names[t] for t, *_ in group)}"
    if progress:
        progress.cell_started(label)
    produced = run_config(ck, tasks, [t for t, *_ in group], exit_cfg, cfg, sweep.model, [k for _, _, k, _ in group],
                          sweep.run_id, on_requests=progress.requests if progress else None, full=sweep.full)
    for cell, samples in produced:
        cell = cells.strict(cell)
        disk.write(out, cell, samples)
        finished[cell["cell_id"]] = cell
        if progress and cell.get("numerics", {}).get("nonfinite_tokens"):
            progress.warn(f"{cells.filename(cell)}: {cell['numerics']['nonfinite_tokens']} of "
                          f"{cell['iterations']['tokens']} tokens had a NaN or infinity in their states or logits")
    if progress:
        for _ in group:
            progress.cell_finished(label)
