"""The sweep's one entry: `open_sweep` loads what a config names and refuses, before any cell runs, what cannot
run; `execute` runs the cells exactly (schedule.py), by replay (replay/), or by replay checked against exact
reruns of its frontier. The command line, the benchmarks and a notebook all come through here:

    from exitbench.sweep import SweepConfig, run_sweep
    outcome = run_sweep(SweepConfig(tasks=["chains"], policies=["second_order"], limit=48))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..harness.task_set import TaskSet
from ..models import Checkpoint
from ..policies.learned import check_fitted_for
from ..policies.speculation import DEFAULT_DRAFT_TOKENS
from ..runtime.distributed import init_distributed
from ..store import cells
from . import backends
from .config import SweepConfig, check_named
from .replay import ReplaySweep, verify_frontier
from .schedule import SweepPlan, check_output_types, exit_configs, plan, run_cells


@dataclass
class Sweep:
    """A sweep ready to run: its config, checkpoint, tasks and output directory, and the plan of its cells."""
    cfg: SweepConfig
    ck: Checkpoint
    tasks: TaskSet
    out: Path
    plan: SweepPlan
    rank0: bool = True  # under torchrun, the rank that writes and reports
    replayer: ReplaySweep | None = None  # --replay with --thresholds quantiles:N: recorded while opening


@dataclass
class SweepOutcome:
    cells: list[dict[str, Any]]
    verified: dict[str, Any] | None = None   # replay vs exact, when verified
    timings: dict[str, float] = field(default_factory=dict)  # replay: recording and cost-model seconds


def open_sweep(cfg: SweepConfig, ck: Checkpoint | None = None, tasks: TaskSet | None = None,
               warn: Callable[[str], None] | None = None) -> Sweep:
    """The checkpoint and tasks `cfg` names (or those given), planned; everything the sweep refuses is refused
    here, before any cell runs. `warn` hears what a user should know before it starts (a busy machine, reused
    cells)."""
    from ..models.embedded import resolve
    from ..runtime.devices import resolve_device

    backends.backend(cfg.backend).prepare()  # before anything is read or written
    device = resolve_device(cfg.device) if ck is None else ck.model.device.type
    rank0 = init_distributed()[0] == 0
    out = cfg.out or Path("results") / resolve(cfg.checkpoint).name
    if rank0:
        _check_output(out, warn)
    if tasks is None:
        from ..harness.task_set import resolve_tasks

        tasks = resolve_tasks(cfg.tasks, cfg.data_dir, cfg.include_path)
    ck = ck or _open_checkpoint(cfg, device)
    configs = exit_configs(ck, cfg)  # bad thresholds fail here, before the checkpoint's fingerprint
    check_fitted_for(ck, next((c.fitted_exit_model for c in configs if c.fitted_exit_model), None))
    check_output_types(tasks, configs)
    backends.backend(cfg.backend).check_configs(ck.model, configs)
    if cfg.compile_step:
        ck.model.compile_loops()
    if cfg.memory_check:  # before any pass; it reads the configs' depths, which no threshold changes
        from ..engine.memory import check_sweep_fits

        check_sweep_fits(ck.model, configs, cfg.batch_size, device)
    replayer = None
    if cfg.quantiles:
        from .quantiles import derive_for_sweep

        # Deterministic, so a resumed sweep derives the same grid and finds its cells on disk.
        replayer = derive_for_sweep(ck, tasks, cfg, configs, warn)
        configs = exit_configs(ck, cfg)
    sweep = Sweep(cfg, ck, tasks, out, plan(ck, tasks, cfg, out, ck.model.device.type, configs), rank0, replayer)
    if replayer is not None:
        replayer.replan(sweep.plan)
    if cfg.verify_cells:
        check_named(cfg.verify_cells, configs)
    if rank0 and warn:
        from ..analysis.tables import reuse_note

        note = reuse_note(sweep.plan.reused(), out)
        if note:
            warn(note)
    return sweep


def _check_output(out: Path, warn: Callable[[str], None] | None) -> None:
    import torch

    from ..runtime.files import writable_dir
    from ..timing.trust import busy_at_start

    writable_dir(out, "--out")  # before any compute: results that cannot be saved are not worth computing
    busy = busy_at_start(torch.get_num_threads())
    if busy and warn:
        warn(f"warning: {busy}")


def _open_checkpoint(cfg: SweepConfig, device: str) -> Checkpoint:
    """The checkpoint, refused where the sweep's prompts do not fit it."""
    from ..models.checkpoint import open_checkpoint

    ck = open_checkpoint(cfg.checkpoint, cfg.dtype, device, allow_nonfinite=cfg.allow_nonfinite)
    cfg.prompting.check_for(ck.path)
    return ck


