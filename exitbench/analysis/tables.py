"""Every table exitbench prints: on a terminal (rich) sweeps, frontiers, regressions, geometry, calibration,
traces and the depth report; as text (md, csv, json) the frontiers and the published numbers. Commands build
reports; this module only lays them out."""
from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import ExitbenchError
from ..store.cells import conjunction
from .frontier import collapse_tolerances, table_rows
from .labels import (PLAIN_OVERHEAD, SCHEDULE, config_label, deeper_said, depth_said, direction, metric_with_direction,
                     overhead, setting)
from ..timing.speedup import BEFORE_CLOCKS
from ..timing.speedup import NONE as NO_SPEEDUP
from ..timing.speedup import SpeedUp
from ..timing.speedup import legend
from ..timing.speedup import text as speedup_text
from ..timing.speedup import unreadable

TABLES = ("frontier", "matched")


def summary_table(rows: list[dict[str, Any]], title: str) -> Group:
    """`run`'s tables: one per task and metric (named in the title, with the metric's direction), a row per
    cell. No value is ever cut to an ellipsis (a narrow terminal folds the headings instead); the origin column
    only where some cell was not measured by this run, the speed-up only where some cell was retimed."""
    by_task: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_task.setdefault((r["task"], r["metric"]), []).append(r)
    return Group(*(_task_summary(f"{title}: {task} · {metric_with_direction(metric, group[0]['higher_is_better'])}"
                                 f"{_reference(group)}", group) for (task, metric), group in by_task.items()))


def _reference(rows: list[dict[str, Any]]) -> str:
    """` · full depth r = 16`: the depth the rows' speed-ups and overheads are against (none without one)."""
    depths = sorted({r["reference_depth"] for r in rows if r.get("reference_depth") is not None})
    return f" · full depth {', '.join(f'r = {d:g}' for d in depths)}" if depths else ""


def _task_summary(title: str, rows: list[dict[str, Any]]) -> Table:
    shown = [_summary_row(r) for r in rows]
    columns = [("policy", "left"), ("τ", "right"), ("quality", "right"), ("mean iters", "right"),
               ("ms/token", "right"), ("speed-up", "right"), ("overhead", "right"), ("schedule", "right"),
               ("bs1 speed-up", "right"), ("bs1 overhead", "right"), ("probe", "right"), ("cell", "left")]
    if all(r[-1] == "measured" for r in shown):
        columns, shown = columns[:-1], [r[:-1] for r in shown]
    # An empty column would push the table past 100 for nothing (the bs1 ones: cells before the two clocks).
    for empty in ("speed-up", "schedule", "bs1 speed-up", "bs1 overhead"):
        at = [c for c, _ in columns].index(empty)
        if all(r[at] == "-" for r in shown):
            columns, shown = columns[:at] + columns[at + 1:], [r[:at] + r[at + 1:] for r in shown]
    return Fitted(columns, shown, title=title, caption=timing_caption(rows), caption_justify="left")


class Fitted(Table):
    """A table no value of which is ever cut to an ellipsis: on a terminal too narrow for it, its headings fold at
    their spaces first, then a conjunction's name (`margin 0.125 ∧ argmax_stability`) and a speed-up's range do
    (two clocks' speed-ups side by side need it at 120 columns), then the headings' words are cut, the leftmost
    kept whole as far as the room goes. Rich's own shrinking takes the widest columns first, whatever their
    values need, and cuts them."""
    WRAPS = ("policy", "speed-up", "bs1 speed-up")

    def __init__(self, columns: list[tuple[str, str]], rows: list[list[str]], **kwargs: Any):
        """These (heading, justify) columns and rows of markup."""
        super().__init__(**kwargs)
        for col, justify in columns:
            self.add_column(col, justify=justify)
        for r in rows:
            self.add_row(*r)

    def __rich_console__(self, console, options):
        from rich.cells import cell_len

        def longest(texts, words: bool) -> int:
            return max((cell_len(w) for t in texts for w in (t.split() if words else [t])), default=0)

        values = [[Text.from_markup(c).plain for c in col.cells] for col in self.columns]
        heads = [str(col.header) for col in self.columns]
        # (what the borders and the cells' padding take: rich's own reckoning)
        room = (options.max_width - self._extra_width
                - sum(self._get_padding_width(i) for i in range(len(self.columns))))
        natural = [max(longest(v, False), longest([h], False)) for v, h in zip(values, heads)]
        folded = [max(longest(v, False), longest([h], True)) for v, h in zip(values, heads)]
        bare = [longest(v, col.header in self.WRAPS) for v, col in zip(values, self.columns)]
        wrapped = [max(width, longest([h], True)) for width, h in zip(bare, heads)]
        fit = next((widths for widths in (natural, folded, wrapped) if sum(widths) <= room), None)
        if fit is None:
            fit = bare
            for i, want in enumerate(wrapped):
                fit[i] += max(min(want - fit[i], room - sum(fit)), 0)
        for col, width in zip(self.columns, fit):
            col.width = None if fit is natural else width
        yield from super().__rich_console__(console, options)


