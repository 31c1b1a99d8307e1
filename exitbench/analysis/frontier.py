"""Pareto frontiers of quality against cost, and the matched-quality table, from result cells.

Per (task, metric): every cell is a point (cost, quality). A point is on the frontier when no other point is at
most as costly and at least as good with one of the two strictly better; "good" follows the metric's direction
(accuracy up, perplexity down). Costs: mean iterations per token, wall-clock per token, FLOPs per token.
Frontiers are reported overall and per policy (each policy's own non-dominated thresholds).

The matched-quality table answers "what does each policy save at (almost) no loss?": for a tolerance ε
(relative to full-depth quality, i.e. the fixed-depth cell at the policies' max steps), each policy's cheapest
point within ε, its iterations, its wall-clock speed-up over full depth, its overhead (time ratio ÷ FLOP ratio to
full depth, `overhead`) and its iterations over the oracle's. Speed-ups and overheads are on both clocks
(timing/speedup.py): the throughput clock's (`speedup`, `overhead`) and the latency clock's beside them
(`speedup_latency`, `overhead_latency`); the wall-clock frontier is on the throughput clock.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ExitbenchError
from ..store import cells
from .labels import metric_name
from ..timing.speedup import clock_warnings, estimate, record

COSTS = {"iterations": ("iterations", "mean"), "wall_clock": ("wall_clock", "per_token_s"),
         "flops": ("flops", "per_token")}
TOLERANCES = (0.0, 0.005, 0.01, 0.02)


@dataclass
class Point:
    cell: dict[str, Any]
    # Seconds per token on the wall-clock axis: full depth's, divided by the cell's speed-up where the cell was
    # retimed beside it (one run, alternately: robust to the machine changing speed between cells), else its own
    # evaluation's; None for a speed-up above its iteration bound, which is no result (`price_wall_clock`).
    wall: float | None = None
    speed: Any = None  # the cell's speed-up estimate (timing/speedup.py), once its group's reference is known

    @property
    def policy(self) -> str:
        return cells.series(self.cell["policy"])

    @property
    def threshold(self) -> float:
        return self.cell["policy"]["threshold"]

    @property
    def quality(self) -> float:
        return self.cell["quality"]["value"]

    @property
    def mode(self) -> str:
        """How far to trust the number: a replay cell that is exact by construction (fixed depth on a scored task)
        reads as exact."""
        if self.cell.get("replay", {}).get("exact_by_construction"):
            return "exact"
        return cells.mode(self.cell)

    def cost(self, axis: str) -> float | None:
        if axis == "wall_clock" and self.speed is not None:
            return self.wall
        section, key = COSTS[axis]
        return self.cell[section][key]


# What makes two cells' numbers comparable beyond task and metric. Cells that differ in one of these never share
# a frontier: a --limit 100 sweep beside a 600-document one, torchrun shards beside one process, batch size 1
# beside 16 (per-token wall-clock follows the batch's deepest token), select beside physical exits. Replay and
# exact cells of one setup do share one: replay exists to stand in for exact, and its cells are marked.
MEASURED = (("limit", lambda k: k.get("limit")), ("few-shot", lambda k: k.get("num_fewshot")),
            ("task data", lambda k: k.get("task_fingerprint")), ("dtype", lambda k: k.get("dtype")),
            ("exit mode", lambda k: k.get("exit", {}).get("exit_mode") or "physical"),
            ("window", lambda k: k.get("exit", {}).get("kv_window")),
            ("prefill", lambda k: k.get("exit", {}).get("prefill")),
            ("prompt", lambda k: json.dumps(k["prompt"], sort_keys=True) if k.get("prompt") else None))
# Only the timings differ with these (answers never change with batch size or sharding, nor between exitbench's
# engine and vLLM serving the same rules: docs/serving.md): two backends' clocks are two clocks, never one pair.
TIMED = (("device", lambda k: k.get("device")), ("batch", lambda k: k.get("batch_size")),
         ("ranks", lambda k: k.get("world_size", 1)), ("backend", lambda k: k.get("backend", "hf")))
SETUP = MEASURED + TIMED

Group = tuple  # (task, metric, ((setup field, value), …))


def setup(cell: dict[str, Any], fields=SETUP) -> tuple[tuple[str, Any], ...]:
    key = cell.get("key", {})
    return tuple((name, read(key)) for name, read in fields)


def groups(cell_list: list[dict[str, Any]], fields=SETUP) -> dict[Group, list[Point]]:
    """Points per (task, metric, setup); a cell without a quality number (a non-finite metric) is no point."""
    out: dict[Group, list[Point]] = {}
    for c in cell_list:
        if c["quality"]["value"] is None:
            continue
        out.setdefault((c["task"]["name"], c["quality"]["metric"], setup(c, fields)), []).append(Point(c))
    for points in out.values():
        price_wall_clock(points)
    return out


def price_wall_clock(points: list[Point]) -> None:
    """Each point's speed-up over its group's full-depth cell and its place on the wall-clock axis (`Point.wall`);
    nothing where the group has no full-depth cell."""
    try:
        ref = full_depth(points)
    except ExitbenchError:
        return
    ref_time = ref.cell["wall_clock"].get("per_token_s")
    for p in points:
        p.speed = estimate(p.cell, ref.cell)
        own = p.cell["wall_clock"].get("per_token_s")
        # a speed-up above its bound, or one whose timing cannot be read (issue 72), is no point on the frontier
        if p.speed.flagged or p is not ref and clock_warnings(p.cell):
            p.wall = None
        elif p.speed.basis in ("paired", "corrected", "first requests", "reference") and ref_time:
            p.wall = ref_time / p.speed.value
        else:
            p.wall = own


def group_names(keys, said: bool = False) -> dict[Group, str]:
    """`task · metric`, and where one task and metric holds several setups, the fields that tell them apart
    (`chains · exact_match,none · limit 100 · batch 1`); `said`: the metric as a reader says it (`exact match`),
    for titles (the names themselves key the report and its JSON)."""
    names = {}
    for (task, metric), members in _by_task(keys).items():
        varying = _varying(members)
        for m in members:
            parts = [f"{m[2][i][0]} {_short(m[2][i][1])}" for i in varying]
            names[m] = " · ".join([task, metric_name(metric) if said else metric, *parts])
    return names


def split_setups(keys) -> dict[tuple[str, str], list[str]]:
    """The (task, metric) pairs whose cells were measured under several setups, each with the setup fields
    that differ among them."""
    out = {}
    for pair, members in _by_task(keys).items():
        varying = _varying(members)
        if varying:
            out[pair] = [members[0][2][i][0] for i in varying]
    return out


def _by_task(keys) -> dict[tuple[str, str], list[Group]]:
    out: dict[tuple[str, str], list[Group]] = {}
    for key in keys:
        out.setdefault(key[:2], []).append(key)
    return out


def _varying(members: list[Group]) -> list[int]:
    """Indices of the setup fields whose values differ among groups of one task and metric."""
    return [i for i in range(len(members[0][2])) if len({m[2][i][1] for m in members}) > 1]


def _short(value: Any) -> str:
    if value is None:
        return "none"
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "…"


def better(a: float, b: float, higher: bool) -> bool:
    return a > b if higher else a < b


def frontier(points: list[Point], axis: str, higher: bool) -> list[Point]:
    """Non-dominated points, cheapest first."""
    usable = [p for p in points if p.cost(axis) is not None]
    front = []
    for p in usable:
        dominated = any(
            q.cost(axis) <= p.cost(axis) and (q.quality >= p.quality if higher else q.quality <= p.quality)
            and (q.cost(axis) < p.cost(axis) or better(q.quality, p.quality, higher))
            for q in usable)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: (p.cost(axis), -p.quality if higher else p.quality))


def full_depth(points: list[Point]) -> Point:
    """The fixed-depth cell at the policies' max steps (the deepest fixed cell when policies disagree; the full
    cache's where a KV window's sits beside it)."""
    fixed = [p for p in points if p.cell["policy"]["policy"] == "fixed"]
    if not fixed:
        raise ExitbenchError(f"no fixed-depth cell for task {points[0].cell['task']['name']}: rerun with baselines")
    adaptive_max = {p.cell["policy"]["max_steps"] for p in points if p.cell["policy"]["policy"] != "fixed"}
    at_max = [p for p in fixed if p.threshold in adaptive_max]
    return max(at_max or fixed, key=lambda p: (p.threshold, not p.cell["policy"].get("kv_window")))


def reference_depths(points: list[Point]) -> dict[str, Any]:
    """What "full depth" means in a group, for every table to name: the reference's depth and quality, and the
    deepest fixed depth beside it with its quality where that is deeper (policies capped by --max-steps are
    compared against their cap, while a deeper baseline may sit in the same directory)."""
    ref = full_depth(points)
    deepest = max((p for p in points if p.cell["policy"]["policy"] == "fixed"), key=lambda p: p.threshold)
    out = {"full_depth": ref.threshold, "full_depth_quality": ref.quality}
    if deepest.threshold > ref.threshold:
        out.update(deepest_fixed=deepest.threshold, deepest_fixed_quality=deepest.quality)
    return out


def late(cell: dict[str, Any]) -> dict[str, Any]:
    """A row's mark for a rule whose definition lets it exit only in the last iteration or two before full depth
    (`policy.late_exit`), with that earliest iteration; nothing for others."""
    p = cell["policy"]
    return {"late_exit": True, "earliest_exit": p.get("earliest_exit")} if p.get("late_exit") else {}


def within(quality: float, reference: float, eps: float, higher: bool) -> bool:
    """Quality no worse than the reference by more than eps (relative), in the metric's direction."""
    slack = eps * abs(reference)
    return quality >= reference - slack if higher else quality <= reference + slack


