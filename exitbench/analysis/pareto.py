"""Pareto frontiers of quality against cost, and the matched-quality table, from result cells.

Per (task, metric): every cell is a point (cost, quality). A point is on the frontier when no other point is at
most as costly and at least as good with one of the two strictly better; "good" follows the metric's direction
(accuracy up, perplexity down). Costs: mean iterations per token, wall-clock per token, FLOPs per token.
Frontiers are reported overall and per policy (each policy's own non-dominated thresholds).

The matched-quality table answers "what does each policy save at (almost) no loss?": for a tolerance ε
(relative to full-depth quality, i.e. the fixed-depth cell at the policies' max steps), each policy's cheapest
point within ε, its iterations, its wall-clock speed-up over full depth, and its iterations over the oracle's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import ExitbenchError
from ..store import cells

COSTS = {"iterations": ("iterations", "mean"), "wall_clock": ("wall_clock", "per_token_s"),
         "flops": ("flops", "per_token")}
TOLERANCES = (0.0, 0.005, 0.01, 0.02)


@dataclass
class Point:
    cell: dict[str, Any]

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
        return mode(self.cell)

    def cost(self, axis: str) -> float | None:
        section, key = COSTS[axis]
        return self.cell[section][key]


def mode(cell: dict[str, Any]) -> str:
    """"replay" for a cell computed from a recording (exitbench.replay), "exact" otherwise (older cells too)."""
    return cell.get("mode", "exact")


def prefer_exact(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop each replay cell whose exact twin (the same key but for the mode, e.g. from `--verify`) is there."""
    twin = lambda c: cells.cell_id({k: v for k, v in c["key"].items() if k != "mode"})  # noqa: E731
    exact = {twin(c) for c in cell_list if mode(c) == "exact"}
    return [c for c in cell_list if mode(c) == "exact" or twin(c) not in exact]


def load(directories: list[Path], on_skip: Callable[[list[Path]], None] | None = None, model: str | None = None,
         strict: bool = False) -> list[dict[str, Any]]:
    """Every cell under the directories (recursively), an exact cell in place of its replay twin, all of one
    model (`select_model`). JSON files that are not cells (calibration and geometry reports) are skipped and
    passed to `on_skip`; a file that claims to be a cell but is broken stops the load, and with `strict` (the
    gate) so does a file that is not readable JSON (`cells.scan`)."""
    return [cell for _, cell in load_paths(directories, on_skip, model, strict)]


def load_paths(directories: list[Path], on_skip: Callable[[list[Path]], None] | None = None,
               model: str | None = None, strict: bool = False) -> list[tuple[Path, dict[str, Any]]]:
    """`load`, with each cell's file (what finds the samples file beside it)."""
    found, skipped = [], []
    for d in directories:
        d = Path(d)
        if not d.is_dir():
            raise ExitbenchError(f"{d} is not a directory of result cells")
        cells_here, skipped_here = cells.scan(d.rglob("*.json"), strict)
        found += cells_here
        skipped += skipped_here
    where = ", ".join(map(str, directories))
    if not found:
        extra = f" ({len(skipped)} JSON file(s) there are not cells, e.g. {skipped[0]})" if skipped else ""
        raise ExitbenchError(f"no result cells under {where}{extra}")
    if skipped and on_skip is not None:
        on_skip(skipped)
    found = select_model(found, model, where)
    kept = {id(c) for c in prefer_exact([c for _, c in found])}
    return [(path, c) for path, c in found if id(c) in kept]


def model_label(cell: dict[str, Any]) -> str:
    """How tables and errors name a cell's model: where it came from, and its content fingerprint (what tells
    two models apart: a path may hold another model tomorrow)."""
    m = cell["model"]
    return f"{m.get('source') or m.get('path') or m['architecture']} ({m['fingerprint']})"