def timing_caption(rows: list[dict[str, Any]], columns: str = "speed-up, overhead") -> str | None:
    """What a table's timing columns rest on: the speed-ups' bases, clocks (those of the table's `columns`, and
    its bs1 columns') and flags, replay's estimated clock, and overheads from the cells' own timings. None when
    there is nothing to say."""
    lines = [note for note in [late_note(rows)] if note]
    said = legend([(config_label(r["policy"], r["threshold"]), r["speedup"]) for r in rows if r.get("speedup")],
                  [(config_label(r["policy"], r["threshold"]), r["latency"]) for r in rows if r.get("latency")],
                  columns)
    if said:
        lines.append(said)
    estimated = next((r["clock_basis"] for r in rows if r.get("clock_basis")), None)
    if estimated:
        lines.append(f"≈ ms/token {estimated}")
    if any(r.get("overhead_timing") == "plain" for r in rows):
        lines.append(PLAIN_OVERHEAD)
    if any(r.get("schedule") is not None for r in rows):
        lines.append(SCHEDULE)
    return "\n".join(lines) or None


def _summary_row(r: dict[str, Any]) -> list[str]:
    iters = "-" if r["mean_iterations"] is None else f"{r['mean_iterations']:.2f}"
    if len(r.get("per_group", [])) > 1:  # several loop groups: their means beside the total
        iters += " (" + " + ".join(f"{m:.1f}" for m in r["per_group"]) + ")"
    quality = "n/a" if r["quality"] is None else f"{r['quality']:.4g}"  # a non-finite metric
    ms = ("≈" if r.get("clock_basis") else "") + f"{r['ms_per_token']:.3f}"
    return [_marked({**r, "mode": None}), setting(r["policy"], r["threshold"]), quality, iters, ms,
            _speedup_cell(r), overhead(r.get("overhead"), r.get("overhead_timing")), overhead(r.get("schedule")),
            *_latency_cells(r), f"{100 * r['probe_share']:.1f}%", r.get("origin", "measured")]


def _latency_cells(r: dict[str, Any]) -> list[str]:
    """The bs1 speed-up and overhead cells of a row: its latency clock's, marked as the throughput one's are."""
    return [_speedup_cell({"speedup": r.get("latency"), "warnings": r.get("latency_warnings")}),
            overhead(r.get("overhead_latency"))]


def _estimates(row: dict[str, Any]) -> dict[str, Any]:
    """A report row (`frontier.report`) with its speed-ups back as estimates on both clocks, as `run`'s rows hold
    them: `speedup` and `latency`."""
    return {**row, "speedup": SpeedUp.from_row(row), "latency": SpeedUp.from_row(row, "speedup_latency")}


def _speedup_cell(row: dict[str, Any]) -> str:
    """The row's speed-up over full depth (`timing.speedup.text`), in red with a mark when a warning says its
    timing is unreliable (a busy machine, a wide spread) or it is above its iteration bound."""
    est = row.get("speedup") or NO_SPEEDUP
    shown = speedup_text(est)
    if est.flagged:
        return f"[red]{escape(shown)}[/red]"
    # (full depth's own row is the reference, whatever its self-paired repeats spread: the warning names it)
    if not unreadable(est, row.get("warnings")):
        return escape(shown)
    # No number where none can be read (issue 72: a busy machine's 0.17× read as a result): `?`, and the
    # repeats' range where there are repeats, so the reader sees how far apart they fell.
    spread = f" ({est.low:.2f}–{est.high:.2f})" if est.low is not None and est.high is not None else ""
    return f"[red]?{spread} ![/red]"


