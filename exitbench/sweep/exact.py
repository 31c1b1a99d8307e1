"""One exit config through lm-eval: its cells (one per task), each request's exits, and paired retimings.

Cells of one exit config share a single lm-eval call over their tasks (lm-eval's per-call setup would otherwise
dominate a small model's sweep); each task still gets its own cell.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from ..engine import ExitConfig
from ..errors import ExitbenchError
from ..harness.task_set import TaskSet
from ..models import Checkpoint
from ..policies import ExitPolicy
from ..runtime.provenance import machine_load, run_metadata
from ..store import cells
from ..timing import retime, trust
from . import backends
from .config import SweepConfig


def evaluation_error(names: list[str], exc: BaseException) -> ExitbenchError:
    hint = " (offline? pass --data-dir)" if any("gsm8k" in n for n in names) else ""
    return ExitbenchError(f"tasks {', '.join(names)} could not be evaluated: {str(exc).splitlines()[0]}{hint}")


def run_config(ck: Checkpoint, tasks: TaskSet, indices: list[int], exit_cfg: ExitConfig, cfg: SweepConfig,
               model: dict, keys: list[dict], run_id: str, on_requests: Callable[[int, int], None] | None = None,
               stats_out: list[dict] | None = None, full: ExitConfig | None = None) -> list[tuple[dict, list | None]]:
    """Evaluate one exit config on several tasks in one lm-eval call; one (cell, samples) per task on rank 0
    (and, into `stats_out`, each request's exits and costs). With `full`, the sweep's full-depth config, some
    of each task's documents are then timed again `cfg.timing_repeats` times beside it (timing/retime.py)."""
    import lm_eval

    from ..harness.quiet import lm_eval_output

    names = [tasks.names[i] for i in indices]
    engine = backends.backend(cfg.backend)
    lm = engine.lm_class()(ck, exit_config=exit_cfg, batch_size=cfg.batch_size, on_progress=on_requests,
                           add_bos_token=cfg.add_bos_token)
    started = run_metadata(seed=cfg.seed, run_id=run_id, batch_size=cfg.batch_size, device=str(lm.device),
                           dtype=ck.dtype, world_size=lm.world_size)
    # The machine's load around the timing: a busy machine makes wall-clock ratios unreliable (pareto warns).
    started["load"] = {"start": machine_load(), "end": None, "cpus": os.cpu_count()}
    if cfg.derived:  # not in the key: a cell at τ is the same cell however τ was chosen
        started["thresholds"] = cfg.derived
    t0 = time.perf_counter()
    try:
        # lm-eval's own bars would print one per task per cell beside exitbench's request bar
        with lm_eval_output(quiet=cfg.quiet, progress_bars=on_requests is None):
            results = lm_eval.simple_evaluate(
                model=lm, tasks=[tasks.specs[i] for i in indices], task_manager=tasks.manager, limit=cfg.limit,
                num_fewshot=cfg.num_fewshot, log_samples=cfg.log_samples, bootstrap_iters=cfg.bootstrap_iters,
                random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
                fewshot_random_seed=cfg.seed, verbosity="ERROR", **cfg.prompting.evaluate_kwargs())
    except ExitbenchError:
        raise
    except (ConnectionError, OSError, ValueError) as exc:
        raise evaluation_error(names, exc) from None
    gathered = lm.gather_object(lm.request_stats)
    if results is None or lm.rank != 0:
        return []
    elapsed = time.perf_counter() - t0
    timings = retimed(ck, lm, names, full, cfg) if full is not None and lm.world_size == 1 \
        and engine.retimed else {}
    started["load"]["end"] = machine_load()
    # lm-eval pads a rank that got fewer documents with copies of its last request (and repeats requests
    # for repeats > 1): each (task, doc, request) counts once, as it does in the metrics.
    unique: dict[tuple, dict] = {}
    for part in gathered:
        for s in part:
            unique.setdefault((s["task_name"], s["doc_id"], s["idx"]), s)
    if stats_out is not None:
        stats_out += unique.values()
    made = task_cells(results, names, keys, model, resolved_policy(exit_cfg, lm.engine.policies[0]),
                      list(unique.values()), started, cfg.log_samples, elapsed)
    for cell, _ in made:
        clocks = timings.get(cell["task"]["name"])
        if isinstance(clocks, str):  # why the task was not retimed
            cell["wall_clock"]["untimed"] = clocks
        elif clocks:
            rep, latency = clocks.get("throughput"), clocks.get("latency")
            if rep:
                cell["wall_clock"]["repeats"] = rep
                # Known now only from the repeats; a cell timed once gets its overhead at read time, against its
                # sweep's full-depth cell (analysis/frontier.py `overhead`).
                if rep.get("overhead") is not None:
                    cell["wall_clock"]["overhead"] = rep["overhead"]
            if latency:
                cell["wall_clock"]["latency"] = latency
        reasons = trust.warnings(cell)
        if reasons:  # said in the cell itself, for whoever reads it without exitbench
            cell["wall_clock"]["warnings"] = reasons
    if cfg.preset is not None:  # not in the key: the preset only set options, and those are keyed
        from ..presets import record

        for cell, _ in made:
            cell["preset"] = record(cfg.preset, cell["task"]["name"])
    return made


def retimed(ck: Checkpoint, lm: Any, names: list[str], full: ExitConfig, cfg: SweepConfig
            ) -> dict[str, dict[str, Any] | str | None]:
    """Per task, the paired repeated timings of the cell's model `lm` against full depth on documents drawn
    across the task (timing/retime.py), on each clock (`{"throughput": …, "latency": …}`), and a line saying
    why for a task too small to retime. Under torchrun they are skipped: each rank holds only its share of the
    requests."""
    from ..harness.model import ExitbenchLM

    if cfg.timing_repeats < 1:
        return {}
    full_lm = ExitbenchLM(ck, exit_config=full, batch_size=cfg.batch_size, add_bos_token=cfg.add_bos_token)
    priced = retime.full_depth_flops(full_lm)
    out: dict[str, dict[str, Any] | str | None] = {}
    for name in names:
        clocks: dict[str, Any] = {}
        for clock in retime.CLOCKS:
            size = retime.sample_size(cfg.batch_size, len(retime.task_documents(lm.received, name)), clock,
                                      cfg.timing_stream)
            sample = retime.draw(lm.received, lm.request_stats, name, cfg.batch_size, priced, size=max(size, 0))
            if not sample.work:
                clocks = retime.too_small(name, sample.of)
                break
            clocks[clock] = retime.retime(lm, full_lm, sample.work, cfg.timing_repeats, int(full.threshold), sample,
                                          clock)
        out[name] = clocks
    return out


def resolved_policy(exit_cfg: ExitConfig, policy: ExitPolicy) -> dict[str, Any]:
    """A cell's policy section: the config as asked, with what the model resolved it to."""
    # (min_steps as bound: a budgeted prefill exit reads its default 1 as half the depth, its chosen iteration)
    return {**exit_cfg.to_dict(), "max_steps": policy.max_steps, "min_steps": policy.min_steps,
            "patience": policy.patience,
            "threshold": policy.threshold, "baseline": exit_cfg.policy == "fixed",
            "needs_logits": policy.needs_logits,
            # the first iteration its definition lets it exit at, and whether that leaves it only the last one or
            # two before full depth (policies/base.py `exit_reach`): the tables mark such rows
            **policy.exit_reach(),
            **({"exit_model_sha256": policy.model.digest} if policy.needs_exit_model else {}),
            **({"draft_tokens": policy.k} if policy.drafts else {})}


def task_cells(results: dict, names: list[str], keys: list[dict], model: dict, resolved: dict,
               stats: list[dict], started: dict, log_samples: bool, elapsed: float
               ) -> list[tuple[dict, list | None]]:
    """One (cell, samples) per task of an lm-eval call, each sample joined with its requests' exits."""
    out = []
    for name, key in zip(names, keys):
        mine = [s for s in stats if s["task_name"] == name]
        task = cells.task_record(results, name, key["limit"])
        cell = cells.build(key, model, task, resolved, mine, started, samples=log_samples)
        cell["wall_clock"]["cell_s"] = elapsed * len(mine) / max(1, len(stats))
        samples = results.get("samples", {}).get(name) if log_samples else None
        if samples is not None:
            cells.attach_exits(samples, mine)
        out.append((cell, samples))
    return out