def matched_quality(points: list[Point], tolerances=TOLERANCES, reference: float | None = None
                    ) -> list[dict[str, Any]]:
    """Each policy's cheapest point within ε of full-depth quality (or of `reference`, when given): fewest mean
    iterations, or for depth speculation fewest loop steps per token."""
    higher = points[0].cell["quality"]["higher_is_better"]
    ref = full_depth(points)
    target = ref.quality if reference is None else reference
    oracle = [p for p in points if p.cell["policy"]["policy"] == "oracle"]
    rows = []
    for eps in tolerances:
        by_policy: dict[str, list[Point]] = {}
        for p in points:
            if within(p.quality, target, eps, higher) and p.cost("iterations") is not None:
                by_policy.setdefault(p.policy, []).append(p)
        for name, candidates in sorted(by_policy.items()):
            # (speculation's cost is its loop steps one after another, not its iterations: see timing/speedup.py)
            best = min(candidates, key=lambda p: ((p.cell.get("speculation") or {}).get("steps_per_token")
                                                  or p.cost("iterations"), p.threshold))
            ref_time, time = ref.cell["wall_clock"]["per_token_s"], best.cell["wall_clock"]["per_token_s"]
            paired = paired_timing(best.cell, ref.threshold)
            evaluated = ref_time / time if ref_time and time else None
            # (a group's points carry theirs, against this same full depth, from `groups`)
            speed = best.speed if best.speed is not None else estimate(best.cell, ref.cell)
            rows.append({
                "tolerance": eps, "policy": name, "threshold": best.threshold, "quality": best.quality,
                "mode": best.mode, "cell_id": best.cell["cell_id"], **late(best.cell),
                "full_depth_quality": target, "mean_iterations": best.cost("iterations"),
                # The speed-up shown (full depth's time ÷ the cell's), as `run` shows it: its paired repeats'
                # where the cell was retimed beside this full depth (timing/retime.py), with their range, its
                # basis and its iteration bound (timing/speedup.py); else its evaluation's over full depth's.
                **speed.to_dict(), **latency_fields(best.cell, ref.cell),
                # why its timings cannot be read as results (a busy machine, repeats spread wide), on each clock
                "timing_warnings": clock_warnings(best.cell), "latency_warnings": clock_warnings(best.cell, "latency"),
                "evaluation_speedup": evaluated,
                "paired_speedup": 1 / paired["ratio"] if paired else None,
                "speedup_spread": paired["spread"] if paired else None,
                **overhead_fields(best.cell, ref.cell),
                "iterations_over_oracle": (best.cost("iterations") / oracle[0].cost("iterations")
                                           if oracle and oracle[0].cost("iterations") else None),
                # A speed-up is a ratio of two cells' timings: only comparable when one run measured both.
                "same_run": run_id(best.cell) == run_id(ref.cell),
            })
    return rows