def replay_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Replay vs exact per verified cell (exitbench.replay.verify)."""
    table = Table(title=title)
    for col in ("task", "policy", "τ", "quality replay", "quality exact", "± stderr", "iters replay",
                "iters exact", "Δ iters", "exits agree", "answers cut"):
        table.add_column(col, justify="left" if col in ("task", "policy") else "right")
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        table.add_row(r["task"], r["policy"], setting(r["policy"], r["threshold"]), num(r["quality_replay"], ".4g"),
                      num(r["quality_exact"], ".4g"), num(r["stderr_exact"], ".2g"),
                      num(r["iterations_replay"], ".2f"), num(r["iterations_exact"], ".2f"),
                      num(r["iterations_rel_diff"], "+.1%"), num(r["exit_agreement"], ".1%"),
                      num(r["diverged_share"], ".0%"))
    return table


def reuse_note(reused: list[dict[str, Any]], out) -> str | None:
    """What a rerun takes from disk instead of computing: how many cells, and when they were measured."""
    if not reused:
        return None
    started = sorted(c["run"]["started"] for c in reused)
    runs = len({c["run"].get("run_id") for c in reused})
    when = started[0] if started[0] == started[-1] else f"{started[0]} to {started[-1]}"
    # Said as a note, not a warning: adding rules to a sweep's directory is how a sweep grows (the quickstart's
    # second step), and each cell's paired speed-up was timed beside full depth in its own run.
    note = (f"note: reusing {len(reused)} cell(s) already in {out}, measured {when} by {runs} earlier run(s); each "
            "keeps the timings of its own run (a fresh --out measures everything now)")
    broken = [c for c in reused if (c.get("numerics") or {}).get("nonfinite_tokens")]
    if broken:
        note += (f"\nwarning: {len(broken)} reused cell(s) had tokens whose states or logits went NaN or infinite "
                 f"(numerics.nonfinite_tokens), e.g. {broken[0]['task']['name']} {broken[0]['policy']['policy']}: "
                 "their numbers are not to be trusted")
    return note


def pareto_tables(rep: dict[str, Any], table: str | None = None) -> list[Table]:
    """Per group: the matched-quality table, then the frontiers over mean iterations and, where the cells carry
    timings, over wall-clock (or only `table`: matched, or frontier for both frontiers)."""
    out = []
    for group, entry in rep.items():
        if table in (None, "matched"):
            out.append(_matched_table(group, entry))
        if table in (None, "frontier"):
            out.append(_frontier_table(group, entry))
            if entry["frontiers"].get("wall_clock"):
                out.append(_wall_clock_table(group, entry))
    return out


def _matched_table(group: str, entry: dict[str, Any]) -> Table:
    rows = [_estimates(r) for r in collapse_tolerances(entry["matched_quality"])]
    scheduled = any(r.get("schedule") is not None for r in rows)  # (cells retimed before it have none)
    # (cells retimed before the two clocks have no latency clock)
    bs1 = any(r["latency"].value is not None or r.get("overhead_latency") is not None for r in rows)
    columns = [(col, "left" if col == "policy" else "right")
               for col in ("ε", "policy", "τ", "quality", "mean iters", "speed-up", "overhead",
                           *(["schedule"] if scheduled else []), *(["bs1 speed-up", "bs1 overhead"] if bs1 else []),
                           "iters / oracle")]
    shown = []
    for r in rows:
        eps = f"{100 * r['tolerance']:g}" + (f"–{100 * r['max_tolerance']:g}" if r["max_tolerance"] > r["tolerance"]
                                             else "")
        shown.append([f"{eps}%", _marked(r), setting(r["policy"], r["threshold"]), f"{r['quality']:.4g}",
                      f"{r['mean_iterations']:.2f}",
                      _speedup_cell({"speedup": r["speedup"], "warnings": r.get("timing_warnings")}),
                      overhead(r.get("overhead"), r.get("overhead_timing")),
                      *([overhead(r.get("schedule"))] if scheduled else []),
                      *(_latency_cells(r) if bs1 else []),
                      "-" if r["iterations_over_oracle"] is None else f"{r['iterations_over_oracle']:.2f}"])
    return Fitted(columns, shown, title=f"{entry.get('title', group)}: matched quality (ε relative to full depth "
                                        f"{depth_said(entry)}; {direction(entry['higher_is_better'])})",
                  caption="\n".join(c for c in (deeper_said(entry), timing_caption(rows)) if c) or None,
                  caption_justify="left")


def _frontier_table(group: str, entry: dict[str, Any]) -> Table:
    f = Table(title=f"{entry.get('title', group)}: frontier over mean iterations")
    for col in ("policy", "τ", "quality", "mean iters"):
        f.add_column(col, justify="left" if col == "policy" else "right")
    for p in entry["frontiers"]["iterations"]:
        f.add_row(_marked(p), setting(p["policy"], p["threshold"]), f"{p['quality']:.4g}", f"{p['cost']:.2f}")
    f.caption = late_note(entry["frontiers"]["iterations"])
    return f


def _wall_clock_table(group: str, entry: dict[str, Any]) -> Table:
    """The frontier over time per token: full depth's, divided by each cell's speed-up where the cell was retimed
    beside it (`frontier.price_wall_clock`), so its order is the speed-ups' order."""
    rows = entry["frontiers"]["wall_clock"]
    f = Table(title=f"{entry.get('title', group)}: frontier over wall-clock on the {wall_clock_said(rows)} "
                    f"(speed-ups over full depth {depth_said(entry)})", caption_justify="left")
    for col in ("policy", "τ", "quality", "ms/token", "speed-up"):
        f.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "speed-up")
    for p in rows:
        f.add_row(_marked(p), setting(p["policy"], p["threshold"]), f"{p['quality']:.4g}",
                  ("≈" if p.get("mode") == "replay" else "") + f"{1e3 * p['cost']:.3f}",
                  _speedup_cell({"speedup": SpeedUp.from_row(p)}))
    caption = [timing_caption([{**p, "speedup": SpeedUp.from_row(p)} for p in rows], "speed-up")]
    if any(p.get("mode") == "replay" for p in rows):
        caption.append("≈ ms/token estimated by replay's cost model (ᴿ cells), not timed")
    f.caption = "\n".join(c for c in caption if c) or None
    return f


