"""`exitbench check`: did a sweep get worse than a baseline sweep? The CI gate on threshold sweeps.

Cells are matched by what they measure (task, limit, few-shot, every exit knob), not by file name, so a new
model or code revision is compared point for point. Deterministic figures are compared with tolerances:

- quality: worse than the baseline's by more than `quality_tol` × |baseline| (in the metric's direction);
- mean iterations: more than (1 + `iterations_tol`) × the baseline's;
- frontier: at each matched-quality tolerance, a policy's cheapest point within ε of the baseline's full-depth
  quality costs more iterations than (1 + `iterations_tol`) × the baseline's, or no longer reaches it; a run's
  point counts as within ε when it is within ε + `quality_tol`, as its own quality check allows: else an item
  that flips on another CPU's rounding, passed cell by cell, would still fail the ε = 0 frontier;
- a baseline cell missing from the run is a regression.

Wall-clock is compared only when asked, and then never as absolute time: each cell's time per token over the
same run's full-depth time per token, against the same ratio in the baseline, with `wall_tol`.
"""
from __future__ import annotations

import json

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ExitbenchError
from ..store import cells
from ..store.loading import model_label
from .frontier import MEASURED, TOLERANCES, full_depth, groups, matched_quality, paired_timing, setup, within
from .notes import nonfinite
from .labels import config_label


@dataclass
class Tolerances:
    quality: float = 0.01
    iterations: float = 0.05
    wall: float | None = None  # None: wall-clock not compared

    @classmethod
    def given(cls, quality: float, iterations: float, wall: float, wall_clock: bool) -> "Tolerances":
        """`check`'s tolerances, each refused unless a number ≥ 0 (nan too); wall-clock compared if asked."""
        for name, value in (("--quality-tol", quality), ("--iterations-tol", iterations), ("--wall-tol", wall)):
            if not value >= 0:
                raise ExitbenchError(f"{name} must be a number ≥ 0, got {value}")
        return cls(quality, iterations, wall if wall_clock else None)


def identity(cell: dict[str, Any]) -> tuple:
    p = cell["policy"]
    # The learned rule's exit model by its content, as the cell's key holds it: the same file at another path
    # is the same rule.
    # Where the rule can first exit (`earliest_exit`, `late_exit`) follows from the knobs and is no knob: a
    # baseline written before cells recorded it is the same cell.
    ignored = {"seed", "record_signals", "earliest_exit", "late_exit"} | (
        {"exit_model"} if p.get("exit_model_sha256") else set())
    # (a conjunction's rules, a list of mappings, as JSON; numbers as numbers, so 1 and 1.0 stay one threshold)
    knobs = tuple(sorted((k, json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v)
                         for k, v in p.items() if k not in ignored))
    return (cell["task"]["name"], cell["quality"]["metric"], cell["task"].get("limit"),
            cell["task"].get("n_shot"), knobs)


