"""One self-contained HTML page per sweep: what `exitbench report RESULTS_DIR` writes.

The page holds the frontier plots per cost axis, the matched-quality tables, each policy's histogram of
iterations per token, exit maps of the documents where the policies disagree most (from `--log-samples`
files), the geometry figures of any geometry report in the directory, and every cell's provenance. Images are
PNGs inlined as data URIs and the styles and the one small script (click a column head to sort) are inline, so
the file opens anywhere with no network, and can be mailed or attached to a CI run as it is. Matplotlib draws
the figures and string formatting makes the page: no template engine or plotting library beyond what the
other commands already use.

A part whose input is missing (no samples files, no geometry report, no cost measured on an axis) becomes a
line saying what is missing and how to get it, never an empty section or an error.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..errors import ExitbenchError
from ..presets import published_rows
from ..runtime.files import atomic_write
from ..store.disk import samples_path
from ..store.loading import load_paths, model_label
from ..timing.speedup import BEFORE_CLOCKS, SpeedUp, unreadable
from ..timing.speedup import text as speedup_text
from . import compare, exitmap, frontier, notes
from .labels import deeper_said, depth_said, direction, overhead, setting
from .plot import draw

# Bases whose speed-up is no timing of this run's: shown as text (≈2.13×), never sorted among timed ones.
UNTIMED = ("estimated",)
MATCHED_TOLERANCE = 0.01  # the operating point a policy is shown at: its cheapest cell within 1% of full depth
COST_TITLES = {"iterations": "mean iterations per token", "wall_clock": "wall-clock per token (throughput clock)",
               "flops": "FLOPs per token"}


# ---- choosing what to show ------------------------------------------------------------------------------------
def operating_points(points: list[frontier.Point], matched: list[dict[str, Any]]) -> dict[str, frontier.Point]:
    """One cell per policy: its matched-quality cell at 1%, or (a policy that never gets within 1%) its best
    quality; fixed depth at full depth. These are the cells the histograms and exit maps compare."""
    chosen = {r["policy"]: r["threshold"] for r in matched if r["tolerance"] == MATCHED_TOLERANCE}
    by_policy: dict[str, list[frontier.Point]] = {}
    for p in points:
        by_policy.setdefault(p.policy, []).append(p)
    higher = points[0].cell["quality"]["higher_is_better"]
    out = {}
    for name, pts in sorted(by_policy.items()):
        if name == "fixed":
            out[name] = frontier.full_depth(points)
        elif name in chosen:
            out[name] = next(p for p in pts if p.threshold == chosen[name])
        else:
            out[name] = max(pts, key=lambda p: (p.quality if higher else -p.quality, -(p.cost("iterations") or 0)))
    return out


def score_metric(samples: list[dict[str, Any]]) -> str | None:
    """The per-document metric that says right or wrong: the first of the samples' metrics that is 0 or 1 on
    every one (exact_match, acc). A per-document perplexity is a log-likelihood, which always differs, so it
    says nothing about agreement; then there is none."""
    names = samples[0].get("metrics") or [] if samples else []
    for name in names:
        if all(s.get(name) in (0, 1) for s in samples):  # True and False compare equal to 1 and 0
            return name
    return None


def read_samples(path: Path) -> dict[Any, dict[str, Any]]:
    """doc_id → sample of one samples file (the first sample of a doc: lm-eval writes one per doc), or
    ExitbenchError naming the file and line when a line is not a sample (truncated, binary, another shape)."""
    from ..runtime.validation import parse
    from ..store.schema import Sample

    out: dict[Any, dict[str, Any]] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                what = f"samples file {path}, line {number}"
                try:
                    sample = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ExitbenchError(f"{what} is not JSON ({exc.msg}); rerun the cell with --log-samples") \
                        from None
                parse(Sample, sample, what)
                out.setdefault(sample["doc_id"], sample)
    except UnicodeDecodeError:
        raise ExitbenchError(f"samples file {path} is not UTF-8 text; rerun the cell with --log-samples") from None
    except OSError as exc:
        raise ExitbenchError(f"cannot read samples file {path}: {exc.strerror or exc}") from None
    return out


def disagreement(samples: list[dict[str, Any]], metric: str | None, reference: dict[str, Any] | None = None
                 ) -> tuple[bool, float, float]:
    """How much the policies disagree on one document: whether their scores differ (full depth's `reference`
    sample among them, where there is one), then the spread of their mean iterations, then the spread of exit
    steps inside the document. Sorting on this puts first the documents where one rule is wrong and another
    right; with one policy alone, those it gets wrong, then those whose map varies most."""
    scores = {s.get(metric) for s in samples + ([reference] if reference else [])} if metric else set()
    means = [s.get("exitbench", {}).get("mean") or 0.0 for s in samples]
    steps = [e for s in samples for e in _exit_totals(s)]
    return len(scores) > 1, max(means) - min(means), (max(steps) - min(steps)) if steps else 0.0


def _exit_totals(sample: dict[str, Any]) -> list[float]:
    """Each token's iterations summed over loop groups (exit_steps holds a step per group); an entry that is no
    list of finite numbers counts for nothing (exit maps draw what they can of a damaged file)."""
    out = []
    for entry in (sample.get("exitbench") or {}).get("exit_steps") or []:
        parts = entry if isinstance(entry, list) else [entry]
        if parts and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                         for x in parts):
            out.append(float(sum(parts)))
    return out


def doc_maps(points: dict[str, frontier.Point], paths: dict[str, Path], docs: int) -> tuple[list[str], str | None]:
    """HTML blocks of the `docs` documents where the policies' operating points disagree most, and a note on
    what was left out (policies without samples at their operating point)."""
    with_samples = {name: p for name, p in points.items() if samples_path(paths[p.cell["cell_id"]]).exists()}
    missing = sorted(set(points) - set(with_samples) - {"fixed"})
    # Full depth shades every token alike; it is worth a row only when nothing else has samples.
    shown = {n: p for n, p in with_samples.items() if n != "fixed"} or with_samples
    note = None
    if missing:
        note = (f"no samples at the operating point of {', '.join(missing)}: rerun the sweep with --log-samples "
                "to add them")
    if not shown:
        return [], note or "no samples files here: rerun the sweep with --log-samples to see exit maps"
    loaded = {name: read_samples(samples_path(paths[p.cell["cell_id"]])) for name, p in shown.items()}
    # full depth's scores, where it has samples and is not drawn itself: a document a rule gets wrong ranks first
    reference = (read_samples(samples_path(paths[with_samples["fixed"].cell["cell_id"]]))
                 if "fixed" in with_samples and "fixed" not in shown else {})
    common = set.intersection(*(set(s) for s in loaded.values()))
    metric = score_metric([s for by_doc in loaded.values() for s in by_doc.values()])

    def rank(d):
        return disagreement([loaded[n][d] for n in loaded], metric, reference.get(d)), str(d)

    ranked = sorted(common, key=rank, reverse=True)
    blocks = []
    for doc in ranked[:docs]:
        maps = [exitmap.from_sample(loaded[name][doc], p.cell["policy"], metric) for name, p in shown.items()]
        differ, spread, _ = disagreement([loaded[n][doc] for n in loaded], metric, reference.get(doc))
        why = ("scores differ" if differ else "same score") + f", mean iterations spread {spread:.2f}"
        blocks.append(f'<div class="doc" data-doc="{html.escape(str(doc))}"><h4>document {html.escape(str(doc))} '
                      f'<small>({why})</small></h4>{exitmap.html_fragment(maps)}</div>')
    return blocks, note


# ---- figures --------------------------------------------------------------------------------------------------
FIGURE_DPI = 130  # an 8-inch frontier panel is 1040 px: about the page's width (STYLE's max-width)


def png_uri(fig) -> str:
    """A figure as an inline PNG data URI (closed after drawing: a report draws many)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    # drawn at FIGURE_DPI and shown at the page's width (STYLE's img.figure): labels stay legible when scaled
    fig.savefig(buf, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def file_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def histogram_figure(task: str, points: dict[str, frontier.Point]):
    """Small multiples: per policy at its operating point, the share of tokens at each iteration count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(points)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 2.1 * rows + 0.4), squeeze=False, sharex=True)
    deepest = max(int(k) for p in points.values() for k in p.cell["iterations"].get("histogram", {}) or {"1": 0})
    for ax, name in zip(axes.flat, names):
        it = points[name].cell["iterations"]
        hist = {int(k): v for k, v in (it.get("histogram") or {}).items()}
        total = sum(hist.values()) or 1
        ax.bar(list(hist), [v / total for v in hist.values()], width=0.85, color="#2c7fb8")
        mean = it.get("mean")
        # Two short lines: one long line per panel ran into its neighbours' titles.
        ax.set_title(f"{exitmap.policy_label(points[name].cell['policy'])}"
                     + (f"\nmean {mean:.2f}" if mean is not None else ""), fontsize=7, linespacing=1.1)
        ax.set_xlim(0.3, deepest + 0.7)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.supxlabel("iterations per token (summed over loop groups)", fontsize=8)
    fig.supylabel("share of tokens", fontsize=8)
    fig.suptitle(f"{task}: iterations per token at each policy's operating point", fontsize=9)
    # Fixed margins (inches) rather than tight_layout, which measures every tick label and is most of the cost.
    height = 2.1 * rows + 0.4
    fig.subplots_adjust(left=0.7 / (3.1 * cols), right=0.98, bottom=0.55 / height, top=1 - 0.6 / height,
                        hspace=0.75, wspace=0.25)
    return fig


# ---- tables ---------------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset(),
          shown: dict[int, Callable[[float], str]] | None = None) -> str:
    """An HTML table; numeric columns right-aligned and sorted as numbers by the page's script (data-v), each
    number written by `shown[column]` where given (a speed-up as 2.13×), else to four digits; text in a numeric
    column (a depth as r = 16, a spread as ±5%) right-aligned beside them."""
    head = "".join(f'<th class="{"num" if i in numeric else ""}">{html.escape(h)}</th>' for i, h in enumerate(headers))
    body = []
    for row in rows:
        tds = []
        for i, v in enumerate(row):
            if i in numeric and isinstance(v, (int, float)) and not isinstance(v, bool):
                tds.append(f'<td class="num" data-v="{v!r}">{html.escape((shown or {}).get(i, _fmt)(v))}</td>')
            elif i in numeric and v is not None:
                tds.append(f'<td class="num">{html.escape(str(v))}</td>')
            else:
                tds.append(f"<td>{html.escape('' if v is None else str(v))}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    # (in a box that scrolls sideways: a wide table is scrolled, never cut off at the page's edge)
    return (f'<div class="wide"><table class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
            "</tbody></table></div>")


def _fmt(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


def matched_table(entry: dict[str, Any]) -> str:
    """One row per policy, sorted by its iterations at ε = 1%: its point there, and its iterations at the other
    tolerances (a policy with no cell within some ε has no number there)."""
    at: dict[str, dict[float, dict[str, Any]]] = {}
    for r in entry["matched_quality"]:
        at.setdefault(r["policy"], {})[r["tolerance"]] = r
    others = [t for t in frontier.TOLERANCES if t != MATCHED_TOLERANCE]
    rows = []
    for policy, rs in at.items():
        main = rs.get(MATCHED_TOLERANCE, {})
        speed, bs1 = SpeedUp.from_row(main), SpeedUp.from_row(main, "speedup_latency")
        rows.append([policy, _setting(policy, main.get("threshold")), main.get("quality"), main.get("mean_iterations"),
                     *_speedup_cells(speed, main.get("timing_warnings")), speed.basis,
                     # a plain one as text, marked, so it never reads as the paired kind
                     main.get("overhead") if main.get("overhead_timing") != "plain"
                     else overhead(main["overhead"], "plain"),
                     main.get("schedule"), *_speedup_cells(bs1, main.get("latency_warnings")),
                     main.get("overhead_latency"),
                     main.get("iterations_over_oracle"),
                     *[rs[t]["mean_iterations"] if t in rs else None for t in others]])
    rows.sort(key=lambda r: (r[3] is None, r[3] or 0, r[0]))
    pct = f"{100 * MATCHED_TOLERANCE:g}%"
    headers = ["policy", f"τ at {pct}", "quality", f"mean iterations at {pct}", "speed-up", "range of repeats",
               "timed by", "overhead", "schedule", "bs1 speed-up", "bs1 range", "bs1 overhead", "iterations / oracle",
               *[f"iterations at {100 * t:g}%" for t in others]]
    for empty in ("range of repeats", "schedule", "bs1 speed-up", "bs1 range", "bs1 overhead"):
        at = headers.index(empty)
        if all(r[at] is None for r in rows):
            # A sweep never retimed (or retimed before schedules were counted, or before the two clocks) would show
            # an empty column that pushes the table past a laptop's width.
            del headers[at]
            rows = [r[:at] + r[at + 1:] for r in rows]
    # a speed-up reads as 2.13×, a range as 1.98–2.27× and a fixed depth as r = 16, as in `pareto`
    times = lambda v: f"{v:.2f}×"  # noqa: E731
    formats = {"speed-up": times, "bs1 speed-up": times, "overhead": overhead, "schedule": overhead,
               "bs1 overhead": overhead}
    return table(headers, rows, numeric=set(range(1, len(headers))),
                 shown={headers.index(h): f for h, f in formats.items() if h in headers})


def _speedup_cells(speed: SpeedUp, warnings: list[str] | None = None) -> list[Any]:
    """A speed-up and its repeats' range as two cells: the value a number (sortable), except a flagged one or
    replay's estimate, as text, marked, and one whose timing a warning discredits, `? !` (as `pareto` shows it),
    so none of them sorts or reads as a result."""
    if unreadable(speed, warnings):
        return ["? !", None if speed.low is None else f"{speed.low:.2f}–{speed.high:.2f}×"]
    value = speedup_text(speed, interval=False) if speed.flagged or speed.basis in UNTIMED else speed.value
    return [value, None if speed.low is None else f"{speed.low:.2f}–{speed.high:.2f}×"]


def _setting(policy: str, threshold: Any) -> Any:
    """A threshold as a number (sortable); a fixed depth as `r = 16`."""
    return setting(policy, threshold) if policy.startswith("fixed") else threshold


MACHINE_FIELDS = ("cpu", "cpu_capability", "platform", "python", "cpu_threads")


def provenance(found: list[tuple[Path, dict[str, Any]]], root: Path) -> str:
    """What every cell was measured with: the distinct values first (most sweeps have one of each), then each
    cell's row, sorted by task, policy and threshold."""
    def fields(cell: dict[str, Any]) -> dict[str, str]:
        run, model = cell["run"], cell["model"]
        machine = run.get("machine") or {}
        return {
            "model": f"{model.get('source') or model.get('path')} ({model['architecture']}, {model['dtype']})",
            "fingerprint": model["fingerprint"],
            "versions": ", ".join(f"{k} {v}" for k, v in sorted((run.get("versions") or {}).items())),
            "git revision": str(run.get("git_revision")),
            "machine": " · ".join(str(machine[k]) for k in MACHINE_FIELDS if machine.get(k))
                       + f" · {run.get('device')} · host {run.get('host')}",
            "run": f"{run.get('run_id')} (batch {run.get('batch_size')}, seed {run.get('seed')})",
        }

    per_cell = [(path, cell, fields(cell)) for path, cell in found]
    summary = []
    for name in ("model", "fingerprint", "versions", "git revision", "machine", "run"):
        counts = Counter(f[name] for _, _, f in per_cell)
        for value, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            summary.append([name, value, n])
    modes = any("mode" in c for _, c, _ in per_cell)
    headers = ["task", "policy", "τ", "quality", "mean iterations", "fingerprint", "git revision", "run",
               "started", "file"] + (["mode"] if modes else [])
    rows = []
    for path, cell, f in sorted(per_cell, key=lambda t: (t[1]["task"]["name"], frontier.Point(t[1]).policy,
                                                         t[1]["policy"]["threshold"])):
        row = [cell["task"]["name"], frontier.Point(cell).policy,
               _setting(cell["policy"]["policy"], cell["policy"]["threshold"]), cell["quality"]["value"],
               cell["iterations"]["mean"], f["fingerprint"], f["git revision"][:12], cell["run"].get("run_id"),
               cell["run"]["started"], str(path.relative_to(root))]
        rows.append(row + ([cell.get("mode", "exact")] if modes else []))
    return (table(["field", "value", "cells"], summary, numeric={2})
            + f"<details><summary>every cell ({len(rows)})</summary>"
            + table(headers, rows, numeric={2, 3, 4}) + "</details>")


# ---- the page -------------------------------------------------------------------------------------------------
STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 0 auto; padding: 1em 1.5em;
       max-width: 1180px; color: #222; line-height: 1.4; }
h1 { font-size: 1.4em; margin-bottom: .2em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ddd;
     padding-bottom: .2em; margin-top: 1.6em; } h3 { font-size: 1em; } h4 { font-size: .9em; margin: 1em 0 .3em; }
h4 small, .muted { color: #777; font-weight: normal; }
nav a { margin-right: 1em; font-size: .9em; }
img { max-width: 100%; height: auto; display: block; margin: .4em 0; }
img.figure { width: 100%; }
div.wide { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 12.5px; margin: .4em 0 1em; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
th { background: #f6f6f6; cursor: pointer; user-select: none; } td.num, th.num { text-align: right; }
.note { background: #fff8e1; border-left: 3px solid #f0b400; padding: .3em .7em; margin: .5em 0; }
details summary { cursor: pointer; color: #1a5fb4; margin: .3em 0; }
"""

# Click a column head to sort by it (numbers by their exact values); click again to reverse.
SCRIPT = """
document.querySelectorAll('table.sortable th').forEach(function (th, i) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0], rows = Array.from(body.rows);
    var dir = th.dataset.dir === 'asc' ? -1 : 1; th.dataset.dir = dir === 1 ? 'asc' : 'desc';
    var key = function (r) { var c = r.cells[th.cellIndex]; return c.dataset.v !== undefined ? parseFloat(c.dataset.v)
                                                                                        : c.textContent; };
    rows.sort(function (a, b) { var x = key(a), y = key(b); return (x > y ? 1 : x < y ? -1 : 0) * dir; });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""


def build(directory: Path, docs: int = 3, on_skip: Callable[[list[Path]], None] | None = None,
          model: str | None = None, compare_with: list[Path] | None = None) -> str:
    """The report page of the result cells under `directory` (of one model: `loading.select_model`), as HTML;
    opening with other models' frontiers beside this one's when `compare_with` (or DIR/report.yaml) names
    their sweeps."""
    directory = Path(directory)
    others = compare.compare_dirs(directory, compare_with)
    found = load_paths([directory], on_skip, model)
    cell_list = [c for _, c in found]
    paths = {c["cell_id"]: p for p, c in found}
    rep = frontier.report(cell_list)
    by_key = frontier.groups(cell_list)
    names = frontier.group_names(by_key)
    grouped = sorted(by_key.items(), key=lambda kv: names[kv[0]])
    sections: list[tuple[str, str, list[str]]] = [("overview", "Overview", overview_parts(cell_list, rep))]
    if others:
        sections.append(("models", "Models compared", comparison_parts(cell_list, others, directory)))
    published = published_rows(cell_list)
    if published:  # first: does this setup reproduce the paper, before any exit frontier is trusted
        sections.append(("published", "Published vs measured", published_parts(published)))
    sections.append(("frontiers", "Frontiers", frontier_parts(cell_list, grouped)))
    sections.append(("matched", "Matched quality", matched_parts(rep)))
    sections.append(("serving", "Projected serving throughput", serving_parts(found)))
    hists, maps = per_task_parts(grouped, names, rep, paths, docs)
    sections.append(("histograms", "Iterations per token", [
        f"<p>Each policy at its operating point: its cheapest cell within {100 * MATCHED_TOLERANCE:g}% of full "
        "depth, else its best quality; fixed depth at full depth.</p>", *hists]))
    sections.append(("exitmaps", "Exit maps", [
        "<p>The documents where the policies (at the operating points above) disagree most: different scores "
        "first, then the widest spread of mean iterations. Each scored or generated token is shaded by the step "
        "it exited at; the grey context before it ran at full depth. Hover a token for its numbers.</p>", *maps]))
    sections.append(("geometry", "Geometry", geometry_parts(directory)))
    sections.append(("provenance", "Provenance", [provenance(found, directory)]))
    return page(f"exitbench report: {directory}", sections)


def page(title: str, sections: list[tuple[str, str, list[str]]]) -> str:
    """The whole HTML document: the title, a link per section, and the sections (id, heading, HTML parts)."""
    nav = "".join(f'<a href="#{sid}">{html.escape(heading)}</a>' for sid, heading, _ in sections)
    body = "\n".join(f'<h2 id="{sid}">{html.escape(heading)}</h2>\n' + "\n".join(parts)
                     for sid, heading, parts in sections)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{STYLE}{exitmap.STYLE}</style></head>\n"
            f"<body><h1>{html.escape(title)}</h1><nav>{nav}</nav>\n{body}\n<script>{SCRIPT}</script></body></html>\n")


def overview_parts(cell_list: list[dict[str, Any]], rep: dict[str, Any]) -> list[str]:
    """How many cells of which model, tasks and policies, then the notes and warnings on them."""
    tasks = ", ".join(sorted({c["task"]["name"] for c in cell_list}))
    policies = ", ".join(sorted({frontier.Point(c).policy for c in cell_list}))
    overview = [f"<p>{len(cell_list)} cells of model {html.escape(model_label(cell_list[0]))} · tasks "
                f"{html.escape(tasks)} · policies {html.escape(policies)}</p>"]
    return overview + [f'<p class="note">{html.escape(n.text)}</p>'
                       for n in notes.notes(cell_list, rep, notes.REPORT)]


def frontier_parts(cell_list: list[dict[str, Any]], grouped: list[tuple[frontier.Group, list[frontier.Point]]]
                   ) -> list[str]:
    """A frontier figure per cost axis that some cell measured; a note for an axis that none did."""
    parts = []
    for axis, title in COST_TITLES.items():
        if not any(p.cost(axis) is not None for _, pts in grouped for p in pts):
            parts.append(f'<p class="note">no cell measured {title}</p>')
            continue
        parts.append(f'<h3>quality against {title}</h3><img class="figure" alt="frontier over {axis}" '
                     f'src="{png_uri(draw(cell_list, axis, columns=1))}">')
    return parts


def matched_parts(rep: dict[str, Any]) -> list[str]:
    """What the matched-quality tables hold, then one table per group."""
    intro = (f"<p>Each policy's cheapest cell within ε of full-depth quality (relative): at ε = "
             f"{100 * MATCHED_TOLERANCE:g}% in full, and its mean iterations at the other ε. Sorted by iterations; "
             "click a column head to sort by it. The speed-up divides full depth's wall-clock per token by the "
             "cell's, and says what it was timed by: paired (the median of the cell's repeats, timed alternately "
             "beside full depth on documents drawn across the task, their range beside it), corrected (the same, "
             "carried to the whole task by the FLOP ratios where the timed documents' strayed over 10% from it), "
             "evaluations (the two cells' own timings, minutes apart), estimated (replay's cost model: no loop ran) "
             "or first requests (cells written before the draw across the task). A speed-up above the cell's "
             "iteration bound (full depth's iterations over the cell's) is no result and shows as text with ‼. The "
             "overhead is the cell's time ratio to full depth divided by its FLOP ratio: its paired repeats' where "
             "retimed, else (marked *) the two cells' own timings; far above 1, the time measures our "
             "implementation of a rule, not the rule. The schedule is the part of it a batch waiting on its slowest "
             "row sets: the engine's loop steps over the repeats ÷ the steps the tokens' iterations need, against "
             "full depth (1 at batch size 1 and at a fixed depth); overhead ÷ schedule is a loop step's own cost. "
             "Each cell is timed on two clocks: the speed-up and overhead are the throughput clock's (the run's batch "
             "size over a stream of documents, in its steady state), the bs1 columns the latency clock's (one "
             f"request at a time, paired repeats only); cells written before the two clocks have one, "
             f"{BEFORE_CLOCKS}: one batch of documents at the run's batch size, the scored tokens' loop phases only."
             "</p>")
    tables = [f"<h3>{html.escape(entry.get('title', group))} <small class=muted>"
              f"({direction(entry['higher_is_better'])}; full depth {html.escape(depth_said(entry))})</small></h3>"
              + (f'<p class="note">{html.escape(deeper_said(entry))}</p>' if deeper_said(entry) else "")
              + matched_table(entry) for group, entry in rep.items()]
    return [intro, *tables]


def serving_parts(found: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """Each cell's decode throughput under static and continuous depth batching, replayed from its exit schedule
    (analysis/serve_sim.py), beside its iterations and wall-clock; a line saying why where no cell has one."""
    from . import serve_sim

    cost = serve_sim.load_cost()
    rows, _ = serve_sim.project_cells(found, serve_sim.REPORT_BATCHES, cost)
    if not rows:
        return ['<p class="note">No cell here recorded its per-token exit schedule (cells written before '
                "serve-sim); rerun the sweep into a new --out to project its serving throughput.</p>"]
    headers, body = serve_sim.wide(rows)
    intro = ("<p>Decode throughput relative to full depth when a server runs these requests with static batching "
             "(a batch step waits for its slowest row) or continuous depth batching (a row whose token exits moves "
             "to its next token at once), simulated from each cell's recorded per-token exits at each batch size "
             "(at batch 1 the two are the same); the ideal is the iteration ratio. "
             f"{html.escape(cost.describe())}. <code>exitbench serve-sim</code> adds the share of the ideal.</p>")
    speed = {i: (lambda v: f"{v:.2f}×") for i in range(6, len(headers))}
    return [intro, table(headers, body, numeric=set(range(2, len(headers))), shown=speed)]


def per_task_parts(grouped: list[tuple[frontier.Group, list[frontier.Point]]], names: dict[frontier.Group, str],
                   rep: dict[str, Any], paths: dict[str, Path], docs: int) -> tuple[list[str], list[str]]:
    """Per group: the iteration histograms of its policies' operating points, and its documents' exit maps."""
    hists, maps = [], []
    for key, points in grouped:
        task = key[0]
        ops = operating_points(points, rep[names[key]]["matched_quality"])
        title = rep[names[key]]["title"]
        hists.append(f'<img alt="iteration histograms, {html.escape(title)}" '
                     f'src="{png_uri(histogram_figure(title, ops))}">')
        blocks, note = doc_maps(ops, paths, docs)
        maps.append(f'<h3 class="task" data-task="{html.escape(task)}">{html.escape(task)}</h3>')
        if note:
            maps.append(f'<p class="note">{html.escape(note)}</p>')
        maps += blocks
    return hists, maps


def comparison_parts(cell_list: list[dict[str, Any]], others: list[Path], directory: Path) -> list[str]:
    names, per_model = compare.models(directory, cell_list, others)
    shared = compare.shared_groups(per_model)
    if not shared:
        return [f'<p class="note">the sweeps of {html.escape(", ".join(names))} share no task measured the same '
                "way (documents, few-shot, exit mode, …): nothing to draw on one axis</p>"]
    parts = [f"<p>{html.escape(', '.join(names))}: each model's frontier of quality against mean iterations per "
             "token (solid) and its fixed depths (dashed), on the tasks all of them ran the same way; then each "
             f"policy's cheapest cell within {100 * compare.TOLERANCE:g}% of its own model's full depth.</p>"]
    for key, points in shared.items():
        parts.append(f'<img alt="frontiers of {html.escape(", ".join(names))} on {html.escape(key[0])}" '
                     f'src="{png_uri(compare.draw(key, names, points))}">')
        rows = [r for name, pts in zip(names, points) for r in compare.summary_rows(name, pts)]
        parts.append(table(["model", "policy", "τ", "quality", "full depth", "mean iters", "iters / oracle"],
                           [[r["model"], r["policy"], _setting(r["policy"], r["threshold"]), r["quality"],
                             r["full_depth_quality"],
                             r["mean_iterations"], r["iterations_over_oracle"]] for r in rows],
                           numeric={2, 3, 4, 5, 6}))
    return parts


def published_parts(rows: list[dict[str, Any]]) -> list[str]:
    """A preset run's fixed-depth cells beside the paper's numbers, with where those come from."""
    parts = ["<p>Fixed-depth cells of a run made with a preset, in percent, beside the numbers its paper reports "
             "for the same task, metric and depth: compare these before trusting an exit frontier.</p>",
             table(["preset", "task", "metric", "r", "published", "measured", "limit"],
                   [[r["preset"], r["task"], r["metric"], r["depth"], r["published"], r["measured"],
                     "all" if r["limit"] is None else r["limit"]] for r in rows], numeric={3, 4, 5})]
    for source in sorted({r["source"] for r in rows}):
        parts.append(f'<p class="note">published: {html.escape(source)}</p>')
    for repo in sorted({r["published_for"] for r in rows if not r["same_model"]}):
        parts.append(f'<p class="note">The published numbers are for {html.escape(repo)}; this run used another '
                     "model, so the rows show the protocol's plumbing, not a reproduction.</p>")
    return parts


def geometry_parts(directory: Path) -> list[str]:
    """The figures `exitbench geometry` wrote beside each geometry.json under the directory."""
    parts = []
    for path in sorted(directory.rglob("geometry.json")):
        try:
            rep = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(rep, dict) or rep.get("schema") != "exitbench.geometry":
            continue
        figures = [f for f in ("steps.png", "handoffs.png", "pca.png") if (path.parent / f).exists()]
        parts.append(f"<h3>{html.escape(str(path.parent.relative_to(directory)))} "
                     f"<small class=muted>({html.escape(str(rep.get('source', '')))})</small></h3>")
        parts += [f'<img alt="geometry {f}" src="{file_uri(path.parent / f)}">' for f in figures]
    return parts or ['<p class="note">no geometry report here: `exitbench geometry --out DIR/geometry` writes '
                     "one, and this page shows its figures</p>"]


def write(directory: Path, out: Path, docs: int = 3, on_skip: Callable[[list[Path]], None] | None = None,
          model: str | None = None, compare_with: list[Path] | None = None) -> Path:
    page = build(directory, docs, on_skip, model, compare_with)
    return atomic_write(Path(out), lambda fh: fh.write(page))
