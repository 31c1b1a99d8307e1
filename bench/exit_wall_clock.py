"""Batch-size-1 wall-clock of chosen exit cells against full depth, each timed in the same run as its baseline.

At batch size 16 a token's time is its batch's deepest token's, so the sweep's ms/token says little about
what an exit saves; at batch size 1 a token's time is its own loop's. For each pick (CHECKPOINT:POLICY:τ)
this runs `exitbench run --batch-size 1` on the first --limit documents with the full-depth baseline in the
same run and the same output directory, with one torch thread (steadier on a shared machine), and prints ms/token of both and their ratio, so every ratio divides
two timings of one process on one machine state.

    python bench/exit_wall_clock.py --limit 48 --pick tiny-ouro:qexit:0.5 --pick tiny-ouro:confidence:0.5
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from exitbench.store import cells as cell_store


def run_pick(checkpoint: str, policy: str, tau: str, full: int, task: str, limit: int, out: Path,
             mode: str = "physical") -> dict:
    # The oracle has no threshold to sweep (its τ in a cell is a placeholder).
    thresholds = [] if policy == "oracle" else ["--thresholds", tau]
    cmd = [sys.executable, "-m", "exitbench", "run", "-c", checkpoint, "-p", policy, *thresholds,
           "--baselines", str(full), "--tasks", task, "--limit", str(limit), "--batch-size", "1", "--quiet",
           "--threads", "1", "--out", str(out), "--exit-mode", mode]
    if policy == "learned":  # the exit model `fit-exit` writes for the checkpoint by default
        cmd += ["--exit-model", str(Path("results/exit-models") / f"{checkpoint.split('/')[0]}.json")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[2:])} failed: {done.stderr.strip().splitlines()[-1]}")
    found, _ = cell_store.scan(out.glob("*.json"))
    by_policy = {c["policy"]["policy"]: c for _, c in found}
    cell, base = by_policy[policy], by_policy["fixed"]
    ms, ms_full = 1e3 * cell["wall_clock"]["per_token_s"], 1e3 * base["wall_clock"]["per_token_s"]
    return {"checkpoint": checkpoint, "policy": policy, "threshold": float(tau), "exit_mode": mode, "quality": cell["quality"]["value"],
            "full_quality": base["quality"]["value"], "mean_iterations": cell["iterations"]["mean"],
            "ms_per_token": ms, "full_ms_per_token": ms_full, "speedup": ms_full / ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pick", action="append", required=True,
                    help="CHECKPOINT:POLICY:τ[:select] (repeatable; select: every token runs all steps)")
    ap.add_argument("--full", type=int, default=12, help="the full depth to compare with")
    ap.add_argument("--task", default="chains")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pick in enumerate(args.pick):
            mode = "physical"
            if pick.endswith(":select"):
                pick, mode = pick[: -len(":select")], "select"
            checkpoint, policy, tau = pick.rsplit(":", 2)
            rows.append(run_pick(checkpoint, policy, tau, args.full, args.task, args.limit, Path(tmp) / str(i),
                                 mode))
            r = rows[-1]
            print(f"{r['checkpoint']:<20} {r['policy'] + (' select' if mode == 'select' else ''):<24} "
                  f"τ={r['threshold']:<8g} quality {r['quality']:.4f} "
                  f"(full {r['full_quality']:.4f})  iters {r['mean_iterations']:5.2f}  {r['ms_per_token']:.3f} vs "
                  f"{r['full_ms_per_token']:.3f} ms/token  {r['speedup']:.2f}×", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
