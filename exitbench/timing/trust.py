"""When a timing can be trusted: every rule that says so, read by the writers (the retiming, which records a
cell's warnings in it) and the readers (tables, notes, the report, export) alike.

A wall-clock ratio is not to be read when the machine was busy while it was timed (`busy`), when its paired
repeats spread too far (`wide_spread`), or when it claims more than its iterations allow (`flag`); `warnings`
gathers the first two as the one list a cell records and every reader shows.
"""
from __future__ import annotations

import os
from typing import Any

from ..runtime.provenance import machine_load

# The most --timing-repeats a sweep takes: the noise floor does not narrow with more (bench/timing_noise.py), and
# each repeat reruns an eighth of every task twice.
MAX_REPEATS = 20
# Repeats spanning more than half their median leave a speed-up unknown to within ±25%: it no longer orders
# policies whose costs differ by less than that. The floor is the machine's: on an idle 2-core VM the same
# config paired with itself spans 0.2 to 0.7 of its median (bench/timing_noise.py, bench/RESULTS.md), so some
# cells are flagged even there; a machine another job competes with spans far more.
UNRELIABLE_SPREAD = 0.5
# How far the timed documents' FLOP ratio to full depth may stray from the whole task's before their time ratio
# no longer stands for the task's: beyond it the ratio is corrected by the FLOP ratios (`corrected_ratio`). A
# tenth: a rule's time follows its FLOPs at most one to one, so the speed-up is then off by at most a tenth too.
MAX_SAMPLE_OFF = 0.10


def busy(load: dict[str, Any] | None) -> bool:
    """Whether a timing's recorded load says other work competed for the cores, at its start or its end. A run
    using every core puts the load near the core count by itself, so only a load well above it (a quarter
    more, and half a process) says something else was running."""
    if not load or not load.get("cpus"):
        return False
    limit = 1.25 * load["cpus"] + 0.5
    return any(v is not None and v > limit for v in (load.get("start"), load.get("end")))


def threads_advice(threads: int | None) -> str:
    """What to do about timings taken beside other work: fewer threads helps only a run that used several (or
    whose threads were not recorded, None)."""
    if threads == 1:
        return "rerun on an idle machine"
    return "rerun on an idle machine, or with --threads 1 (one core per run times more steadily)"


def busy_at_start(threads: int | None) -> str | None:
    """A warning line when other work already holds every core as a run starts (its 1-minute load above the
    core count): the run's wall-clock will be unreliable, so say so before it is spent, not only after."""
    load, cpus = machine_load(), os.cpu_count()
    if load is None or not cpus or load <= cpus:
        return None
    return (f"the machine is busy as this run starts (load {load:g} on {cpus} cores): its wall-clock timings "
            f"will be unreliable (quality and iterations are not); {threads_advice(threads)}")


def wide_spread(cell: dict[str, Any]) -> bool:
    """Whether the cell's repeats spread too far for its ratio to be read (False for a cell timed once)."""
    rep = cell.get("wall_clock", {}).get("repeats")
    return bool(rep) and rep["spread"] > UNRELIABLE_SPREAD


def warnings(cell: dict[str, Any]) -> list[str]:
    """Why a cell's wall-clock ratios are not to be trusted, one reason each: the machine was busy while it was
    timed, or its repeated timings spread too far. Empty when neither."""
    out = []
    load = cell.get("run", {}).get("load")
    if busy(load):
        peak = max(load.get("start") or 0, load.get("end") or 0)
        out.append(f"timed on a busy machine (load {peak:g} on {load['cpus']} cores)")
    if wide_spread(cell):
        rep = cell["wall_clock"]["repeats"]
        out.append(f"its {rep['repeats']} repeated timings spread {100 * rep['spread']:.0f}% around their ratio "
                   f"{rep['ratio']:.3g} to full depth")
    return out


def flag(value: float, bound: float | None, basis: str, cell: dict[str, Any], low: float | None) -> str | None:
    """Why a speed-up above its iteration bound is no result (None when it is within the bound)."""
    if bound is None or value <= bound * (1 + 1e-9):
        return None
    above = f"{value:.2f}× is above the iteration bound {bound:.2f}×"
    if basis == "first requests":
        why = ("it was timed on the task's first requests only (a cell written before exitbench drew its timed "
               "documents across the task): an unrepresentative sample; rerun the cell")
    elif basis == "estimated":
        why = "it is the replay cost model's estimate, not a timing; rerun the cell exactly"
    elif busy((cell.get("run") or {}).get("load")):
        why = "it was timed on a busy machine; rerun on an idle one"
    elif basis == "evaluations":
        why = ("it divides two evaluations timed minutes apart: the machine's speed changed between them; rerun "
               "with --timing-repeats")
    elif low is not None and low <= bound:
        why = "its repeats reach below the bound: timing noise around a speed-up near the bound"
    else:
        why = "its repeats spread over noise alone; rerun it on an idle machine, with --threads 1"
    return f"{above}: {why}"
