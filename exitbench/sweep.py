"""Threshold sweeps, run exactly: tasks × policies × thresholds, plus fixed-depth baselines, one result cell each.

Each cell is named by a hash of everything that determines it; a cell already on disk is skipped, so an
interrupted sweep resumes where it stopped, and `--shard i/n` lets a scheduler fan cells out. Under torchrun
every rank runs every cell on its share of the documents (lm-eval shards them) and only rank 0 writes.
"""
from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__
from .engine import ExitConfig
from .errors import ExitbenchError
from .harness import retime
from .harness.prompting import Prompting
from .harness.task_set import TaskSet
from .models import Checkpoint
from .policies import REGISTRY, ExitPolicy, check_policy_name
from .runtime.distributed import init_distributed
from .runtime.provenance import machine_load, package_version, run_metadata
from .store import cells, disk
from .store.identity import checkpoint_identity


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
    # Exit knobs every cell shares (ExitConfig fields other than policy and threshold, which the sweep varies).
    exit: dict[str, Any] = field(default_factory=dict)
    bootstrap_iters: int = 1000
    add_bos_token: bool | None = None
    quiet: bool = False  # lm-eval's own chatter (warnings, bootstrap lines, request bars) silenced
    replay: bool = False  # cells computed from one recording pass (exitbench.replay), keyed apart from exact ones
    prompting: Prompting = field(default_factory=Prompting)  # chat template, system instruction, gen_kwargs
    preset: Any = None  # the presets.Preset the options came from: its published numbers go into each cell
    # Paired timings of each cell against full depth after its evaluation (harness/retime.py); 0: none. Not in
    # a cell's key: they add numbers to the cell and change none of its others.
    timing_repeats: int = retime.DEFAULT_REPEATS
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
    """None when the option was not given (each policy's own grid); an empty value is an error, not the grid."""
    if text is None:
        return None
    if not text.strip():
        raise ExitbenchError("--thresholds is empty; give comma-separated numbers, e.g. 1e-4,1e-3, or leave the "
                             "option out for each policy's own grid")
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
        check_policy_name(n)  # unknown names fail here, with the closest match
    return [n for n in dict.fromkeys(names) if n != "fixed"]


def default_baselines(max_steps: int) -> list[int]:
    rs, r = [], 1
    while r < max_steps:
        rs.append(r)
        r *= 2
    return rs + [max_steps]


def grid(cfg: SweepConfig, default_steps: int, grids: dict[str, tuple[float, ...]] | None = None,
         gated: bool = False) -> list[ExitConfig]:
    """Exit configs of the sweep: fixed-depth baselines first, then each policy over its thresholds (`grids`:
    the model's own default grids, `LoopedLM.exit_grids`, else the rule's). The shared exit knobs go to the
    policies that take them; a baseline keeps those that change how it runs (prefill, warm start, KV window).
    `gated`: the model has a trained exit gate, so 'all' includes the gate rules."""
    swept = {name for name, *_ in ExitConfig.knobs(swept=True)}
    shared = {k: v for k, v in cfg.exit.items() if k not in swept}
    unknown = sorted(set(shared) - {name for name, *_ in ExitConfig.knobs()})
    if unknown:
        raise ExitbenchError(f"unknown exit knob {unknown[0]!r} for a sweep")
    configs = [ExitConfig.fixed_depth(r, {**shared, "seed": cfg.seed})
               for r in (cfg.baselines or default_baselines(default_steps))]
    names = expand_policies(cfg.policies)
    if "all" in cfg.policies and not shared.get("exit_model"):
        names = [n for n in names if not REGISTRY[n].needs_exit_model]  # 'all' the rules this sweep can run
    if "all" in cfg.policies and not gated:
        names = [n for n in names if not REGISTRY[n].needs_gate]
    if cfg.thresholds and not any(not REGISTRY[n].retrospective for n in names):
        raise ExitbenchError(f"--thresholds {','.join(f'{t:g}' for t in cfg.thresholds)} apply to none of the policies "
                             f"asked for ({', '.join(cfg.policies)}): fixed depths are set with --baselines, and "
                             "the oracle has no threshold to sweep")
    for name in names:
        cls = REGISTRY[name]
        if cls.retrospective:
            thresholds = [cls.default_threshold]
        else:
            thresholds = cfg.thresholds or list((grids or {}).get(name, cls.default_grid))
        for tau in thresholds:
            if cls.integer_threshold and float(tau) != int(tau):
                raise ExitbenchError(f"--thresholds {tau:g}: {name} counts iterations, so its thresholds must be "
                                     "whole numbers; sweep it in a run of its own")
            if cls.integer_threshold:
                tau = int(tau)
            configs.append(ExitConfig.for_policy(name, tau, {**shared, "seed": cfg.seed}))
    unique = {tuple(sorted(c.to_dict().items())): c for c in configs}
    return list(unique.values())


