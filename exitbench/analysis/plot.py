"""`pareto --plot`: quality against cost, one panel per (task, metric), a curve per policy (points alone on
wall-clock) and the frontier."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ExitbenchError
from .frontier import COSTS, Point, frontier, group_names, groups
from .labels import metric_name, metric_with_direction, point_label, series_label


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


# Point labels and legends, in points. The report shows a panel at about its drawn width (LABEL_PT at its dpi is
# 14 px there); its browser test holds that size legible.
LABEL_PT = 8


def draw(cell_list: list[dict[str, Any]], axis: str = "iterations", columns: int | None = None):
    """Quality against cost, one panel per (task, metric): a curve per policy over its thresholds, the
    fixed-depth baselines as their own curve, the overall frontier highlighted. `columns`: panels per row (all in
    one row by default; the report draws one per row, so each is as wide as its page). Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = groups(cell_list)
    names, titles = group_names(by_key), group_names(by_key, said=True)
    grouped = sorted(by_key.items(), key=lambda kv: names[kv[0]])
    # (a panel's legend stands beside it, right of the axes, never over its points)
    cols = min(columns or len(grouped), len(grouped))
    rows = -(-len(grouped) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(grouped):]:
        ax.set_visible(False)
    labels = []
    for ax, (key, points) in zip(axes.flat, grouped):
        metric = key[1]
        higher = points[0].cell["quality"]["higher_is_better"]
        by_policy: dict[str, list[Point]] = {}
        for p in points:
            if p.cost(axis) is not None:
                by_policy.setdefault(p.policy, []).append(p)
        colours = palette(len(by_policy))
        for i, (name, pts) in enumerate(sorted(by_policy.items())):
            pts.sort(key=lambda p: p.cost(axis))
            style = (dict(color="black", linestyle="--", marker="s") if name.startswith("fixed")
                     else dict(marker="o", color=colours[i % len(colours)]))
            label = "fixed depth" if name == "fixed" else series_label(name)
            if axis == "wall_clock":
                # Measured times do not fall in threshold order (a deeper cell may time faster): a line through
                # them zigzags. Points alone, and the frontier's band, read as what is fastest at each quality.
                style["linestyle"] = "none"
            ax.plot([p.cost(axis) for p in pts], [p.quality for p in pts], label=label, zorder=2, **style)
            estimated = [p for p in pts if p.mode == "replay"] if axis == "wall_clock" else []
            if estimated:  # replay's times are its cost model's: drawn hollow, so none reads as a timing
                ax.plot([p.cost(axis) for p in estimated], [p.quality for p in estimated], linestyle="none",
                        marker=style["marker"], markerfacecolor="white", markeredgecolor=style["color"], zorder=3)
        front = frontier(points, axis, higher)
        # Thresholds are labelled on the overall frontier only (every policy's points pile up at full quality);
        # where a label goes is settled once the figure is laid out (place_labels).
        labels += [ax.annotate(point_label(p.policy, p.threshold), (p.cost(axis), p.quality), fontsize=LABEL_PT,
                               alpha=0.8, xytext=LABEL_OFFSETS[0][:2], textcoords="offset points") for p in front]
        # A wide grey band under the curves: no policy's colour (the palette has no grey), so it reads as its own.
        ax.plot([p.cost(axis) for p in front], [p.quality for p in front], color=FRONTIER_COLOUR, linewidth=7,
                alpha=0.45, solid_capstyle="round", label="frontier", zorder=1)
        ax.set_title(titles[key].replace(f" · {metric_name(metric)}", ""))  # the y axis names the metric
        ax.set_xlabel(axis_label(axis, any(p.mode == "replay" for p in points)))
        ax.set_ylabel(metric_with_direction(metric, higher))
        # Seconds and FLOPs span orders of magnitude across policies (kl decodes at every step), and so does a
        # perplexity between depth 1 and full depth: on linear axes everything else sits in one corner.
        if axis != "iterations":
            ax.set_xscale("log")
            readable_log_ticks(ax.xaxis)
            ax.set_xlabel(ax.get_xlabel() + " (log)")
        if not higher and all(p.quality > 0 for p in points):
            ax.set_yscale("log")
            readable_log_ticks(ax.yaxis)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=LABEL_PT, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    place_labels(fig, labels)
    return fig