def wall_clock_said(rows: list[dict[str, Any]]) -> str:
    """Which clock a wall-clock frontier's points were timed on, as its title says it: the throughput clock,
    or the one clock of cells written before the two (timing/speedup.py BEFORE_CLOCKS) where all were."""
    clocks = {r.get("clock") for r in rows if r.get("clock")}
    return "batch clock (before two clocks)" if clocks == {BEFORE_CLOCKS} else "throughput clock"


def _marked(row: dict[str, Any]) -> str:
    """A policy name, with a mark when its number comes from a replay cell rather than an exact run, and one when
    its rule can exit only in the last iteration or two before full depth."""
    return row["policy"] + (" ᴿ" if row.get("mode") == "replay" else "") + (" †" if row.get("late_exit") else "")


def late_note(rows: list[dict[str, Any]]) -> str | None:
    """What a table's † says, with the earliest iterations its marked rows can exit at."""
    first = sorted({r["earliest_exit"] for r in rows if r.get("late_exit") and r.get("earliest_exit")})
    if not first:
        return None
    return (f"† the rule's definition lets it exit no earlier than iteration {' or '.join(map(str, first))}: only "
            "the last iteration or two before full depth are left to save")


def check_table(table: str | None) -> None:
    if table is not None and table not in TABLES:
        raise ExitbenchError(f"--table must be one of {', '.join(TABLES)}; got {table!r}")