def model_record(ck: Checkpoint) -> dict[str, Any]:
    from .models.embedded import source_label
    from .models.hub import hub_source

    ident = checkpoint_identity(ck.path)
    hub = hub_source(ck.path)  # the repo and resolved commit; the key keeps the content fingerprint
    return {"path": str(ck.path), "source": source_label(ck.path), **({"hub": hub} if hub else {}),
            "architecture": ck.model.architecture,
            "parameters": ck.model.num_parameters(), "fingerprint": ident.short, "files": ident.files,
            "dtype": ck.dtype, **({"compiled": True} if ck.model.compiled else {})}


def check_depths(configs: list[ExitConfig], groups: list[Any]) -> None:
    """Every config's depths within each loop group's maximum, and its step knobs consistent, checked when the
    sweep is planned: the engine would refuse the same config only when its cell came up, after the cells
    before it had been computed."""
    for config in configs:
        for g, policy in zip(groups, config.bound_policies(groups)):  # min_steps > max_steps fails here too
            if policy.max_steps <= g.max_steps:
                continue
            what = (f"--baselines {policy.max_steps}: a fixed depth of {policy.max_steps}" if config.policy == "fixed"
                    else f"--max-steps {policy.max_steps}")
            raise ExitbenchError(f"{what} exceeds the {g.name} group's maximum of {g.max_steps} iterations (the "
                                 f"checkpoint's configured maximum); give at most {g.max_steps}")


def key_limit(limit: int | float | None, n_docs: int | None) -> int | float | None:
    """The limit as a cell's key holds it: none where it takes every one of the task's `n_docs` documents (by
    lm-eval's count: a whole number as is, a fraction of the documents rounded up), since that is the same
    computation as no limit and must be the same cell. A limit that leaves documents out stays as given."""
    if limit is None or n_docs is None:
        return limit
    taken = math.ceil(n_docs * limit) if limit < 1 else int(limit)
    return None if taken >= n_docs else limit


def document_counts(tasks: TaskSet, cfg: SweepConfig) -> dict[str, int]:
    """Each task's evaluation documents (lm-eval's `eval_docs`; a group's largest subtask), which only a limit
    needs: without one, no task is built here."""
    if cfg.limit is None:
        return {}
    from .harness.quiet import lm_eval_output

    counts = {}
    # Quiet: whatever lm-eval warns of while loading a task it warns of again when the cells load it, and
    # datasets' bars belong to the data the cells read next.
    with lm_eval_output(quiet=True):
        for name, spec in zip(tasks.names, tasks.specs):
            try:
                loaded = tasks.manager.load([spec])
            except (ConnectionError, OSError, ValueError) as exc:
                raise evaluation_error([name], exc) from None
            sizes = [len(task.eval_docs) for task in loaded["tasks"].values()]
            if sizes:
                counts[name] = max(sizes)
    return counts


def evaluation_error(names: list[str], exc: BaseException) -> ExitbenchError:
    hint = " (offline? pass --data-dir)" if any("gsm8k" in n for n in names) else ""
    return ExitbenchError(f"tasks {', '.join(names)} could not be evaluated: {str(exc).splitlines()[0]}{hint}")


