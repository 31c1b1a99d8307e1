"""Threshold sweeps: tasks × policies × thresholds, plus fixed-depth baselines, one result cell each.

Each cell is named by a hash of everything that determines it; a cell already on disk is skipped, so an
interrupted sweep resumes where it stopped, and `--shard i/n` lets a scheduler fan cells out. Under torchrun
every rank runs every cell on its share of the documents (lm-eval shards them) and only rank 0 writes.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import cells
from .distributed import init_distributed
from .engine import ExitConfig
from .errors import ExitbenchError
from .models import Checkpoint
from .policies import REGISTRY, make_policy
from .provenance import run_metadata
from .tasks import TaskSet


@dataclass
class SweepConfig:
    tasks: list[str]
    policies: list[str]
    thresholds: list[float] | None = None
    baselines: list[int] | None = None
    limit: int | float | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    seed: int = 0
    shard: tuple[int, int] = (0, 1)
    log_samples: bool = False
    relative: bool = False
    min_steps: int = 1
    patience: int | None = None
    bootstrap_iters: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ExitbenchError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ExitbenchError(f"--shard {text}: need 0 ≤ i < n (shards are numbered from 0)")
    return i, n


def parse_thresholds(text: str | None) -> list[float] | None:
    if text is None or text.strip() == "":
        return None
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ExitbenchError(f"--thresholds must be comma-separated numbers, e.g. 1e-4,1e-3; "
                                 f"{part.strip()!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise ExitbenchError(f"--thresholds: every threshold must be a finite number > 0, got {part.strip()}")
        out.append(value)
    return out


def expand_policies(names: list[str]) -> list[str]:
    if not names:
        raise ExitbenchError("--policy names no policy; give one or more, or 'all'")
    if "all" in names:
        return [n for n in REGISTRY if n != "fixed"]
    for n in names:
        make_policy(n)  # unknown names fail here, with the closest match
    return [n for n in dict.fromkeys(names) if n != "fixed"]


def default_baselines(max_steps: int) -> list[int]:
    rs, r = [], 1
    while r < max_steps:
        rs.append(r)
        r *= 2
    return rs + [max_steps]


def grid(cfg: SweepConfig, default_steps: int) -> list[ExitConfig]:
    """Exit configs of the sweep: fixed-depth baselines first, then each policy over its thresholds."""
    configs = [ExitConfig("fixed", threshold=r, seed=cfg.seed) for r in (cfg.baselines or default_baselines(default_steps))]
    for name in expand_policies(cfg.policies):
        cls = REGISTRY[name]
        if cls.retrospective:
            thresholds = [cls.default_threshold]
        else:
            thresholds = cfg.thresholds or list(cls.default_grid)
        relative = cfg.relative and cls.uses_relative
        for tau in thresholds:
            if cls.integer_threshold:
                tau = max(1, round(tau))
            configs.append(ExitConfig(name, threshold=tau, relative=relative, min_steps=cfg.min_steps,
                                      patience=cfg.patience, seed=cfg.seed))
    unique = {tuple(sorted(c.to_dict().items())): c for c in configs}
    return list(unique.values())


def model_record(ck: Checkpoint) -> dict[str, Any]:
    from .embedded import EMBEDDED_DIR

    files = [ck.path / f for f in ck.files]
    try:
        source = f"embedded:{ck.path.resolve().relative_to(EMBEDDED_DIR)}"
    except ValueError:
        source = str(ck.path)
    return {"path": str(ck.path), "source": source, "architecture": ck.model.architecture,
            "parameters": ck.model.num_parameters(), "fingerprint": cells.file_fingerprint(files),
            "dtype": ck.dtype}


def cell_key(model: dict[str, Any], task: str, task_fingerprint: str, exit_cfg: ExitConfig, cfg: SweepConfig,
             device: str, world_size: int = 1) -> dict[str, Any]:
    # Everything that can change a number in the cell; batch size, device and world size only change times.
    return {"model": model["fingerprint"], "dtype": model["dtype"], "task": task, "task_fingerprint": task_fingerprint,
            "limit": cfg.limit, "num_fewshot": cfg.num_fewshot, "exit": exit_cfg.to_dict(),
            "batch_size": cfg.batch_size, "seed": cfg.seed, "device": device, "world_size": world_size}


def summarize_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Iterations, wall-clock and FLOPs of a cell from the adapter's per-request table."""
    its = [k for s in stats for k in s["iterations"]]
    tokens = len(its)
    # Each token's exit step per loop group (looped GPT-2 has several groups; iterations above are their sum).
    per_token = [steps for s in stats for steps in s["exit_steps"]]
    per_group = [statistics.fmean(g) for g in zip(*per_token)] if per_token else []
    seconds = sum(s["seconds"] for s in stats)
    token_seconds = sum(s["token_seconds"] for s in stats)
    phases = Counter()
    for s in stats:
        phases.update(s["phase_seconds"])
    core_probe = phases["core"] + phases["probe"]
    ordered = sorted(its)
    return {
        "iterations": {
            "mean": statistics.fmean(its) if its else None, "median": statistics.median(its) if its else None,
            "p90": ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)] if its else None,
            "max": max(its) if its else None, "histogram": {str(k): v for k, v in sorted(Counter(its).items())},
            "tokens": tokens, "requests": len(stats), "per_group_mean": per_group},
        "wall_clock": {"total_s": seconds, "per_token_s": token_seconds / tokens if tokens else None,
                       "request_s": seconds / len(stats) if stats else None,
                       "probe_share": phases["probe"] / core_probe if core_probe else 0.0,
                       "phases_s": dict(phases)},
        "flops": {"per_token": sum(s["flops"] for s in stats) / tokens if tokens else None,
                  "probe_per_token": sum(s["probe_flops"] for s in stats) / tokens if tokens else None},
    }


