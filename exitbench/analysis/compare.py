"""Several models' frontiers on one task, drawn on the same axes: what the report opens with when a sweep names
other models' sweeps to stand beside (`report --compare DIR`, or a `report.yaml` in the sweep's directory).

Only what was measured the same way is compared: the (task, metric, setup) groups that every model's cells
share (frontier.MEASURED: documents, few-shot, task data, dtype, exit mode, window, prefill, prompt). Each model's
frontier of quality against mean iterations per token is drawn with its fixed-depth curve, and a table gives
each model's full-depth quality and the cheapest cell of each policy within 1% of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ExitbenchError
from ..store.loading import load
from . import frontier
from .labels import metric_with_direction

COMPARE_FILE = "report.yaml"  # `compare: [DIR, …]`, relative to the sweep's directory
TOLERANCE = 0.01


def compare_dirs(directory: Path, given: list[Path] | None) -> list[Path]:
    """The sweeps to compare with: the ones given, else those DIR/report.yaml names, else none."""
    if given:
        dirs = [Path(d) for d in given]
        where = "--compare"
    else:
        config = Path(directory) / COMPARE_FILE
        if not config.exists():
            return []
        try:
            raw = yaml.safe_load(config.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ExitbenchError(f"{config} is not valid YAML: {str(exc).splitlines()[0]}") from None
        entries = raw.get("compare") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ExitbenchError(f"{config}: 'compare' must be a list of result directories, got {entries!r}")
        dirs = [(Path(directory) / e) for e in entries]
        where = str(config)
    for d in dirs:
        if not d.is_dir():
            raise ExitbenchError(f"{where} names {d}, which is not a directory of result cells")
    return dirs


def short_name(cell: dict[str, Any]) -> str:
    m = cell["model"]
    source = m.get("source") or m.get("path") or m["architecture"]
    return source.split(":", 1)[1] if source.startswith("embedded:") else Path(source).name


def shared_groups(models: list[list[dict[str, Any]]]) -> dict[frontier.Group, list[list[frontier.Point]]]:
    """The groups every model has cells in, each model's points there."""
    grouped = [frontier.groups(cells, frontier.MEASURED) for cells in models]
    common = set(grouped[0]).intersection(*grouped[1:])
    return {key: [g[key] for g in grouped] for key in sorted(common)}


def summary_rows(name: str, points: list[frontier.Point]) -> list[dict[str, Any]]:
    rows = [r for r in frontier.matched_quality(points) if r["tolerance"] == TOLERANCE]
    return [{"model": name, **r} for r in sorted(rows, key=lambda r: r["mean_iterations"])]


def draw(key: frontier.Group, names: list[str], per_model: list[list[frontier.Point]]):
    """Quality against mean iterations per token: per model the exit policies' frontier (solid), its oracle
    (star) and its fixed depths (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task, metric, _ = key
    higher = per_model[0][0].cell["quality"]["higher_is_better"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, points) in enumerate(zip(names, per_model)):
        color = colors[i % len(colors)]
        # The oracle reads the answer, so it is a bound drawn apart, not a point a policy can reach.
        front = frontier.frontier([p for p in points if p.policy != "oracle"], "iterations", higher)
        ax.plot([p.cost("iterations") for p in front], [p.quality for p in front], color=color, marker="o",
                linewidth=2, label=f"{name}: frontier of the exit policies")
        for p in (p for p in points if p.policy == "oracle"):
            ax.plot([p.cost("iterations")], [p.quality], color=color, marker="*", markersize=12, linestyle="none",
                    label=f"{name}: oracle")
        fixed = sorted((p for p in points if p.policy == "fixed"), key=lambda p: p.cost("iterations"))
        ax.plot([p.cost("iterations") for p in fixed], [p.quality for p in fixed], color=color, linestyle="--",
                marker="s", markersize=4, alpha=0.7, label=f"{name}: fixed depth")
    ax.set_xscale("log")
    if not higher:
        ax.set_yscale("log")
    ax.set_xlabel("mean iterations per token (log)")
    ax.set_ylabel(metric_with_direction(metric, higher))
    ax.set_title(f"{task}: {len(names)} models, same documents")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def models(directory: Path, cell_list: list[dict[str, Any]], dirs: list[Path]) -> tuple[list[str], list[list]]:
    """(names, cells) of this sweep's model and each compared sweep's (one model each, `loading.load`)."""
    names, cells = [short_name(cell_list[0])], [cell_list]
    for d in dirs:
        other = load([d])
        names.append(short_name(other[0]))
        cells.append(other)
    return names, cells