def execute(sweep: Sweep, progress: Any | None = None) -> SweepOutcome:
    """Run an opened sweep the way its config asks: exact cells, or replay cells (and their exact check)."""
    cfg, ck = sweep.cfg, sweep.ck
    if not cfg.replay:
        return SweepOutcome(run_cells(ck, sweep.tasks, cfg, sweep.out, ck.model.device.type, progress, sweep.plan))
    replayer = sweep.replayer or ReplaySweep(ck, sweep.tasks, cfg, sweep.plan, progress)
    replayer.replan(sweep.plan, progress)
    finished = replayer.run(sweep.out)
    verified = verify_frontier(replayer, finished, sweep.out, cfg.verify_cells) if cfg.verify else None
    return SweepOutcome(finished, verified, {"record_s": getattr(replayer, "record_s", 0.0),
                                             "cost_model_s": getattr(replayer, "costs_s", 0.0)})


def run_sweep(cfg: SweepConfig, progress: Any | None = None) -> SweepOutcome:
    """Open the sweep `cfg` describes and run it."""
    return execute(open_sweep(cfg), progress)


def summary_rows(cell_list: list[dict[str, Any]], reused: set[str] = frozenset()) -> list[dict[str, Any]]:
    """One row per cell, ordered task → baselines first → policy → threshold (the order quality moves in).
    `origin` says which rows this run did not measure exactly: cells reused from an earlier run (their
    cell ids in `reused`) and cells computed by replay. Speed-ups and overheads on both clocks: `speedup` and
    `overhead` the throughput clock's, `latency` and `overhead_latency` the latency clock's."""
    from ..analysis.frontier import overhead_fields, references
    from ..timing.speedup import clock_basis, clock_warnings, estimate

    full = references(cell_list)
    rows = []
    for c in cell_list:
        p = c["policy"]
        name = (cells.conjunction(p) if p.get("rules") else p["policy"]) + (" (rel)" if p.get("relative") else "")
        if p.get("draft_tokens"):  # depth speculation: the rule that drafts, and k where it is not the default
            name += (f":{p['draft']['policy']}" if p.get("draft") else "") \
                + ("" if p["draft_tokens"] == DEFAULT_DRAFT_TOKENS else f" k={p['draft_tokens']}")
        origin = [w for w, yes in (("reused", c["cell_id"] in reused), ("replay", c.get("mode") == "replay")) if yes]
        rows.append({"task": c["task"]["name"], "metric": c["quality"]["metric"],
                     "higher_is_better": c["quality"]["higher_is_better"], "policy": name, "threshold": p["threshold"],
                     "quality": c["quality"]["value"], "mean_iterations": c["iterations"]["mean"],
                     "per_group": c["iterations"].get("per_group_mean") or [],
                     "ms_per_token": 1e3 * (c["wall_clock"]["per_token_s"] or 0.0),
                     "probe_share": c["wall_clock"]["probe_share"], "origin": ", ".join(origin) or "measured",
                     "time_ratio": (c["wall_clock"].get("repeats") or {}).get("ratio"),
                     "time_spread": (c["wall_clock"].get("repeats") or {}).get("spread"),
                     "speedup": estimate(c, full.get(c["cell_id"])), "clock_basis": clock_basis(c),
                     "reference_depth": (full.get(c["cell_id"]) or {}).get("policy", {}).get("threshold"),
                     "late_exit": bool(p.get("late_exit")), "earliest_exit": p.get("earliest_exit"),
                     **overhead_fields(c, full.get(c["cell_id"])),
                     # the latency clock's speed-up beside the throughput one's (`overhead_latency` above)
                     "latency": estimate(c, full.get(c["cell_id"]), "latency"),
                     "warnings": clock_warnings(c), "latency_warnings": clock_warnings(c, "latency")})
    return sorted(rows, key=lambda r: (r["task"], r["policy"] != "fixed", r["policy"], r["threshold"]))
