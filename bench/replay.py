"""What does a replay sweep cost? Ratios measured in one run.

Sections (--sections, comma-separated):
- baseline: the README's baseline sweep (every policy over its grid, chains + chains_mc + chains_lambada, 48
  documents) as whole commands, exact vs --replay, in alternation; target replay ≥ 10× faster. The replay's
  time is split into recording, cost model, per-cell work and the rest (start-up: imports, model, tasks).
- wide: a random checkpoint of tiny-raven's layout with n_embd 1024 (arithmetic dominates): the whole replay
  sweep against one exact run at full depth over the same documents; target ≤ 1.5×.
- gpt2: the same on tiny-looped-gpt2's gsm8k_text perplexity (three loop groups, rolling windows).

Usage: python bench/replay.py [--sections baseline,wide,gpt2] [--repeats N] [--json FILE]
Every process runs with one intra-op thread (OMP_NUM_THREADS=1): on two shared cores, thread barriers make a
tiny model's timings swing by whole seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GSM8K = Path(os.environ.get("EXITBENCH_GSM8K", REPO.parent / "shared" / "data" / "gsm8k"))
BASELINE = ["--policy", "all", "--tasks", "chains,chains_mc,chains_lambada", "--limit", "48", "--quiet"]
# The exact side skips the retiming of its cells (--timing-repeats 0): replay never retimes, so with it the ratio
# would weigh evaluation against evaluation plus three timed repeats per cell.
EXACT_ONLY = ["--timing-repeats", "0"]


def _cells(out: Path) -> list[dict]:
    from exitbench.store import cells

    return [c for _, c in cells.scan(out.glob("*.json"))[0]]


def replay_split(out: Path, total: float) -> dict[str, float]:
    """Where a replay sweep's time went, from its cells."""
    cs = _cells(out)
    r = cs[0]["replay"]
    per_cell = sum(c["wall_clock"]["cell_s"] for c in cs)
    return {"total_s": total, "record_s": r["record_s"], "cost_model_s": r["cost_model_s"], "cells_s": per_cell,
            "cells": len(cs), "rest_s": total - r["record_s"] - r["cost_model_s"] - per_cell}