def format_tables(rep: dict[str, Any], fmt: str, table: str | None = None) -> str:
    """md / csv / json text of a report (the terminal's are `pareto_tables`). CSV is one table per stream (the
    frontier unless `table` says matched); md and json hold both unless `table` picks one."""
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
            # (wall-clock rows carry their speed-up's fields, the other axes' none: every row's fields, in order)
            writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue()
    parts = []
    if table in (None, "frontier"):
        parts.append("## Pareto frontiers\n\n" + tabulate(front, headers="keys", tablefmt="github", floatfmt=".4g"))
    if table in (None, "matched"):
        parts.append("## Matched quality\n\n" + tabulate(matched, headers="keys", tablefmt="github", floatfmt=".4g"))
    return "\n\n".join(parts) + "\n"


def regression_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("what", "cell", "baseline", "run"):
        table.add_column(col, justify="right" if col in ("baseline", "run") else "left")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        table.add_row(r["what"], r["cell"], fmt(r["baseline"]), fmt(r["run"]))
    return table


def geometry_tables(report: dict[str, Any]) -> list[Table]:
    """Per loop group of the last checkpoint: the mean of each quantity per k; then the hand-off drift ratios."""
    entry = report["checkpoints"][-1]
    tables = []
    fmt = lambda v: "" if v is None else f"{v:.3g}"  # noqa: E731
    for group in entry["groups"]:
        t = Table(title=f"{group['name']}: mean over {entry['tokens']:,} tokens ({entry['path']})")
        for col in ("k", "‖Δ_k‖", "‖Δ_k‖/‖s_k‖", "cos(Δ_k,Δ_k−1)", "‖Δ_k−Δ_k−1‖", "|‖Δ_k‖−‖Δ_k−1‖|"):
            t.add_column(col, justify="right")
        for row in group["per_k"]:
            t.add_row(str(row["k"]), *[fmt(row[q]["mean"]) for q in ("step", "rel_step", "cosine", "accel",
                                                                       "accel_mag")])
        tables.append(t)
    if report["checkpoints"][0]["handoffs"]:
        t = Table(title="drift-to-loop ratio at hand-offs (mean over tokens)")
        for col in ("checkpoint", "hand-off", "first step of next group", "next group's entry"):
            t.add_column(col)
        for e in report["checkpoints"]:
            for h in e["handoffs"]:
                t.add_row(str(e.get("training_step") or e["path"]), f"{h['from']} → {h['to']}",
                          fmt(h["first_step"]["mean"]), fmt(h["entry"]["mean"]))
        tables.append(t)
    return tables


def calibration_table(report: dict[str, Any]) -> Table:
    """Every threshold from the most conservative, with the one calibration chose marked."""
    eps, delta = report["epsilon"], report["delta"]
    cfg = report["config"]
    t = Table(title=f"calibrate {cfg['policy']}: risk ≤ {eps:g} with probability ≥ {1 - delta:g} "
                    f"({report['documents']['calibration']} documents; full depth "
                    f"{report['full_depth_iterations']:.2f} iterations)")
    for col in ("threshold", "risk", "p-value", "mean iterations", ""):
        t.add_column(col, justify="right")
    chosen = report["chosen"]
    for row in report["thresholds"]:
        mark = "chosen" if chosen is not None and row["threshold"] == chosen["threshold"] else (
            "safe" if row["accepted"] else "")
        t.add_row(f"{row['threshold']:.3g}", f"{row['risk']:.4f}", f"{row['p_value']:.3g}",
                  f"{row['mean_iterations']:.2f}", mark)
    if chosen is None:
        t.caption = "no threshold passed: even the most conservative one could not be shown safe; use full depth"
        if report["documents"]["calibration"] < report["documents_needed"]:
            t.caption += (f" (with ε = {eps:g} and δ = {delta:g} that takes at least {report['documents_needed']} "
                          "calibration documents)")
    elif report["held_out"]:
        h = report["held_out"]
        t.caption = (f"held out ({h['documents']} documents): risk {h['risk']:.4f}, "
                     f"{h['mean_iterations']:.2f} mean iterations")
    return t