def select_model(found: list[tuple[Path, dict[str, Any]]], model: str | None, where: str
                 ) -> list[tuple[Path, dict[str, Any]]]:
    """The cells of one model. Cells of different models never share a frontier, a matched-quality row or a
    check (the same labels would stand for different numbers), so a directory that mixes models needs `model`:
    a fingerprint prefix, a path or source label, or an embedded checkpoint's name."""
    by_model: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, c in found:
        by_model.setdefault(c["model"]["fingerprint"], []).append((path, c))
    if model is None:
        if len(by_model) == 1:
            return found
        names = "; ".join(f"{model_label(v[0][1])}: {len(v)} cells" for v in by_model.values())
        raise ExitbenchError(f"{where} holds cells of {len(by_model)} models ({names}); pass --model NAME "
                             "(a fingerprint, path or name of one of them) to use one, or keep them in separate "
                             "directories")
    picked = [fp for fp, v in by_model.items() if _names_model(model, fp, v[0][1]["model"])]
    if len(picked) != 1:
        what = "no" if not picked else f"{len(picked)}"
        known = "; ".join(model_label(v[0][1]) for v in by_model.values())
        raise ExitbenchError(f"--model {model!r} names {what} model of the cells under {where}; they hold: {known}")
    return by_model[picked[0]]


def _names_model(name: str, fingerprint: str, model: dict[str, Any]) -> bool:
    source, path = model.get("source") or "", model.get("path") or ""
    return (len(name) >= 4 and fingerprint.startswith(name)) or name in (source, path, Path(path).name) \
        or source == f"embedded:{name}"


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
# Only the timings differ with these (answers never change with batch size or sharding).
TIMED = (("device", lambda k: k.get("device")), ("batch", lambda k: k.get("batch_size")),
         ("ranks", lambda k: k.get("world_size", 1)))
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
    return out


def group_names(keys) -> dict[Group, str]:
    """`task · metric`, and where one task and metric holds several setups, the fields that tell them apart
    (`chains · exact_match,none · limit 100 · batch 1`)."""
    names = {}
    for (task, metric), members in _by_task(keys).items():
        varying = _varying(members)
        for m in members:
            parts = [f"{m[2][i][0]} {_short(m[2][i][1])}" for i in varying]
            names[m] = " · ".join([task, metric, *parts])
    return names


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


def split_note(keys) -> str | None:
    """A line saying which task/metric pairs were split into setups, and by what."""
    split = {pair: members for pair, members in _by_task(keys).items() if _varying(members)}
    if not split:
        return None
    fields = sorted({members[0][2][i][0] for members in split.values() for i in _varying(members)})
    return (f"cells of {', '.join(f'{t} · {m}' for t, m in sorted(split))} were measured under different setups "
            f"({', '.join(fields)}) and are kept in separate frontiers; write each experiment to its own --out "
            "to keep them apart")


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


def within(quality: float, reference: float, eps: float, higher: bool) -> bool:
    """Quality no worse than the reference by more than eps (relative), in the metric's direction."""
    slack = eps * abs(reference)
    return quality >= reference - slack if higher else quality <= reference + slack


def matched_quality(points: list[Point], tolerances=TOLERANCES, reference: float | None = None
                    ) -> list[dict[str, Any]]:
    """Each policy's cheapest point within ε of full-depth quality (or of `reference`, when given)."""
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
            best = min(candidates, key=lambda p: (p.cost("iterations"), p.threshold))
            ref_time, time = ref.cost("wall_clock"), best.cost("wall_clock")
            paired = paired_timing(best.cell, ref.threshold)
            rows.append({
                "tolerance": eps, "policy": name, "threshold": best.threshold, "quality": best.quality,
                "mode": best.mode,
                "full_depth_quality": target, "mean_iterations": best.cost("iterations"),
                "speedup": ref_time / time if ref_time and time else None,
                # Where the cell was retimed beside this full depth (harness/retime.py): the speed-up its paired
                # repeats measured on its first requests, and their spread, which says how much of `speedup`
                # is noise.
                "paired_speedup": 1 / paired["ratio"] if paired else None,
                "speedup_spread": paired["spread"] if paired else None,
                "iterations_over_oracle": (best.cost("iterations") / oracle[0].cost("iterations")
                                           if oracle and oracle[0].cost("iterations") else None),
                # A speed-up is a ratio of two cells' timings: only comparable when one run measured both.
                "same_run": run_id(best.cell) == run_id(ref.cell),
            })
    return rows