def baseline(repeats: int, figures: dict) -> None:
    print("[the baseline sweep: exact vs --replay, whole commands]  target: replay ≥ 10× faster")
    exact_t, replay_t, splits = [], [], []
    for i in range(repeats):
        for mode in ("exact", "replay"):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "sweep"
                cmd = [sys.executable, "-m", "exitbench", "run", *BASELINE, "--out", str(out)]
                cmd += ["--replay"] if mode == "replay" else EXACT_ONLY
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
                dt = time.perf_counter() - t0
                (replay_t if mode == "replay" else exact_t).append(dt)
                if mode == "replay":
                    splits.append(replay_split(out, dt))
                print(f"  repeat {i + 1}: {mode:6s} {dt:7.1f} s", flush=True)
    e, r = statistics.median(exact_t), statistics.median(replay_t)
    split = splits[len(splits) // 2]
    print(f"exact {e:.1f} s · replay {r:.1f} s · speed-up {e / r:.1f}×")
    print(f"replay split: recording {split['record_s']:.1f} s, cost model {split['cost_model_s']:.1f} s, "
          f"{split['cells']} cells {split['cells_s']:.1f} s ({1e3 * split['cells_s'] / split['cells']:.0f} ms "
          f"each, 3 per lm-eval call), start-up and the rest {split['rest_s']:.1f} s")
    figures["baseline"] = {"exact_s": exact_t, "replay_s": replay_t, "speedup": e / r, "replay_split": splits}


def wide_checkpoint(tmp: Path, width: int) -> Path:
    from exitbench.models import save_checkpoint
    from exitbench.models.checkpoint import open_checkpoint

    sys.path.insert(0, str(REPO / "bench"))
    from engine import wide_model  # the same random model bench/engine.py times

    ck = open_checkpoint(None)
    special = {k: v for k, v in ck.config.items() if k.endswith("_token_id")}  # the same tokenizer's ids
    return save_checkpoint(wide_model(ck.model.config, width), tmp / f"wide-{width}", ck.tokenizer,
                           extra_config=special)


def sweep_vs_full_depth(checkpoint: str, task_names: list[str], limit: int, label: str, figures: dict,
                        data_dir: Path | None = None, policies: tuple[str, ...] = ("all",),
                        also_exact: str | None = None) -> None:
    """The whole replay sweep (every policy's grid and the baselines, or `policies`') against one exact run at
    full depth; with `also_exact`, one exact cell of that policy (its default threshold) for scale."""
    from exitbench.engine import ExitConfig
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.run import execute, open_sweep
    from exitbench.store import cells
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.exact import run_config
    from exitbench.sweep.keys import cell_key

    ck = open_checkpoint(checkpoint)
    tasks = resolve_tasks(task_names, data_dir)
    depth = ck.model.loop_groups()[0].default_steps
    exact_cfg = SweepConfig(tasks=task_names, policies=list(policies), limit=limit, quiet=True)
    replay_cfg = SweepConfig(tasks=task_names, policies=list(policies), limit=limit, quiet=True, replay=True)
    with tempfile.TemporaryDirectory() as tmp:
        prepared = open_sweep(dataclasses.replace(replay_cfg, out=Path(tmp) / "replay"), ck, tasks)
        sweep = prepared.plan
        full = ExitConfig("fixed", threshold=depth)
        idx = list(range(len(task_names)))
        keys = [cell_key(sweep.model, n, tasks.fingerprints[n], full, exact_cfg, "cpu") for n in task_names]
        t0 = time.perf_counter()
        exact = run_config(ck, tasks, idx, full, exact_cfg, sweep.model, keys, sweep.run_id)
        exact_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outcome = execute(prepared)
        made, record_s, costs_s = outcome.cells, outcome.timings["record_s"], outcome.timings["cost_model_s"]
        replay_s = time.perf_counter() - t0
        tokens = sum(c["iterations"]["tokens"] for c, _ in exact)
        other_s = None
        if also_exact:
            other = ExitConfig(also_exact)
            t0 = time.perf_counter()
            run_config(ck, tasks, idx, other, exact_cfg, sweep.model,
                       [cell_key(sweep.model, n, tasks.fingerprints[n], other, exact_cfg, "cpu") for n in task_names],
                       sweep.run_id)
            other_s = time.perf_counter() - t0
        per_cell = sum(c["wall_clock"]["cell_s"] for c in made)
        ratio = replay_s / exact_s
        print(f"[{label}, policies: {', '.join(policies)}]  target: whole replay sweep ≤ 1.5 × one exact "
              "full-depth run")
        print(f"one exact run at depth {depth}: {exact_s:.1f} s ({tokens} scored tokens) · replay sweep of "
              f"{len(made)} cells: {replay_s:.1f} s (recording {record_s:.1f} s, cost model "
              f"{costs_s:.1f} s, cells {per_cell:.1f} s) · ratio {ratio:.2f}")
        if other_s is not None:
            print(f"  for scale: one exact {also_exact} cell at its default threshold takes {other_s:.1f} s")
        full_replay = [c for c in made if c["policy"]["policy"] == "fixed" and c["policy"]["threshold"] == depth]
        for ce, cr in zip(sorted((c for c, _ in exact), key=lambda c: c["task"]["name"]),
                          sorted(full_replay, key=lambda c: c["task"]["name"])):
            print(f"  {ce['task']['name']}: full-depth quality exact {ce['quality']['value']:.6g}, replay "
                  f"{cr['quality']['value']:.6g}")
        figures[f"{label}, {'+'.join(policies)}"] = {"exact_full_depth_s": exact_s, "one_exact_cell_s": other_s, "replay_sweep_s": replay_s, "ratio": ratio,
                          "cells": len(made), "record_s": record_s, "cost_model_s": costs_s,
                          "cells_s": per_cell, "cell_ids": len({cells.cell_id(c["key"]) for c in made})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="baseline,wide,gpt2")
    ap.add_argument("--repeats", type=int, default=1, help="Exact/replay pairs of the baseline sweep.")
    ap.add_argument("--wide", type=int, default=1024)
    ap.add_argument("--gpt2-docs", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sections = set(args.sections.split(","))
    figures: dict = {}
    t0 = time.perf_counter()
    if "baseline" in sections:
        baseline(args.repeats, figures)
    if "wide" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            path = wide_checkpoint(Path(tmp), args.wide)
            sweep_vs_full_depth(str(path), ["chains", "chains_mc", "chains_lambada"], 48,
                                f"random model n_embd {args.wide}, chains tasks, 48 documents", figures)
    if "gpt2" in sections:
        label = f"tiny-looped-gpt2, gsm8k_text perplexity, {args.gpt2_docs} documents"
        sweep_vs_full_depth("tiny-looped-gpt2", ["gsm8k_text"], args.gpt2_docs, label, figures, data_dir=GSM8K,
                            also_exact="kl")
        # Decoding rules on an earlier loop group read out through every later group at every iteration (K² per
        # token, as their exact cells pay too): the decoding-free rules alone show the recording's own cost.
        sweep_vs_full_depth("tiny-looped-gpt2", ["gsm8k_text"], args.gpt2_docs, label, figures, data_dir=GSM8K,
                            policies=("first_order", "second_order", "second_order_magnitude", "cosine"))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