def cell_key(model: dict[str, Any], task: str, task_fingerprint: str, exit_cfg: ExitConfig, cfg: SweepConfig,
             device: str, world_size: int = 1, n_docs: int | None = None) -> dict[str, Any]:
    """Everything that can change a number in the cell (README, "What a cell's key holds"). Batch size, device
    and world size change only timings, but a cell's timings are results too. A replay cell's key says so, so
    it never stands in for an exact one. With the task's document count `n_docs`, a limit that takes them all
    is keyed as no limit (`key_limit`)."""
    mode = {"mode": "replay"} if cfg.replay else {}
    # A compiled step changes timings (and float rounding); named only when on, so other cells keep their ids.
    compiled = {"compiled": True} if model.get("compiled") else {}
    # Prompt settings (chat template, system instruction, …) only when set, so other cells keep their ids.
    prompt = cfg.prompting.key_dict()
    prompt = {"prompt": prompt} if prompt else {}
    return {**mode, "model": model["fingerprint"], "dtype": model["dtype"], **compiled, **prompt, "task": task,
            "task_fingerprint": task_fingerprint,
            "limit": key_limit(cfg.limit, n_docs), "num_fewshot": cfg.num_fewshot, "exit": exit_cfg.key_dict(),
            "add_bos_token": cfg.add_bos_token, "bootstrap_iters": cfg.bootstrap_iters,
            "batch_size": cfg.batch_size, "seed": cfg.seed, "device": device, "world_size": world_size,
            "versions": {"exitbench": __version__, "lm_eval": package_version("lm_eval") or package_version("lm-eval"),
                         "torch": torch.__version__}}


def run_config(ck: Checkpoint, tasks: TaskSet, indices: list[int], exit_cfg: ExitConfig, cfg: SweepConfig,
               model: dict, keys: list[dict], run_id: str, on_requests: Callable[[int, int], None] | None = None,
               stats_out: list[dict] | None = None, full: ExitConfig | None = None) -> list[tuple[dict, list | None]]:
    """Evaluate one exit config on several tasks in one lm-eval call; one (cell, samples) per task on rank 0
    (and, into `stats_out`, each request's exits and costs). With `full`, the sweep's full-depth config, each
    task's first requests are then timed again `cfg.timing_repeats` times beside it (harness/retime.py)."""
    import lm_eval

    from .harness.model import ExitbenchLM
    from .harness.quiet import lm_eval_output

    names = [tasks.names[i] for i in indices]
    lm = ExitbenchLM(ck, exit_config=exit_cfg, batch_size=cfg.batch_size, on_progress=on_requests,
                     add_bos_token=cfg.add_bos_token)
    started = run_metadata(seed=cfg.seed, run_id=run_id, batch_size=cfg.batch_size, device=str(lm.device),
                           dtype=ck.dtype, world_size=lm.world_size)
    # The machine's load around the timing: a busy machine makes wall-clock ratios unreliable (pareto warns).
    started["load"] = {"start": machine_load(), "end": None, "cpus": os.cpu_count()}
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
    timings = retimed(ck, lm, names, full, cfg) if full is not None and lm.world_size == 1 else {}
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
        if timings.get(cell["task"]["name"]):
            cell["wall_clock"]["repeats"] = timings[cell["task"]["name"]]
        reasons = retime.warnings(cell)
        if reasons:  # said in the cell itself, for whoever reads it without exitbench
            cell["wall_clock"]["warnings"] = reasons
    if cfg.preset is not None:  # not in the key: the preset only set options, and those are keyed
        from .presets import record

        for cell, _ in made:
            cell["preset"] = record(cfg.preset, cell["task"]["name"])
    return made


def retimed(ck: Checkpoint, lm: Any, names: list[str], full: ExitConfig, cfg: SweepConfig
            ) -> dict[str, dict[str, Any] | None]:
    """Per task, the paired repeated timings of the cell's model `lm` against full depth (None for a task
    with nothing to time). Under torchrun they are skipped: each rank holds only its share of the requests."""
    from .harness.model import ExitbenchLM

    if cfg.timing_repeats < 1:
        return {}
    full_lm = ExitbenchLM(ck, exit_config=full, batch_size=cfg.batch_size, add_bos_token=cfg.add_bos_token)
    return {name: retime.retime(lm, full_lm, retime.task_work(lm.received, name, cfg.batch_size),
                                cfg.timing_repeats, int(full.threshold)) for name in names}