FRONTIER_COLOUR = "#9a9a9a"


def palette(n: int) -> list:
    """Policy colours: tab10, or tab20 when ten would repeat (a sweep of every policy has about fourteen), without
    their greys, which are the frontier's."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab20" if n > 8 else "tab10")
    grey = {7} if cmap.N == 10 else {14, 15}
    return [cmap(i) for i in range(cmap.N) if i not in grey]


def axis_label(axis: str, estimated: bool) -> str:
    """What the cost axis measures; on wall-clock, how a cell's time is had (and that hollow points are
    replay's estimates)."""
    if axis == "wall_clock":
        text = "seconds per token, throughput clock (full depth's ÷ each cell's paired speed-up)"
        return text + (", hollow: replay estimates" if estimated else "")
    return {"iterations": "mean iterations per token", "flops": "FLOPs per token"}[axis]


def readable_log_ticks(axis) -> None:
    """On a log axis of its data (call it after plotting): ticks at 1, 2 and 5 of each decade, written as plain
    numbers, where the data span at most two decades: such an axis (a perplexity from 1 to 9) otherwise shows one
    or two powers of ten and nothing between. A wider one keeps a tick per decade."""
    import matplotlib.ticker as ticker

    axis.set_minor_formatter(ticker.NullFormatter())  # minor labels overprint
    lo, hi = sorted(axis.get_data_interval())
    if lo > 0 and hi / lo <= 100:
        axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))


# Where a point's label may go, in points from the point, tried in this order: below right, above right,
# below left, above left (with the text's alignment that keeps it clear of its own marker).
LABEL_OFFSETS = ((4, -9, "left"), (4, 4, "left"), (-4, -9, "right"), (-4, 4, "right"))


def place_labels(fig, labels: list) -> None:
    """Put each label where its rendered box stays inside its axes and covers no marker of any series, no legend
    and no label kept before it, trying LABEL_OFFSETS in turn; a label with no such place is dropped (a missing label misleads less than one
    that names another series' point). Measured on the laid-out figure, in display units, so it holds whatever the
    axes' scales and the labels' lengths."""
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()  # places each legend ("best" is settled at draw time), so labels can keep clear of it
    markers = {id(ax): marker_boxes(ax) + ([ax.get_legend().get_window_extent(renderer)] if ax.get_legend() else [])
               for ax in fig.axes}
    kept = []
    for label in labels:
        anchor = label.axes.transData.transform(label.xy)
        # the markers at the label's own point are the point it names
        others = [box for box in markers[id(label.axes)] if not box.contains(*anchor)]
        for dx, dy, align in LABEL_OFFSETS:
            label.xyann = (dx, dy)
            label.set_horizontalalignment(align)
            box = label.get_window_extent(renderer)
            inside = label.axes.bbox.x0 <= box.x0 and box.x1 <= label.axes.bbox.x1 and \
                label.axes.bbox.y0 <= box.y0 and box.y1 <= label.axes.bbox.y1  # not over a spine or a tick label
            if inside and not any(box.overlaps(other) for other in kept + others):
                kept.append(box)
                break
        else:
            label.remove()


def marker_boxes(ax) -> list:
    """The display-space box of every marker drawn in `ax`."""
    from matplotlib.transforms import Bbox

    boxes = []
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "", " ") or not line.get_visible():
            continue
        half = line.get_markersize() * ax.figure.dpi / 72 / 2
        for x, y in ax.transData.transform(line.get_xydata()):
            boxes.append(Bbox.from_extents(x - half, y - half, x + half, y + half))
    return boxes
