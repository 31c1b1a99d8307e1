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
