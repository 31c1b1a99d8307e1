"""How far is a replay cell's wall-clock from the engine's? Replay's estimate against exact retiming, measured in
one run.

A replay cell runs no loop: its ms/token is the replay cost model's price of its exits (per-token prelude and coda,
per-iteration core and probe costs, timed by the exact engine on a few requests: sweep/replay/costs.py), and its
speed-up is full depth's estimate over its own. This runs the same sweep twice on the shipped tasks, exactly (each
cell timed in its evaluation and again beside full depth on documents drawn across the task: timing/retime.py)
and by replay, and prints per cell and per task how far the estimate is from the timing:

- ms/token: replay's estimate against the exact cell's evaluation;
- speed-up: replay's (full depth's estimate ÷ the cell's) against the exact cell's paired speed-up.

Errors are signed, (replay − exact) ÷ exact; a summary per task gives their median and largest size.

Usage: python bench/replay_clock.py [--limit 48] [--policy second_order,...] [--json FILE]
One intra-op thread (OMP_NUM_THREADS=1): on two shared cores, thread barriers make a tiny model's timings swing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TASKS = ["chains", "chains_mc", "chains_lambada"]
POLICIES = ["second_order", "first_order", "kl", "confidence", "oracle"]


def sweep(out: Path, limit: int, policies: list[str], replay: bool) -> tuple[list[dict], float]:
    from exitbench.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(tasks=TASKS, policies=policies, limit=limit, quiet=True, out=out, replay=replay,
                      timing_repeats=0 if replay else 3)
    t0 = time.perf_counter()
    made = run_sweep(cfg).cells
    return made, time.perf_counter() - t0


def point(cell: dict) -> tuple:
    from exitbench.store import cells

    return cell["task"]["name"], cells.series(cell["policy"]), cell["policy"]["threshold"]


def compare(exact: list[dict], replay: list[dict]) -> list[dict]:
    """One row per cell both sweeps made: replay's ms/token and speed-up against the exact cell's."""
    from exitbench.analysis.frontier import references
    from exitbench.timing.speedup import estimate

    full_e, full_r = references(exact), references(replay)
    by_point = {point(c): c for c in replay}
    rows = []
    for e in exact:
        r = by_point.get(point(e))
        if r is None:
            continue
        se, sr = estimate(e, full_e.get(e["cell_id"])), estimate(r, full_r.get(r["cell_id"]))
        me, mr = 1e3 * e["wall_clock"]["per_token_s"], 1e3 * r["wall_clock"]["per_token_s"]
        rows.append({"task": point(e)[0], "series": point(e)[1], "threshold": point(e)[2],
                     "mean_iterations_exact": e["iterations"]["mean"], "mean_iterations_replay": r["iterations"]["mean"],
                     "ms_exact": me, "ms_replay": mr, "ms_error": (mr - me) / me,
                     "speedup_exact": se.value, "speedup_exact_basis": se.basis,
                     "speedup_low": se.low, "speedup_high": se.high, "speedup_replay": sr.value,
                     "speedup_error": (sr.value - se.value) / se.value if se.value and sr.value and se.basis != "reference"
                     else None})
    return sorted(rows, key=lambda x: (x["task"], x["series"] != "fixed", x["series"], x["threshold"]))


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for task in TASKS:
        mine = [r for r in rows if r["task"] == task]
        ms = [abs(r["ms_error"]) for r in mine]
        sp = [abs(r["speedup_error"]) for r in mine if r["speedup_error"] is not None]
        inside = [r for r in mine if r["speedup_error"] is not None and r["speedup_low"] is not None
                  and r["speedup_low"] <= r["speedup_replay"] <= r["speedup_high"]]
        out.append({"task": task, "cells": len(mine), "ms_median_abs_error": statistics.median(ms),
                    "ms_max_abs_error": max(ms), "speedup_median_abs_error": statistics.median(sp),
                    "speedup_max_abs_error": max(sp), "speedups_within_repeats": len(inside),
                    "speedups_compared": len(sp)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--policy", default=",".join(POLICIES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    policies = args.policy.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        exact, exact_s = sweep(Path(tmp) / "exact", args.limit, policies, replay=False)
        replay, replay_s = sweep(Path(tmp) / "replay", args.limit, policies, replay=True)
    rows = compare(exact, replay)
    print(f"tiny-raven, {', '.join(TASKS)}, {args.limit} documents, {', '.join(policies)} and fixed depths: exact "
          f"sweep {exact_s:.0f} s (3 paired repeats a cell), replay {replay_s:.0f} s")
    print(f"{'task':<15} {'series':<14} {'τ':>7} {'iters e/r':>11} {'ms exact':>9} {'ms replay':>9} {'err':>6}  "
          f"{'speed-up exact (repeats)':>27} {'replay':>7} {'err':>6}")
    for r in rows:
        rng = f"({r['speedup_low']:.2f}–{r['speedup_high']:.2f})" if r["speedup_low"] is not None else ""
        err = "" if r["speedup_error"] is None else f"{100 * r['speedup_error']:+.0f}%"
        print(f"{r['task']:<15} {r['series']:<14} {r['threshold']:>7g} {r['mean_iterations_exact']:>5.2f}/"
              f"{r['mean_iterations_replay']:<5.2f} {r['ms_exact']:>9.3f} {r['ms_replay']:>9.3f} "
              f"{100 * r['ms_error']:>+5.0f}%  {r['speedup_exact']:>7.2f}× {rng:>18} {r['speedup_replay']:>6.2f}× "
              f"{err:>6}")
    print("per task: |replay − exact| ÷ exact, median and largest")
    for s in summary(rows):
        print(f"  {s['task']:<15} {s['cells']:>3} cells · ms/token {100 * s['ms_median_abs_error']:.0f}% "
              f"(up to {100 * s['ms_max_abs_error']:.0f}%) · speed-up {100 * s['speedup_median_abs_error']:.0f}% "
              f"(up to {100 * s['speedup_max_abs_error']:.0f}%), {s['speedups_within_repeats']} of "
              f"{s['speedups_compared']} inside the exact cell's repeats")
    if args.json:
        args.json.write_text(json.dumps({"limit": args.limit, "policies": policies, "exact_s": exact_s,
                                         "replay_s": replay_s, "rows": rows, "summary": summary(rows)}, indent=2))


if __name__ == "__main__":
    main()