def paired_timing(cell: dict[str, Any], depth: Any) -> dict[str, Any] | None:
    """The cell's repeated timings (timing/retime.py) where they were paired with fixed depth `depth`."""
    rep = cell.get("wall_clock", {}).get("repeats")
    return rep if rep and rep.get("full_depth") == depth else None


def overhead(cell: dict[str, Any], full: dict[str, Any] | None, clock: str = "throughput") -> dict[str, Any] | None:
    """The cell's overhead against its full-depth cell `full` on `clock` (timing/speedup.py CLOCKS): its time
    ratio to full depth ÷ its FLOP ratio (1 when its time is what its FLOPs say; far above 1, an
    implementation's defect rather than the rule's cost), with both ratios and `timing`: "paired" where the
    cell's repeats were timed beside this full depth (one run, alternately: the fair ratio), "plain" (the
    throughput clock only) from the two cells' own per-token times, "reference" for full depth itself, 1 by
    definition. None where a time or a FLOP count is missing (cells written before them, and the latency clock
    without its repeats). Without `full`, only the repeats'."""
    rep = record(cell, clock)
    if clock == "latency" and not rep:
        return None
    if full is not None and full.get("cell_id") == cell.get("cell_id"):
        # (its repeats paired it with itself: their ratio is the clock's noise, not a cost)
        return {"overhead": 1.0, "time_ratio": 1.0, "flops_ratio": 1.0, "timing": "reference",
                "schedule": (rep or {}).get("schedule")}
    if rep and rep.get("ratio") and (full is None or rep.get("full_depth") == full["policy"]["threshold"]):
        flops = rep.get("flops_ratio") or _ratio(cell, full, "flops", "per_token")
        if flops:
            return {"overhead": rep["ratio"] / flops, "time_ratio": rep["ratio"], "flops_ratio": flops,
                    "timing": "paired", "schedule": rep.get("schedule")}
    if full is None or clock == "latency":
        return None
    time, flops = _ratio(cell, full, "wall_clock", "per_token_s"), _ratio(cell, full, "flops", "per_token")
    if not (time and flops):
        return None
    return {"overhead": time / flops, "time_ratio": time, "flops_ratio": flops, "timing": "plain", "schedule": None}