def paired_timing(cell: dict[str, Any], depth: Any) -> dict[str, Any] | None:
    """The cell's repeated timings (harness/retime.py) where they were paired with fixed depth `depth`."""
    rep = cell.get("wall_clock", {}).get("repeats")
    return rep if rep and rep.get("full_depth") == depth else None


def run_id(cell: dict[str, Any]) -> str | None:
    return cell["run"].get("run_id")


def replay_points(rep: dict[str, Any]) -> dict[str, int]:
    """Per group, how many of its frontier points (any cost axis) and matched-quality rows are replay cells."""
    out = {}
    for group, entry in rep.items():
        n = sum(p["mode"] == "replay" for pts in entry["frontiers"].values() for p in pts)
        n += sum(r["mode"] == "replay" for r in entry["matched_quality"])
        if n:
            out[group] = n
    return out


def nonfinite(cell_list: list[dict[str, Any]]) -> list[str]:
    """The cells (by file name) some of whose tokens went NaN or infinite: their numbers rest on broken
    arithmetic, however they were made or reused."""
    return [cells.filename(c) for c in cell_list if (c.get("numerics") or {}).get("nonfinite_tokens")]


def busy_cells(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells timed while other work competed for the cores (their run's recorded load)."""
    from ..runtime.provenance import busy

    return [c for c in cell_list if busy(c.get("run", {}).get("load"))]


def spread_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A warning line when some cells' repeated timings spread too far for their ratio to be read."""
    from ..harness.retime import UNRELIABLE_SPREAD, wide_spread

    wide = [c for c in cell_list if wide_spread(c)]
    if not wide:
        return None
    worst = max(wide, key=lambda c: c["wall_clock"]["repeats"]["spread"])
    return (f"{len(wide)} of {len(cell_list)} cells' repeated timings spread more than "
            f"{100 * UNRELIABLE_SPREAD:.0f}% around their ratio to full depth (up to "
            f"{100 * worst['wall_clock']['repeats']['spread']:.0f}%, {worst['task']['name']} "
            f"{worst['policy']['policy']} τ={worst['policy']['threshold']:g}): their speed-ups are unreliable; "
            "rerun them on an idle machine, with --threads 1 or more --timing-repeats")


def timing_notes(cell_list: list[dict[str, Any]]) -> list[str]:
    """Every warning on how far the cells' wall-clock can be trusted (the machine's load, the repeats' spread)."""
    return [n for n in (busy_note(cell_list), spread_note(cell_list)) if n]


def busy_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A warning line when some cells were timed on a busy machine (None when none were)."""
    from ..runtime.provenance import threads_advice

    hot = busy_cells(cell_list)
    if not hot:
        return None
    used = {c.get("run", {}).get("machine", {}).get("cpu_threads") for c in hot}
    peak = lambda c: max(c["run"]["load"]["start"] or 0, c["run"]["load"]["end"] or 0)  # noqa: E731
    worst = max(hot, key=peak)
    return (f"{len(hot)} of {len(cell_list)} cells were timed on a busy machine (load up to "
            f"{peak(worst):g} on {worst['run']['load']['cpus']} cores, e.g. "
            f"{worst['task']['name']} {worst['policy']['policy']} τ={worst['policy']['threshold']:g}): their "
            f"wall-clock and speed-ups are unreliable; {threads_advice(1 if used == {1} else None)}")


def mixed_runs(rep: dict[str, Any]) -> list[str]:
    """The groups whose matched-quality speed-ups compare cells measured by different runs."""
    return [group for group, entry in rep.items() if any(not r["same_run"] for r in entry["matched_quality"])]


def drift_note(rep: dict[str, Any]) -> str | None:
    """A warning line where a matched-quality speed-up (the two cells' evaluations divided) and the same
    cell's paired repeats disagree by more than DRIFT: the machine's speed changed between the evaluations
    (the repeats time both sides within seconds of each other), so the speed-up measures the machine."""
    off = [(group, r) for group, entry in rep.items() for r in collapse_tolerances(entry["matched_quality"])
           if r["speedup"] and r.get("paired_speedup")
           and max(r["speedup"] / r["paired_speedup"], r["paired_speedup"] / r["speedup"]) > DRIFT]
    if not off:
        return None
    group, r = off[0]
    return (f"{len(off)} speed-ups disagree with their cells' paired repeats by more than {DRIFT:g}× (e.g. "
            f"{group} {r['policy']} τ={r['threshold']:g}: {r['speedup']:.2f}× from the evaluations, "
            f"{r['paired_speedup']:.2f}× repeated beside full depth): the machine's speed changed between "
            "the cells; rerun them on an idle machine")


def report(cell_list: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    grouped = groups(cell_list)
    names = group_names(grouped)
    for key, points in sorted(grouped.items(), key=lambda kv: names[kv[0]]):
        higher = points[0].cell["quality"]["higher_is_better"]
        entry = {"higher_is_better": higher, "frontiers": {}, "policy_frontiers": {},
                 "matched_quality": matched_quality(points)}
        as_rows = lambda pts, axis: [{"policy": p.policy, "threshold": p.threshold, "quality": p.quality,  # noqa: E731
                                      "cost": p.cost(axis), "mode": p.mode} for p in pts]
        by_policy: dict[str, list[Point]] = {}
        for p in points:
            by_policy.setdefault(p.policy, []).append(p)
        for axis in COSTS:
            entry["frontiers"][axis] = as_rows(frontier(points, axis, higher), axis)
            entry["policy_frontiers"][axis] = {name: as_rows(frontier(pts, axis, higher), axis)
                                               for name, pts in sorted(by_policy.items())}
        out[names[key]] = entry
    return out


TABLES = ("frontier", "matched")


def check_table(table: str | None) -> None:
    if table is not None and table not in TABLES:
        raise ExitbenchError(f"--table must be one of {', '.join(TABLES)}; got {table!r}")


# How far a speed-up from two evaluations may stray from its paired repeats' before it says more about the
# machine than the exit: the repeats time a cell's first requests, whose exits differ from the whole set's,
# and on an idle machine the two agree within DRIFT on every embedded model's cells (bench/RESULTS.md).
DRIFT = 2.0


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


def format_tables(rep: dict[str, Any], fmt: str, table: str | None = None) -> str:
    """md / csv / json text of a report (the terminal's rich tables live in tables.py). CSV is one table per
    stream (the frontier unless `table` says matched); md and json hold both unless `table` picks one."""
    import json

    from tabulate import tabulate

    check_table(table)
    if fmt == "json":
        if table is None:
            return json.dumps(rep, indent=2)
        front, matched = table_rows(rep)
        return json.dumps(front if table == "frontier" else matched, indent=2)
    if fmt not in ("md", "csv"):
        raise ExitbenchError(f"--format must be one of rich, md, csv, json; got {fmt!r}")
    front, matched = table_rows(rep)
    if fmt == "csv":
        import csv
        import io

        rows = matched if table == "matched" else front
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue()
    parts = []
    if table in (None, "frontier"):
        parts.append("## Pareto frontiers\n\n" + tabulate(front, headers="keys", tablefmt="github", floatfmt=".4g"))
    if table in (None, "matched"):
        parts.append("## Matched quality\n\n" + tabulate(matched, headers="keys", tablefmt="github", floatfmt=".4g"))
    return "\n\n".join(parts) + "\n"


def check_plot_target(path: Path, axis: str) -> None:
    """Bad plot arguments fail before any cell is read."""
    if axis not in COSTS:
        raise ExitbenchError(f"plot cost must be one of {', '.join(COSTS)}; got {axis!r}")
    if Path(path).suffix not in (".png", ".svg"):
        raise ExitbenchError(f"--plot must name a .png or .svg file, got {path}")


def plot(cell_list: list[dict[str, Any]], path: Path, axis: str = "iterations"):
    """Quality against cost, drawn by `draw`, saved to `path` (.png or .svg). Returns the figure."""
    from ..runtime.files import atomic_write

    check_plot_target(path, axis)
    fig = draw(cell_list, axis)
    path = Path(path)
    atomic_write(path, lambda fh: fig.savefig(fh, format=path.suffix[1:]), mode="wb")
    return fig


def draw(cell_list: list[dict[str, Any]], axis: str = "iterations"):
    """Quality against cost, one panel per (task, metric): a curve per policy over its thresholds, the
    fixed-depth baselines as their own curve, the overall frontier highlighted. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    by_key = groups(cell_list)
    names = group_names(by_key)
    grouped = sorted(by_key.items(), key=lambda kv: names[kv[0]])
    fig, axes = plt.subplots(1, len(grouped), figsize=(6 * len(grouped), 4.5), squeeze=False)
    labels = []
    for ax, (key, points) in zip(axes[0], grouped):
        metric = key[1]
        higher = points[0].cell["quality"]["higher_is_better"]
        by_policy: dict[str, list[Point]] = {}
        for p in points:
            if p.cost(axis) is not None:
                by_policy.setdefault(p.policy, []).append(p)
        # tab20 when the default ten colours would repeat (a sweep of every policy has about fourteen).
        palette = plt.get_cmap("tab20" if len(by_policy) > 10 else "tab10")
        for i, (name, pts) in enumerate(sorted(by_policy.items())):
            pts.sort(key=lambda p: p.cost(axis))
            style = (dict(color="black", linestyle="--", marker="s") if name.startswith("fixed")
                     else dict(marker="o", color=palette(i % palette.N)))
            label = "fixed depth" if name == "fixed" else name
            ax.plot([p.cost(axis) for p in pts], [p.quality for p in pts], label=label, **style)
        front = frontier(points, axis, higher)
        # Thresholds are labelled on the overall frontier only (every policy's points pile up at full quality),
        # and a label that would overprint an earlier one is dropped once the figure is laid out.
        labels += [ax.annotate(f"{p.policy} {p.threshold:g}", (p.cost(axis), p.quality), fontsize=6, alpha=0.8,
                               xytext=(3, -8), textcoords="offset points") for p in front]
        ax.plot([p.cost(axis) for p in front], [p.quality for p in front], color="red", linewidth=3, alpha=0.35,
                label="frontier")
        ax.set_title(names[key].replace(f" · {metric}", ""))
        ax.set_xlabel({"iterations": "mean iterations per token", "wall_clock": "seconds per token",
                       "flops": "FLOPs per token"}[axis])
        ax.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
        # Seconds and FLOPs span orders of magnitude across policies (kl decodes at every step), and so does a
        # perplexity between depth 1 and full depth: on linear axes everything else sits in one corner.
        if axis != "iterations":
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overprint
            ax.set_xlabel(ax.get_xlabel() + " (log)")
        if not higher and all(p.quality > 0 for p in points):
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    fig.tight_layout()
    drop_overlapping(fig, labels)
    return fig


def drop_overlapping(fig, labels: list) -> None:
    """Remove each label whose rendered box overlaps one kept before it: measured on the laid-out figure, in
    points of text, so it holds whatever the axes' scales and the labels' lengths."""
    renderer = fig.canvas.get_renderer()
    kept = []
    for label in labels:
        box = label.get_window_extent(renderer)
        if any(box.overlaps(other) for other in kept):
            label.remove()
        else:
            kept.append(box)
