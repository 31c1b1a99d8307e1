"""Figures of a geometry report: per-iteration curves (one line per checkpoint), hand-off drift, PCA paths."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..analysis.plot import readable_log_ticks
from .geometry import QUANTITIES, write_report

# What `exitbench geometry` writes into its --out directory.
FILES = ("geometry.json", "steps.png", "handoffs.png", "pca.png")
# In matplotlib's mathtext: written as plain text, `Δ_{k−1}` showed its braces and underscores.
LABELS = {"step": r"$\Vert\Delta_k\Vert$", "rel_step": r"$\Vert\Delta_k\Vert \,/\, \Vert s_k\Vert$",
          "cosine": r"$\cos(\Delta_k, \Delta_{k-1})$", "accel": r"$\Vert\Delta_k - \Delta_{k-1}\Vert$",
          "accel_mag": r"$|\,\Vert\Delta_k\Vert - \Vert\Delta_{k-1}\Vert\,|$"}
HANDOFF_TITLE = r"$\Vert x_{g+1}^{(1)} - x_g^{(K)}\Vert \,/\, \mathrm{mean}_k \Vert\Delta_g^{(k)}\Vert$"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """The figure as a PNG written whole or not at all (a full disk is one line, not a half image)."""
    from ..runtime.files import atomic_write

    atomic_write(Path(path), lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")


def _series_label(entry: dict[str, Any]) -> str:
    step = entry.get("training_step")
    return f"step {step}" if step is not None else Path(entry["path"]).name


def _colors(plt, n: int) -> list:
    cmap = plt.get_cmap("viridis")
    return [cmap(0.85 * i / max(n - 1, 1)) for i in range(n)]


def plot_steps(report: dict[str, Any], path: Path, title: str = "") -> Path:
    """Rows: the five quantities; columns: loop groups; x: iteration k; one line per checkpoint (mean over tokens)."""
    plt = _pyplot()
    entries = report["checkpoints"]
    names = [g["name"] for g in entries[0]["groups"]]
    fig, axes = plt.subplots(len(QUANTITIES), len(names), figsize=(max(3.6 * len(names) + 1, 6), 2.3 * len(QUANTITIES)),
                             squeeze=False, sharex=True)
    colors = _colors(plt, len(entries))
    for col, name in enumerate(names):
        for row, q in enumerate(QUANTITIES):
            ax = axes[row][col]
            for entry, color in zip(entries, colors):
                per_k = entry["groups"][col]["per_k"]
                ks = [r["k"] for r in per_k if r[q]["mean"] is not None]
                means = [r[q]["mean"] for r in per_k if r[q]["mean"] is not None]
                ax.plot(ks, means, color=color, lw=1.6, label=_series_label(entry))
                if len(entries) == 1:
                    medians = [r[q]["median"] for r in per_k if r[q]["median"] is not None]
                    ax.plot(ks, medians, color=color, lw=1, ls="--", label="median")
            if q != "cosine":
                ax.set_yscale("log")
                readable_log_ticks(ax.yaxis)
            else:
                ax.axhline(0, color="grey", lw=0.6)
                ax.set_ylim(-1.05, 1.05)
            if col == 0:
                ax.set_ylabel(LABELS[q])
            if row == 0:
                ax.set_title(name)
            if row == len(QUANTITIES) - 1:
                ax.set_xlabel("iteration k")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title or f"loop geometry: {entries[-1]['tokens']:,} tokens per checkpoint, mean over tokens",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_handoffs(report: dict[str, Any], path: Path) -> Path | None:
    """Drift-to-loop ratio at each hand-off between groups, per checkpoint (None when there is one group)."""
    entries = report["checkpoints"]
    if not entries[0]["handoffs"]:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    xs = [e.get("training_step") if e.get("training_step") is not None else i for i, e in enumerate(entries)]
    for h, marker in zip(range(len(entries[0]["handoffs"])), "os^vD"):
        first = entries[0]["handoffs"][h]
        ys = [e["handoffs"][h]["first_step"]["mean"] for e in entries]
        ax.plot(xs, ys, marker=marker, label=f"{first['from']} → {first['to']}")
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    readable_log_ticks(ax.yaxis)
    ax.set_xlabel("training step" if entries[0].get("training_step") is not None else "checkpoint")
    ax.set_ylabel("drift-to-loop ratio (first step of next group)")
    ax.set_title(HANDOFF_TITLE)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_pca(report: dict[str, Any], path: Path) -> Path:
    """The last checkpoint's PCA paths: one panel per token, each loop group's iterates in their own colour."""
    plt = _pyplot()
    entry = report["checkpoints"][-1]
    paths = entry["pca"]
    names = [g["name"] for g in entry["groups"]]
    fig, axes = plt.subplots(1, len(paths), figsize=(3.4 * len(paths), 3.4), squeeze=False)
    colors = plt.get_cmap("tab10")
    for i, (ax, token) in enumerate(zip(axes[0], paths)):
        for g, points in enumerate(token["groups"]):
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, "-o", ms=2.5, lw=1, color=colors(g), label=names[g])
            ax.plot(xs[0], ys[0], "s", ms=6, color=colors(g), mfc="none")
        ev = token["explained_variance"]
        ax.set_title(f"token {i + 1}: PC1 + PC2 = {sum(ev):.0%} of variance", fontsize=8)
        # Axes in the state's own units (distances along the two PCs), so panels and steps can be compared.
        ax.set_xlabel(f"PC1 ({ev[0]:.0%})", fontsize=8)
        ax.set_ylabel(f"PC2 ({ev[1]:.0%})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.25)
        for k, (x, y) in enumerate(token["groups"][-1]):
            if k in (1, len(token["groups"][-1]) - 1):  # where the last group's iterates start and end
                ax.annotate(f"k={k}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"state trajectories, 2-D PCA ({_series_label(entry)}; square = group start)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def write_figures(report: dict[str, Any], out: Path) -> list[Path | None]:
    """The report as FILES in `out`: its JSON and three figures (None where a figure has nothing to draw)."""
    report_file, steps, handoffs, pca = (out / name for name in FILES)
    return [write_report(report, report_file), plot_steps(report, steps), plot_handoffs(report, handoffs),
            plot_pca(report, pca)]