def task_record(results: dict[str, Any], name: str, cfg: SweepConfig) -> dict[str, Any]:
    r = results["results"][name]
    skip = {"alias", "name", "sample_len", " ", ""}
    metrics = {k: v for k, v in r.items() if k not in skip and "_stderr," not in k and isinstance(v, (int, float))}
    stderr = {k.replace("_stderr,", ","): v for k, v in r.items() if "_stderr," in k}
    hib_raw = results.get("higher_is_better", {}).get(name, {})
    higher = {k: bool(hib_raw.get(k.split(",")[0], True)) for k in metrics}
    if not metrics:
        raise ExitbenchError(f"lm-eval reported no metric for task {name}")
    primary = next(iter(metrics))
    return {"name": name, "version": results.get("versions", {}).get(name),
            "n_shot": results.get("n-shot", {}).get(name), "limit": cfg.limit,
            "n_samples": results.get("n-samples", {}).get(name), "metrics": metrics, "stderr": stderr,
            "higher_is_better": higher, "primary_metric": primary}


def run_config(ck: Checkpoint, tasks: TaskSet, indices: list[int], exit_cfg: ExitConfig, cfg: SweepConfig,
               model: dict, keys: list[dict], on_requests: Callable[[int, int], None] | None = None
               ) -> list[tuple[dict, list | None]]:
    """Evaluate one exit config on several tasks in one lm-eval call; one (cell, samples) per task on rank 0."""
    import lm_eval

    from .lm import ExitbenchLM

    names = [tasks.names[i] for i in indices]
    lm = ExitbenchLM.from_checkpoint(ck, exit_cfg, batch_size=cfg.batch_size, on_progress=on_requests)
    started = run_metadata(seed=cfg.seed, batch_size=cfg.batch_size, device=str(lm.device), dtype=ck.dtype,
                           world_size=lm.world_size)
    t0 = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[tasks.specs[i] for i in indices], task_manager=tasks.manager, limit=cfg.limit,
            num_fewshot=cfg.num_fewshot, log_samples=cfg.log_samples, bootstrap_iters=cfg.bootstrap_iters,
            random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed, verbosity="ERROR")
    except ExitbenchError:
        raise
    except (ConnectionError, OSError, ValueError) as exc:
        hint = " (offline? pass --data-dir)" if any("gsm8k" in n for n in names) else ""
        raise ExitbenchError(f"tasks {', '.join(names)} could not be evaluated: {str(exc).splitlines()[0]}{hint}") \
            from None
    gathered = lm.gather_object(lm.request_stats)
    if results is None or lm.rank != 0:
        return []
    elapsed = time.perf_counter() - t0
    # lm-eval pads a rank that got fewer documents with copies of its last request (and repeats requests
    # for repeats > 1): each (task, doc, request) counts once, as it does in the metrics.
    unique: dict[tuple, dict] = {}
    for part in gathered:
        for s in part:
            unique.setdefault((s["task_name"], s["doc_id"], s["idx"]), s)
    stats = list(unique.values())
    policy = lm.engine.policies[0]
    out = []
    for name, key in zip(names, keys):
        mine = [s for s in stats if s["task_name"] == name]
        task = task_record(results, name, cfg)
        primary = task["primary_metric"]
        cell = {
            "schema": cells.SCHEMA, "schema_version": cells.SCHEMA_VERSION, "cell_id": cells.cell_id(key),
            "key": key, "model": model, "task": task,
            "quality": {"metric": primary, "value": task["metrics"][primary], "stderr": task["stderr"].get(primary),
                        "higher_is_better": task["higher_is_better"][primary]},
            "policy": {**exit_cfg.to_dict(), "max_steps": policy.max_steps, "patience": policy.patience,
                       "threshold": policy.threshold, "baseline": exit_cfg.policy == "fixed",
                       "needs_logits": policy.needs_logits},
            **summarize_stats(mine),
            "run": started,
        }
        cell["wall_clock"]["cell_s"] = elapsed * len(mine) / max(1, len(stats))
        samples = results.get("samples", {}).get(name) if cfg.log_samples else None
        if samples is not None:
            by_doc: dict[Any, list[dict]] = {}
            for s in mine:
                by_doc.setdefault(s["doc_id"], []).append(s)
            for sample in samples:
                doc = by_doc.get(sample.get("doc_id"), [])
                sample["exitbench"] = {"requests": len(doc), **summarize_stats(doc)["iterations"],
                                       "exit_steps": [e for s in doc for e in s["exit_steps"]]}
        out.append((cell, samples))
    return out