def overhead_fields(cell: dict[str, Any], full: dict[str, Any] | None) -> dict[str, Any]:
    """`overhead` as a row's fields: its value, which timing it comes from, and the part of it the batches'
    schedule sets (timing/retime.py: paired timings only; None, None, None without them); then the latency
    clock's, `overhead_latency` (None without its repeats)."""
    o, bs1 = overhead(cell, full), overhead(cell, full, "latency")
    return {"overhead": o and o["overhead"], "overhead_timing": o and o["timing"], "schedule": o and o["schedule"],
            "overhead_latency": bs1 and bs1["overhead"]}


def latency_fields(cell: dict[str, Any], full: dict[str, Any] | None) -> dict[str, Any]:
    """The latency clock's speed-up as a row's fields (`speedup_latency`, its range, basis, flag and documents:
    timing/speedup.py), None where the cell has no latency repeats."""
    return estimate(cell, full, "latency").to_dict("speedup_latency")


def _ratio(cell: dict[str, Any], full: dict[str, Any] | None, section: str, key: str) -> float | None:
    if full is None:
        return None
    a, b = (cell.get(section) or {}).get(key), (full.get(section) or {}).get(key)
    return a / b if a and b else None


def references(cell_list: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each cell's full-depth cell (`full_depth`) among the cells of its model, task, metric and setup, by
    cell id; a cell whose group has no fixed-depth cell has none."""
    grouped: dict[tuple, list[Point]] = {}
    for c in cell_list:
        key = (c["model"]["fingerprint"], c["task"]["name"], c["quality"]["metric"], setup(c))
        grouped.setdefault(key, []).append(Point(c))
    out = {}
    for points in grouped.values():
        try:
            ref = full_depth(points).cell
        except ExitbenchError:
            continue
        out.update((p.cell["cell_id"], ref) for p in points)
    return out


def run_id(cell: dict[str, Any]) -> str | None:
    return cell["run"].get("run_id")


def report(cell_list: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    grouped = groups(cell_list)
    names, titles = group_names(grouped), group_names(grouped, said=True)
    for key, points in sorted(grouped.items(), key=lambda kv: names[kv[0]]):
        higher = points[0].cell["quality"]["higher_is_better"]
        entry = {"title": titles[key], "higher_is_better": higher, "frontiers": {}, "policy_frontiers": {},
                 "matched_quality": matched_quality(points), **reference_depths(points)}
        as_rows = lambda pts, axis: [{"policy": p.policy, "threshold": p.threshold, "quality": p.quality,  # noqa: E731
                                      "cost": p.cost(axis), "mode": p.mode, **late(p.cell),
                                      **(p.speed.to_dict() if axis == "wall_clock" and p.speed else {})}
                                     for p in pts]
        by_policy: dict[str, list[Point]] = {}
        for p in points:
            by_policy.setdefault(p.policy, []).append(p)
        for axis in COSTS:
            entry["frontiers"][axis] = as_rows(frontier(points, axis, higher), axis)
            entry["policy_frontiers"][axis] = {name: as_rows(frontier(pts, axis, higher), axis)
                                               for name, pts in sorted(by_policy.items())}
        out[names[key]] = entry
    return out


def collapse_tolerances(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Matched-quality rows with one row per policy and pick: a cell that is the policy's cheapest at several ε
    is one row whose `tolerance` is the smallest of them and `max_tolerance` the largest (a table listing it
    once per ε repeats the same numbers)."""
    out: list[dict[str, Any]] = []
    last: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["tolerance"]):
        same = last.get(row["policy"])
        if same is not None and all(same[k] == row[k] for k in ("threshold", "mode", "quality", "mean_iterations")):
            same["max_tolerance"] = row["tolerance"]
            continue
        last[row["policy"]] = merged = {"tolerance": row["tolerance"], "max_tolerance": row["tolerance"], **row}
        out.append(merged)
    return sorted(out, key=lambda r: (r["tolerance"], r["mean_iterations"]))


def table_rows(rep: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Flat rows for output: frontier points (per group and cost axis) and matched-quality rows, each pick
    once (`collapse_tolerances`)."""
    front, matched = [], []
    for group, entry in rep.items():
        for axis, pts in entry["frontiers"].items():
            front += [{"group": group, "axis": axis, **p} for p in pts]
        matched += [{"group": group, **row} for row in collapse_tolerances(entry["matched_quality"])]
    return front, matched