def exit_model_tables(content: dict[str, Any]) -> list[Table]:
    """A fitted exit model: its exits per threshold on the validation documents, and what each feature weighs."""
    valid = content["metrics"]["validation"]
    data = content["data"]
    exits = Table(title=f"learned exit rule, validation ({data['validation_documents']} documents): log loss "
                        f"{valid['log_loss']:.4f}, AUC {valid['auc']:.4f}; the oracle exits at "
                        f"{valid['oracle_mean_iterations']:.2f} iterations")
    for col in ("threshold", "mean iterations", "over oracle", "tokens changed"):
        exits.add_column(col, justify="right")
    for row in valid["by_threshold"]:
        exits.add_row(f"{row['threshold']:g}", f"{row['mean_iterations']:.2f}",
                      f"{row['mean_iterations'] / valid['oracle_mean_iterations']:.2f}×",
                      f"{100 * row['disagreement']:.2f}%")
    gained = content["metrics"]["permutation_log_loss_increase"]
    weights = Table(title=f"{content['kind']} on {len(content['features'])} features: held-out log loss gained "
                          "when one is shuffled")
    for col in ("feature", "Δ log loss"):
        weights.add_column(col, justify="left" if col == "feature" else "right")
    for name in sorted(gained, key=lambda f: -gained[f]):
        weights.add_row(name, f"{gained[name]:+.5f}")
    return [exits, weights]


def trace_table(report: dict[str, Any]):
    knobs = report["policy"]
    window = f", KV window {knobs['kv_window']}" if knobs.get("kv_window") else ""
    title = (f"{rule_and_threshold(knobs)} (patience {knobs['patience']}, max {knobs['max_steps']}"
             f"{window}) · {report['mode']} · mean iterations {report['mean_iterations']:.2f}")
    table = Table(title=title)
    for col in ("input token", "next token", "log p", "greedy", "exit step"):
        table.add_column(col, justify="right" if col in ("log p", "exit step") else "left")
    for row in report["tokens"]:
        table.add_row(row["input"], row["next"], f"{row['logprob']:.3f}", "yes" if row["greedy"] else "no",
                      ", ".join(map(str, row["exit_steps"])))
    return table


def rule_and_threshold(knobs: dict[str, Any]) -> str:
    """A rule and its τ as a title says them; a conjunction by its rules, its τ named as its varied rule's
    (`margin 0.125 ∧ argmax_stability, argmax_stability τ=5`: "all_of τ=5" says nobody's)."""
    if not knobs.get("rules"):
        return config_label(knobs["policy"], knobs["threshold"])
    vary = knobs.get("vary") or next((r["policy"] for r in knobs["rules"] if r.get("threshold") is None),
                                     knobs["rules"][0]["policy"])
    return f"{conjunction(knobs)}, {config_label(vary, knobs['threshold'])}"


def depth_tables(report: dict[str, Any]) -> list:
    """Rich tables of a depth report: accuracy by hop and perplexity per r, then step norms per k."""
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


def plan_table(plan: dict[str, Any]) -> Table:
    """The memory plan of `exitbench info --plan`: what each part needs, in GB, and what it is."""
    def gb(n: int) -> str:
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if n >= scale:
                return f"{n / scale:,.2f} {unit}"
        return f"{n} B"

    kv = plan["kv_layout"]
    steps = ", ".join(str(r) for r in plan["max_steps"])
    slots = ", ".join(str(n) for n in kv["slots_per_loop_layer"])
    window = f", KV window {plan['kv_window']}" if plan.get("kv_window") else ""
    table = Table(title=f"memory plan: batch {plan['batch_size']}, context {plan['context']:,}, max steps {steps}"
                        f"{window}, {plan['dtype']}")
    for col in ("part", "bytes", "what"):
        table.add_column(col)
    table.add_row("weights", gb(plan["weights"]), "every parameter once (a tied head counted once)")
    states = f", and {kv['state_layers']} layers of per-position states beside them" if kv.get("state_layers") else ""
    table.add_row("KV cache", gb(plan["kv_cache"]),
                  f"{kv['loop_layers']} loop layers × {slots} slots + {kv['plain_layers']} plain layers × 1 slot, "
                  f"{gb(kv['bytes_per_slot'])} a slot{states}")
    terms = ", ".join(f"{k} {gb(v)}" for k, v in plan["activation_terms"].items())
    table.add_row("activations", gb(plan["activations"]), f"estimate of the largest transient: {terms}")
    if "wave" in plan:
        w = plan["wave"]
        table.add_row("scoring wave", f"{w['tokens']:,} tokens", f"depth-major: {plan['batch_size']} rows × "
                      f"{w['block_positions']:,} positions iterate together; their key gather {gb(w['gather_bytes'])}")
    table.add_row("total", gb(plan["total"]), "")
    if plan.get("available") is not None:
        fits = "fits" if plan["total"] <= plan["available"] else "does NOT fit"
        table.add_row(f"free on {plan['device']}", gb(plan["available"]),
                      f"{fits} ({plan['total'] / plan['available']:.1%} of it)")
    if plan.get("largest_batch") is not None:
        table.add_row("largest batch", f"{plan['largest_batch']:,} rows",
                      f"that fit in {plan['device']} at this context and depth")
    return table


