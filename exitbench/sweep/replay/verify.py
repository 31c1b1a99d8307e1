"""`--verify`: the replay cells a conclusion rests on, rerun exactly, and how far replay was from them.

Per task and policy the cells on that policy's quality-vs-iterations frontier (plus any named) are run by the
exact engine into OUT/verify/, and each pair is compared: quality (within the exact cell's standard error?),
mean iterations, and the share of tokens whose exit steps agree. `pareto` and `check` read an exact cell in
place of its replay twin, so a verified frontier rests on exact numbers.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from ...analysis import frontier
from ...runtime.files import atomic_write
from ...store import cells, disk
from ..exact import run_config
from ..keys import cell_key
from .sweep import ReplaySweep
from ...analysis.labels import exit_config_label

REPORT = "replay-vs-exact.json"
SCHEMA = "exitbench.replay_verification"


def chosen(cell_list: list[dict[str, Any]], named: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """Each policy's frontier cells per task (quality vs mean iterations), and the named ones; not the cells
    exact by construction (fixed depth on one loop group, scored)."""
    picked: dict[str, dict] = {}
    for points in frontier.groups(cell_list).values():
        higher = points[0].cell["quality"]["higher_is_better"]
        by_policy: dict[str, list[frontier.Point]] = {}
        for p in points:
            by_policy.setdefault(p.policy, []).append(p)
        for pts in by_policy.values():
            for p in frontier.frontier(pts, "iterations", higher):
                picked[p.cell["cell_id"]] = p.cell
    for c in cell_list:
        if (c["policy"]["policy"], c["policy"]["threshold"]) in {(n, float(t)) for n, t in named}:
            picked[c["cell_id"]] = c
    return [c for c in picked.values() if not c.get("replay", {}).get("exact_by_construction")]


def verify_frontier(replayer: ReplaySweep, cell_list: list[dict[str, Any]], out: Path,
                    named: list[tuple[str, float]] = ()) -> dict[str, Any]:
    """Rerun the chosen replay cells exactly into OUT/verify/ and write the comparison there."""
    sweep, tasks, cfg, ck = replayer.sweep, replayer.tasks, replayer.cfg, replayer.ck
    exact_cfg = dataclasses.replace(cfg, replay=False, log_samples=False, samples_required=False)
    index = {name: i for i, name in enumerate(tasks.names)}
    todo: dict[str, list[dict]] = {}
    for c in chosen([c for c in cell_list if c.get("mode") == "replay"], list(named)):
        todo.setdefault(cells.cell_id(c["key"]["exit"]), []).append(c)
    where = out / "verify"
    where.mkdir(parents=True, exist_ok=True)
    rows = []
    # The sweep's own configs, not ones rebuilt from the keys: a key names the learned rule's exit model by its
    # sha256, and the config holds the model it was keyed from.
    configs = {cells.cell_id(config.key_dict()): config for _, config, _ in sweep.cells}
    if replayer.progress:
        replayer.progress.note(f"verifying {len(todo)} frontier configs exactly (each runs every token's loop)")
    started = time.perf_counter()
    for i, (cid, replayed) in enumerate(todo.items(), 1):
        config = configs[cid]
        task_idx = [index[c["task"]["name"]] for c in replayed]
        keys = [cell_key(sweep.model, tasks.names[t], tasks.fingerprints[tasks.names[t]], config, exact_cfg,
                         ck.model.device.type, n_docs=sweep.n_docs.get(tasks.names[t])) for t in task_idx]
        progress = replayer.progress
        if progress:
            progress.cell_started(f"verifying {exit_config_label(config)} exactly")
        exact_stats: list[dict] = []
        exact = run_config(ck, tasks, task_idx, config, exact_cfg, sweep.model, keys, sweep.run_id,
                           on_requests=progress.requests if progress else None, stats_out=exact_stats)
        _, lm = replayer.replay(cells.cell_id(config.to_dict()), [(t, k) for t, k in zip(task_idx, keys)])
        for (cell, _), rc in zip(exact, replayed):
            disk.write(where, cells.strict(cell), None)
            rows.append(compare(rc, cell, lm.request_stats, exact_stats))
        if progress:
            progress.note(f"[verify {i}/{len(todo)}] {exit_config_label(config)} exact, "
                          f"{time.perf_counter() - started:.0f} s so far")
    report = {"schema": SCHEMA, "directory": str(out), "rows": sorted(rows, key=lambda r: (r["task"], r["policy"],
                                                                                           r["threshold"]))}
    text = json.dumps(report, indent=1, default=cells.jsonable)
    atomic_write(where / REPORT, lambda f: f.write(text))
    table = markdown(report["rows"])
    atomic_write(where / REPORT.replace(".json", ".md"), lambda f: f.write(table))
    return report


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (for a README or a pull request)."""
    from tabulate import tabulate

    pct = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    body = [[r["task"], r["policy"], f"{r['threshold']:g}", pct(r["quality_replay"], ".4g"),
             pct(r["quality_exact"], ".4g"), pct(r["stderr_exact"], ".2g"), pct(r["iterations_replay"], ".2f"),
             pct(r["iterations_exact"], ".2f"), pct(r["iterations_rel_diff"], "+.1%"), pct(r["exit_agreement"], ".1%"),
             pct(r["diverged_share"], ".0%")] for r in rows]
    head = ["task", "policy", "τ", "quality replay", "quality exact", "± stderr", "iters replay", "iters exact",
            "Δ iters", "exits agree", "answers cut"]
    return tabulate(body, headers=head, tablefmt="github", disable_numparse=True) + "\n"


def compare(replay_cell: dict, exact_cell: dict, replay_stats: list[dict], exact_stats: list[dict]) -> dict:
    name = exact_cell["task"]["name"]
    by_request = lambda stats: {(s["doc_id"], s["idx"]): s["exit_steps"] for s in stats  # noqa: E731
                                if s["task_name"] == name}
    ours, theirs = by_request(replay_stats), by_request(exact_stats)
    same = total = 0
    for req, steps in theirs.items():
        mine = ours.get(req, [])
        total += len(steps)
        same += sum(1 for a, b in zip(mine, steps) if list(a) == list(b))
    q_r, q_e = replay_cell["quality"]["value"], exact_cell["quality"]["value"]
    se = exact_cell["quality"].get("stderr")
    se = se if isinstance(se, (int, float)) else None  # lm-eval reports "N/A" where a metric has no stderr
    it_r, it_e = replay_cell["iterations"]["mean"], exact_cell["iterations"]["mean"]
    generation = replay_cell.get("replay", {}).get("generation")
    return {"task": name, "metric": exact_cell["quality"]["metric"], "policy": cells.series(exact_cell["policy"]),
            "threshold": exact_cell["policy"]["threshold"], "quality_replay": q_r, "quality_exact": q_e,
            "stderr_exact": se,
            "quality_within_stderr": None if q_r is None or q_e is None else abs(q_r - q_e) <= (se or 0.0) + 1e-12,
            "iterations_replay": it_r, "iterations_exact": it_e,
            "iterations_rel_diff": (it_r - it_e) / it_e if it_r is not None and it_e else None,
            "exit_agreement": same / total if total else None,
            "diverged_share": generation["diverged"] / generation["documents"] if generation else None,
            "exact_cell": exact_cell["cell_id"], "replay_cell": replay_cell["cell_id"]}