def resolved_policy(exit_cfg: ExitConfig, policy: ExitPolicy) -> dict[str, Any]:
    """A cell's policy section: the config as asked, with what the model resolved it to."""
    return {**exit_cfg.to_dict(), "max_steps": policy.max_steps, "patience": policy.patience,
            "threshold": policy.threshold, "baseline": exit_cfg.policy == "fixed",
            "needs_logits": policy.needs_logits,
            **({"exit_model_sha256": policy.model.digest} if policy.needs_exit_model else {})}


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


@dataclass
class SweepPlan:
    cells: list[tuple[int, ExitConfig, dict[str, Any]]]   # (task index, exit config, key) of this shard
    done: dict[str, disk.Stored]                       # cell_id → a finished cell on disk
    model: dict[str, Any]                                 # model_record of the checkpoint
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    n_docs: dict[str, int] = field(default_factory=dict)  # task → evaluation documents, where a limit needs them
    full: ExitConfig | None = None  # the deepest fixed depth: what each cell's repeated timings are paired with

    def reused(self) -> list[dict[str, Any]]:
        """The cells of this shard already on disk: a rerun reuses them instead of computing them again."""
        return [self.done[cells.cell_id(key)].cell for _, _, key in self.cells if cells.cell_id(key) in self.done]


def plan(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str) -> SweepPlan:
    configs = grid(cfg, ck.model.loop_groups()[0].default_steps, ck.model.exit_grids(), ck.model.gated)
    check_depths(configs, ck.model.loop_groups())
    model = model_record(ck)
    world = init_distributed()[1]
    n_docs = document_counts(tasks, cfg)
    everything = [(t, c, cell_key(model, name, tasks.fingerprints[name], c, cfg, device, world, n_docs.get(name)))
                  for t, name in enumerate(tasks.names) for c in configs]
    i, n = cfg.shard
    mine = [cell for j, cell in enumerate(everything) if j % n == i]
    # A cell asked for with samples is finished only with its samples file beside it.
    done = {cid: stored for cid, stored in disk.existing(out).items()
            if stored.has_samples or not cfg.log_samples}
    full = max((c for c in configs if c.policy == "fixed"), key=lambda c: c.threshold)
    return SweepPlan(mine, done, model, n_docs=n_docs, full=full)


def run_sweep(ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, out: Path, device: str,
              progress: Any | None = None, sweep: SweepPlan | None = None, poll_s: float = 1.0
              ) -> list[dict[str, Any]]:
    """Run every cell of this shard that is not on disk yet; return all of this shard's cells.

    Cells of one exit config share a single lm-eval call over their tasks (lm-eval's per-call setup would
    otherwise dominate a small model's sweep); each task still gets its own cell file. A cell another process
    has claimed is left to it and collected once written (or computed here, should that process die).
    """
    sweep = sweep or plan(ck, tasks, cfg, out, device)
    rank0 = init_distributed()[0] == 0
    finished: dict[str, dict[str, Any]] = {}
    waiting: list[tuple[int, ExitConfig, dict]] = []
    for t, exit_cfg, key in sweep.cells:
        cid = cells.cell_id(key)
        if cid in sweep.done:
            finished[cid] = sweep.done[cid].cell
            if progress:
                progress.cell_skipped(cid)
        else:
            waiting.append((t, exit_cfg, key))
    if waiting and rank0:
        out.mkdir(parents=True, exist_ok=True)
    settled: set[str] = set()
    while waiting:
        computed_any = False
        for group in _by_exit_config(waiting):
            # Claim a group's cells right before computing them, so a second sweep into the same directory
            # takes the next group instead of idling. Rank 0 claims; every rank then runs the same cells,
            # since lm-eval's calls are collective.
            claims = [disk.Claim(out, cells.cell_id(key)) for _, _, key in group] if rank0 else []
            granted = _agree(claim_cells(claims, out, cfg.log_samples) if rank0 else None)
            mine = [(*item, claims[j] if rank0 else None) for j, item in enumerate(group) if granted[j]]
            try:
                if mine:
                    _run_group(ck, tasks, cfg, out, sweep, mine, progress, finished)
                    settled.update(cells.cell_id(key) for _, _, key, _ in mine)  # on every rank alike
                    computed_any = True
            finally:
                for *_, claim in mine:
                    if claim is not None:
                        claim.release()
        # What is left was claimed by another process: collect what it wrote, retry the rest (its owner may
        # have died and freed the claim).
        stored = disk.existing(out) if rank0 else {}
        left = []
        for t, exit_cfg, key in waiting:
            cid = cells.cell_id(key)
            if cid in settled:
                continue
            there = stored.get(cid)
            if _agree(there is not None and (there.has_samples or not cfg.log_samples)):
                if there is not None:
                    finished[cid] = there.cell
                if progress:
                    progress.cell_finished(f"{exit_cfg.policy} τ={exit_cfg.threshold:g} on {tasks.names[t]} "
                                           "(computed by another run)")
            else:
                left.append((t, exit_cfg, key))
        waiting = left
        if waiting and not computed_any:
            time.sleep(poll_s)  # every remaining cell is another process's: wait until it writes them
    return [finished[cells.cell_id(key)] for _, _, key in sweep.cells if cells.cell_id(key) in finished]