def comparable_baseline(found: list[tuple[Any, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The baseline's cells, or ExitbenchError naming the first one a gate cannot judge against: a cell without
    a quality value would pass any run (nothing to fall short of), so it is refused, not counted as within."""
    for path, cell in found:
        if cell["quality"]["value"] is None:
            raise ExitbenchError(f"{path}: the baseline cell has no quality value ({cell['quality']['metric']} is "
                                 "null), so no run can be judged against it; rerun the baseline cell or remove it")
    return [cell for _, cell in found]


def label(cell: dict[str, Any]) -> str:
    p = cell["policy"]
    rel = " rel" if p.get("relative") else ""
    return f"{cell['task']['name']} {config_label(p['policy'] + rel, p['threshold'])}"


def _worse(run: float | None, base: float | None, tol: float, higher: bool) -> bool:
    if base is None:
        return False
    return run is None or not within(run, base, tol, higher)


def _relative_time(cell: dict[str, Any], full: dict[str, Any]) -> float | None:
    a, b = cell["wall_clock"].get("per_token_s"), full["wall_clock"].get("per_token_s")
    return a / b if a and b else None


def _paired_ratio(cell: dict[str, Any], full: dict[str, Any]) -> float | None:
    """The cell's time ratio from its repeats paired with `full`'s depth (timing/retime.py), if it has them."""
    rep = paired_timing(cell, full["policy"]["threshold"])
    return (rep.get("corrected_ratio") or rep["ratio"]) if rep else None


def relative_times(base: dict[str, Any], base_full: dict[str, Any], cell: dict[str, Any], run_full: dict[str, Any]
                   ) -> tuple[float | None, float | None]:
    """The baseline's and the run's time ratios to full depth: the paired repeats' where both cells have them
    (each side timed beside its full depth, on the same requests), else each cell over its full-depth cell."""
    paired = _paired_ratio(base, base_full), _paired_ratio(cell, run_full)
    if None not in paired:
        return paired
    return _relative_time(base, base_full), _relative_time(cell, run_full)


@dataclass
class Verdict:
    """What a check compared and found: regressions as rows naming the cell (or frontier point), what moved
    and by how much; and the counts behind them."""

    regressions: list[dict[str, Any]]
    baseline_cells: int
    compared: int
    missing: int
    ignored_missing: int
    frontier_points: int
    replay_cells: tuple[int, int] = (0, 0)  # (the run's, the baseline's) cells computed by replay
    nonfinite: tuple[int, int] = (0, 0)  # (the run's, the baseline's) cells with NaN or infinite tokens


    @property
    def passed_cells(self) -> int:
        failed = {r["cell"] for r in self.regressions if not r["what"].startswith(("frontier", "missing"))}
        return self.compared - len(failed)

    def summary(self) -> str:
        text = (f"compared {self.compared} of the baseline's {self.baseline_cells} cells: {self.passed_cells} within "
                f"the tolerances, {self.compared - self.passed_cells} not; {self.frontier_points} frontier points "
                "checked")
        if self.missing:
            text += f"; {self.missing} baseline cells are missing from the run (pass --present-only to compare " \
                    "only the cells the run has)"
        if self.ignored_missing:
            text += f"; {self.ignored_missing} baseline cells not in the run were left out (--present-only)"
        run_r, base_r = self.replay_cells
        if run_r or base_r:
            text += f"; {run_r} of the run's cells and {base_r} of the baseline's are replay cells"
            if bool(run_r) != bool(base_r):
                text += " (replay and exact cells differ where replay approximates: see docs/sweeps.md, \"When to trust it\")"
        run_n, base_n = self.nonfinite
        if run_n or base_n:
            text += (f"; warning: {run_n} of the run's cells and {base_n} of the baseline's had NaN or infinite "
                     "tokens (numerics.nonfinite_tokens)")
        return text


def compare(run_cells: list[dict[str, Any]], base_cells: list[dict[str, Any]], tol: Tolerances,
            present_only: bool = False) -> Verdict:
    """Compare a run with a baseline. With `present_only`, baseline cells the run does not have are left
    out, the frontier included (a partial sweep is checked on what it ran)."""
    run = {identity(c): c for c in run_cells}
    all_base, given_base = len(base_cells), base_cells
    if present_only:
        base_cells = [c for c in base_cells if identity(c) in run]
    regressions = []

    def add(what: str, cell_label: str, base_value: Any, run_value: Any) -> None:
        regressions.append({"what": what, "cell": cell_label, "baseline": base_value, "run": run_value})

    full_run = {g: full_depth(pts).cell for g, pts in groups(run_cells, MEASURED).items()
                if any(p.cell["policy"]["policy"] == "fixed" for p in pts)}
    full_base = {g: full_depth(pts).cell for g, pts in groups(base_cells, MEASURED).items()
                 if any(p.cell["policy"]["policy"] == "fixed" for p in pts)}
    compared = missing = 0
    for base in sorted(base_cells, key=label):
        key, name = identity(base), label(base)
        if key not in run:
            add("missing cell", name, "present", "missing")
            missing += 1
            continue
        compared += 1
        cell = run[key]
        higher = base["quality"]["higher_is_better"]
        if _worse(cell["quality"]["value"], base["quality"]["value"], tol.quality, higher):
            add(f"quality ({base['quality']['metric']})", name, base["quality"]["value"], cell["quality"]["value"])
        b_it, r_it = base["iterations"]["mean"], cell["iterations"]["mean"]
        if b_it is not None and r_it is not None and r_it > b_it * (1 + tol.iterations):
            add("mean iterations", name, b_it, r_it)
        if tol.wall is not None:
            group = (base["task"]["name"], base["quality"]["metric"], setup(base, MEASURED))
            if group in full_run and group in full_base:
                b_t, r_t = relative_times(base, full_base[group], cell, full_run[group])
                if b_t and r_t and r_t > b_t * (1 + tol.wall):
                    add("time / full-depth time", name, b_t, r_t)
    if not compared:
        raise ExitbenchError(nothing_compared(run_cells, given_base))
    frontier, points = compare_frontiers(run_cells, base_cells, tol)
    replayed = (sum(cells.mode(c) == "replay" for c in run_cells), sum(cells.mode(c) == "replay" for c in base_cells))
    broken = (len(nonfinite(run_cells)), len(nonfinite(base_cells)))
    return Verdict(regressions + frontier, all_base, compared, missing, all_base - len(base_cells), points, replayed,
                   broken)


# What a cell measures, dimension by dimension, as `identity` matches it: named so that a check that matched
# nothing can say along which dimensions the two sweeps differ.
DIMENSIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "task": lambda c: c["task"]["name"], "metric": lambda c: c["quality"]["metric"],
    "limit": lambda c: c["task"].get("limit"), "few-shot": lambda c: c["task"].get("n_shot"),
    "policy": lambda c: cells.series(c["policy"]), "max steps": lambda c: c["policy"].get("max_steps"),
    "prefill": lambda c: c["policy"].get("prefill"), "warm start": lambda c: c["policy"].get("warm_start"),
    "min steps": lambda c: c["policy"].get("min_steps"), "patience": lambda c: c["policy"].get("patience"),
}


def nothing_compared(run_cells: list[dict[str, Any]], base_cells: list[dict[str, Any]]) -> str:
    """Why no cell of the run matched one of the baseline: the dimensions whose values the two do not share."""
    def values(cell_list, dim):
        # a limit of None is every document of the task, which is what a reader needs to be told
        return {"all documents" if dim == "limit" and v is None else v
                for v in (DIMENSIONS[dim](c) for c in cell_list)}

    def shown(vals):
        return ", ".join(sorted(map(str, vals))[:6]) + (", …" if len(vals) > 6 else "")

    differ = [f"{dim} (run: {shown(values(run_cells, dim))}; baseline: {shown(values(base_cells, dim))})"
              for dim in DIMENSIONS if not values(run_cells, dim) & values(base_cells, dim)]
    if not differ:  # every dimension shares a value, but no cell shares all of them at once
        differ = [f"{dim} (run: {shown(values(run_cells, dim))}; baseline: {shown(values(base_cells, dim))})"
                  for dim in DIMENSIONS if values(run_cells, dim) != values(base_cells, dim)]
    why = "; ".join(differ) or "the exit knobs"
    models = {model_label(c) for c in run_cells} | {model_label(c) for c in base_cells}
    return (f"nothing to check: none of the run's {len(run_cells)} cells measures what one of the baseline's "
            f"{len(base_cells)} does; they differ in {why} (models: {', '.join(sorted(models))}); rerun the sweep "
            "with the baseline's options")


def compare_frontiers(run_cells, base_cells, tol: Tolerances) -> tuple[list[dict[str, Any]], int]:
    """Frontier regressions, and how many (ε, policy) frontier points of the baseline were checked."""
    out = []
    points = 0
    # A check compares what was measured; the run may time it on another device or batch size.
    run_groups = groups(run_cells, MEASURED)
    for group, base_points in groups(base_cells, MEASURED).items():
        if group not in run_groups or not any(p.cell["policy"]["policy"] == "fixed" for p in run_groups[group]):
            continue  # the missing cells are reported one by one
        # Both against the baseline's full-depth quality: a run whose full depth improved is not penalised
        # for policies that now trail it by more than ε.
        reference = full_depth(base_points).quality
        base_rows = {(r["tolerance"], r["policy"]): r for r in matched_quality(base_points)}
        loosened = {eps + tol.quality: eps for eps in TOLERANCES}
        run_rows = {(loosened[r["tolerance"]], r["policy"]): r
                    for r in matched_quality(run_groups[group], tolerances=list(loosened), reference=reference)}
        for (eps, policy), b in sorted(base_rows.items()):
            points += 1
            where = f"{group[0]} {policy} at ε={100 * eps:g}%"
            r = run_rows.get((eps, policy))
            if r is None:
                out.append({"what": "frontier: no longer within ε", "cell": where,
                            "baseline": b["mean_iterations"], "run": None})
            elif r["mean_iterations"] > b["mean_iterations"] * (1 + tol.iterations):
                out.append({"what": "frontier: cheapest point within ε", "cell": where,
                            "baseline": b["mean_iterations"], "run": r["mean_iterations"]})
    return out, points