def published_table(rows: list[dict[str, Any]]) -> Table:
    """Fixed-depth cells of a preset's run beside the numbers its paper reports (presets.published_rows)."""
    t = Table(title="published vs measured (fixed depth, percent)")
    for col in ("preset", "task", "metric", "r", "published", "measured", "limit"):
        t.add_column(col, justify="right" if col in ("r", "published", "measured") else "left")
    for r in rows:
        measured = "—" if r["measured"] is None else f"{r['measured']:.2f}"
        t.add_row(r["preset"], r["task"], r["metric"], str(r["depth"]), f"{r['published']:.2f}", measured,
                  "all" if r["limit"] is None else f"{r['limit']:g}")
    return t


def published_markdown(rows: list[dict[str, Any]]) -> str:
    """`published_table` as a markdown table, after a blank line (pareto --format md)."""
    from tabulate import tabulate

    shown = [{k: v for k, v in r.items() if k not in ("source", "same_model")} for r in rows]
    return "\n" + tabulate(shown, headers="keys", tablefmt="github", floatfmt=".2f")


def preset_fields(p) -> dict[str, str]:
    """A preset as the fields a reader compares: where its model, tasks, prompt and numbers come from."""
    prompt = ", ".join(x for x in ("chat template" if p.apply_chat_template else "",
                                   "multi-turn" if p.fewshot_as_multiturn else "",
                                   "system prompt" if p.system_instruction else "",
                                   "BOS" if p.add_bos_token else "") if x) or "plain"
    rules = "; ".join(f"{name} τ {','.join(f'{t:g}' for t in p.thresholds[name])}" if name in p.thresholds
                      else f"{name} (the model's grid)" for name in p.policies)
    knobs = ", ".join(f"{k} {v}" for k, v in p.exit.items())
    return {"name": p.name, "checkpoint": p.checkpoint, "tasks": ", ".join(p.tasks),
            "shots": "" if p.num_fewshot is None else str(p.num_fewshot), "prompt": prompt, "dtype": p.dtype,
            "depths": ",".join(map(str, p.baselines)),
            "rules": rules + (f" ({knobs})" if knobs else "") if rules else "fixed depths only",
            "published in": p.source}


def presets_tables(presets: list) -> list[Table]:
    """One small table per preset, its fields down the side: whole at any width (a row per preset would cut its
    source and tasks to a few letters on a terminal of 100 columns)."""
    out = []
    for p in presets:
        fields = preset_fields(p)
        t = Table(title=f"--preset {fields.pop('name')}", show_header=False, title_justify="left")
        t.add_column("field", style="bold", no_wrap=True)
        t.add_column("value", overflow="fold")
        for key, value in fields.items():
            t.add_row(key, value)
        out.append(t)
    return out


def presets_markdown(presets: list) -> str:
    """The presets as one markdown table (`exitbench presets --format md`)."""
    from tabulate import tabulate

    return tabulate([preset_fields(p) for p in presets], headers="keys", tablefmt="github")
