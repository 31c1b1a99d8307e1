"""The sweep's one entry point: `prepare` refuses what the chosen mode cannot do and plans the cells; `execute`
runs them exactly (exitbench.sweep), by replay (exitbench.replay), or by replay checked against exact reruns
of its frontier. The command line and the benchmarks both come through here."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ExitbenchError
from .harness.task_set import TaskSet
from .models import Checkpoint
from .replay import ReplaySweep, check_named, parse_named, verify_frontier
from .replay.sweep import check_replayable
from .sweep import SweepConfig, SweepPlan, plan, run_sweep


@dataclass
class PreparedSweep:
    """A planned sweep and how it will run: `cfg.replay` chooses replay, `verify` the frontier rerun exactly
    after it, `named` more cells to rerun (policy, threshold)."""

    plan: SweepPlan
    verify: bool = False
    named: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class SweepOutcome:
    cells: list[dict[str, Any]]
    verified: dict[str, Any] | None = None   # replay vs exact, when verified
    timings: dict[str, float] = field(default_factory=dict)  # replay: recording and cost-model seconds


def check_mode(cfg: SweepConfig, verify: bool = False, verify_cells: str | None = None) -> list[tuple[str, float]]:
    """What the chosen mode refuses, from the options alone (before a checkpoint loads); the named cells."""
    if (verify or verify_cells) and not cfg.replay:
        raise ExitbenchError("--verify checks a replay sweep against exact runs; add --replay")
    if not cfg.replay:
        return []
    check_replayable(cfg)  # before planning, which may build the tasks to count their documents
    return parse_named(verify_cells)


def prepare(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str, *, verify: bool = False,
            verify_cells: str | None = None) -> PreparedSweep:
    """Everything a sweep refuses, refused before any cell runs; then its plan."""
    named = check_mode(cfg, verify, verify_cells)
    sweep = plan(ck, tasks, cfg, out, device)
    if named:
        check_named(named, [c for _, c, _ in sweep.cells])
    return PreparedSweep(sweep, verify=verify or bool(named), named=named)


def execute(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, prepared: PreparedSweep,
            progress: Any | None = None) -> SweepOutcome:
    """Run a prepared sweep the way it was prepared: exact cells, or replay cells (and their exact check)."""
    if not cfg.replay:
        return SweepOutcome(run_sweep(ck, tasks, cfg, out, ck.model.device.type, progress, prepared.plan))
    replayer = ReplaySweep(ck, tasks, cfg, prepared.plan, progress)
    finished = replayer.run(out)
    verified = verify_frontier(replayer, finished, out, prepared.named) if prepared.verify else None
    return SweepOutcome(finished, verified, {"record_s": getattr(replayer, "record_s", 0.0),
                                             "cost_model_s": getattr(replayer, "costs_s", 0.0)})