@dataclass
class SweepPlan:
    cells: list[tuple[int, ExitConfig, dict[str, Any]]]   # (task index, exit config, key) of this shard
    done: dict[str, Path]                                 # cell_id → finished file
    model: dict[str, Any]                                 # model_record of the checkpoint


def plan(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str) -> SweepPlan:
    model = model_record(ck)
    configs = grid(cfg, ck.model.loop_groups()[0].default_steps)
    world = init_distributed()[1]
    everything = [(t, c, cell_key(model, tasks.names[t], tasks.fingerprints[tasks.names[t]], c, cfg, device, world))
                  for t in range(len(tasks.names)) for c in configs]
    i, n = cfg.shard
    mine = [cell for j, cell in enumerate(everything) if j % n == i]
    return SweepPlan(mine, cells.existing_cells(out), model)


def run_sweep(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str,
              progress: Any | None = None, sweep: SweepPlan | None = None) -> list[dict[str, Any]]:
    """Run every cell of this shard that is not on disk yet; return all of this shard's cells.

    Cells of one exit config share a single lm-eval call over their tasks (lm-eval's per-call setup would
    otherwise dominate a small model's sweep); each task still gets its own cell file.
    """
    sweep = sweep or plan(ck, tasks, cfg, out, device)
    model = sweep.model
    finished = []
    pending: dict[str, list[tuple[int, ExitConfig, dict]]] = {}
    for t, exit_cfg, key in sweep.cells:
        cid = cells.cell_id(key)
        if cid in sweep.done:
            finished.append(cells.read_cell(sweep.done[cid]))
            if progress:
                progress.cell_skipped(cid)
            continue
        pending.setdefault(cells.cell_id(exit_cfg.to_dict()), []).append((t, exit_cfg, key))
    for group in pending.values():
        exit_cfg = group[0][1]
        label = f"{exit_cfg.policy} τ={exit_cfg.threshold:g} on {', '.join(tasks.names[t] for t, _, _ in group)}"
        if progress:
            progress.cell_started(label)
        for cell, samples in run_config(ck, tasks, [t for t, _, _ in group], exit_cfg, cfg, model,
                                        [k for _, _, k in group], on_requests=progress.requests if progress else None):
            path = cells.write_cell(out, cell)
            if samples is not None:
                cells.write_samples(path.with_suffix(".samples.jsonl"), samples)
            finished.append(cell)
        if progress:
            for _ in group:
                progress.cell_finished(label)
    return finished


def summary_rows(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell, ordered task → baselines first → policy → threshold (the order quality moves in)."""
    rows = []
    for c in cell_list:
        p = c["policy"]
        rows.append({"task": c["task"]["name"], "metric": c["quality"]["metric"], "policy": p["policy"]
                     + (" (rel)" if p.get("relative") else ""), "threshold": p["threshold"],
                     "quality": c["quality"]["value"], "mean_iterations": c["iterations"]["mean"],
                     "per_group": c["iterations"].get("per_group_mean") or [],
                     "ms_per_token": 1e3 * (c["wall_clock"]["per_token_s"] or 0.0),
                     "probe_share": c["wall_clock"]["probe_share"]})
    return sorted(rows, key=lambda r: (r["task"], r["policy"] != "fixed", r["policy"], r["threshold"]))
