"""Tables of sweep results for the terminal."""
from __future__ import annotations

from typing import Any

from rich.table import Table


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col, justify in [("task", "left"), ("metric", "left"), ("policy", "left"), ("τ", "right"),
                         ("quality", "right"), ("mean iters", "right"), ("ms/token", "right"), ("probe", "right")]:
        table.add_column(col, justify=justify)
    for r in rows:
        table.add_row(r["task"], r["metric"], r["policy"], f"{r['threshold']:g}", f"{r['quality']:.4g}",
                      f"{r['mean_iterations']:.2f}" if r["mean_iterations"] is not None else "-",
                      f"{r['ms_per_token']:.3f}", f"{100 * r['probe_share']:.1f}%")
    return table


def pareto_tables(rep: dict[str, Any]) -> list[Table]:
    out = []
    for group, entry in rep.items():
        t = Table(title=f"{group}: matched quality (ε relative to full depth)")
        for col in ("ε", "policy", "τ", "quality", "mean iters", "speed-up", "iters / oracle"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for r in entry["matched_quality"]:
            t.add_row(f"{100 * r['tolerance']:g}%", r["policy"], f"{r['threshold']:g}", f"{r['quality']:.4g}",
                      f"{r['mean_iterations']:.2f}", "-" if r["speedup"] is None else f"{r['speedup']:.2f}×",
                      "-" if r["iterations_over_oracle"] is None else f"{r['iterations_over_oracle']:.2f}")
        out.append(t)
        f = Table(title=f"{group}: frontier over mean iterations")
        for col in ("policy", "τ", "quality", "mean iters"):
            f.add_column(col, justify="left" if col == "policy" else "right")
        for p in entry["frontiers"]["iterations"]:
            f.add_row(p["policy"], f"{p['threshold']:g}", f"{p['quality']:.4g}", f"{p['cost']:.2f}")
        out.append(f)
    return out


def regression_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("what", "cell", "baseline", "run"):
        table.add_column(col, justify="right" if col in ("baseline", "run") else "left")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        table.add_row(r["what"], r["cell"], fmt(r["baseline"]), fmt(r["run"]))
    return table