def claim_cells(claims: list[disk.Claim], out: Path, log_samples: bool) -> list[bool]:
    """Which cells this process now owns. A cell written by another run between our look at the directory and
    our claim is let go: it is done, and left for the collection step."""
    granted = [c.acquire() for c in claims]
    if any(granted):
        stored = disk.written(out, [c.cid for c, ok in zip(claims, granted) if ok])
        for j, claim in enumerate(claims):
            there = stored.get(claim.cid)
            if granted[j] and there is not None and (there.has_samples or not log_samples):
                claim.release()
                granted[j] = False
    return granted


def _by_exit_config(items: list[tuple[int, ExitConfig, dict]]) -> list[list[tuple[int, ExitConfig, dict]]]:
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(cells.cell_id(item[1].to_dict()), []).append(item)
    return list(groups.values())


def _agree(value: Any) -> Any:
    """Rank 0's value on every rank (itself in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_group(ck, tasks, cfg, out, sweep, group, progress, finished) -> None:
    exit_cfg = group[0][1]
    label = f"{exit_cfg.policy} τ={exit_cfg.threshold:g} on {', '.join(tasks.names[t] for t, *_ in group)}"
    if progress:
        progress.cell_started(label)
    produced = run_config(ck, tasks, [t for t, *_ in group], exit_cfg, cfg, sweep.model, [k for _, _, k, _ in group],
                          sweep.run_id, on_requests=progress.requests if progress else None, full=sweep.full)
    for cell, samples in produced:
        cell = cells.strict(cell)
        disk.write(out, cell, samples)
        finished[cell["cell_id"]] = cell
        if progress and cell.get("numerics", {}).get("nonfinite_tokens"):
            progress.warn(f"{cells.filename(cell)}: {cell['numerics']['nonfinite_tokens']} of "
                          f"{cell['iterations']['tokens']} tokens had a NaN or infinity in their states or logits")
    if progress:
        for _ in group:
            progress.cell_finished(label)


def summary_rows(cell_list: list[dict[str, Any]], reused: set[str] = frozenset()) -> list[dict[str, Any]]:
    """One row per cell, ordered task → baselines first → policy → threshold (the order quality moves in).
    `origin` says which rows this run did not measure exactly: cells reused from an earlier run (their
    cell ids in `reused`) and cells computed by replay."""
    rows = []
    for c in cell_list:
        p = c["policy"]
        origin = [w for w, yes in (("reused", c["cell_id"] in reused), ("replay", c.get("mode") == "replay")) if yes]
        rows.append({"task": c["task"]["name"], "metric": c["quality"]["metric"], "policy": p["policy"]
                     + (" (rel)" if p.get("relative") else ""), "threshold": p["threshold"],
                     "quality": c["quality"]["value"], "mean_iterations": c["iterations"]["mean"],
                     "per_group": c["iterations"].get("per_group_mean") or [],
                     "ms_per_token": 1e3 * (c["wall_clock"]["per_token_s"] or 0.0),
                     "probe_share": c["wall_clock"]["probe_share"], "origin": ", ".join(origin) or "measured",
                     "time_ratio": (c["wall_clock"].get("repeats") or {}).get("ratio"),
                     "time_spread": (c["wall_clock"].get("repeats") or {}).get("spread"),
                     "warnings": retime.warnings(c)})
    return sorted(rows, key=lambda r: (r["task"], r["policy"] != "fixed", r["policy"], r["threshold"]))

