"""A replay sweep: the cells of `exitbench run` from one recording pass per sweep instead of one run per cell.

1. lm-eval builds the tasks' requests once; `RecordingLM` answers them at the recording depth (the deepest any
   cell needs) and records every request's trajectories.
2. The requests are kept (lm-eval rebuilds them per call otherwise, the largest share of a small cell's cost)
   and each exit config's answers come from `ReplayLM` through lm-eval's own `evaluate`: filters, per-document
   metrics, aggregation and standard errors are lm-eval's code. Bootstrap standard errors run in this
   process (lm-eval's DISABLE_MULTIPROC path draws the same resamples as its pool, without a pool per call).
3. Each cell is written as an exact cell is, with `mode: replay` and what the replay rests on.
"""
from __future__ import annotations

import contextlib
import functools
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...engine import ExitConfig
from ...engine.recorder import Recorder
from ...harness.quiet import lm_eval_output
from ...harness.task_set import TaskSet
from ...models import Checkpoint
from ...runtime.provenance import run_metadata
from ...store import cells, disk
from ..config import SweepConfig, check_replayable
from ..exact import resolved_policy, task_cells
from ..schedule import SweepPlan, claim_cells
from .costs import SCORED, TIMED_DEPTH, measure
from .lm import RecordingLM, ReplayLM
from ...analysis.labels import exit_config_label


@contextlib.contextmanager
def _compiled_templates():
    """lm-eval compiles a task's Jinja templates anew for every document it scores (`utils.apply_template`);
    per cell that is most of the metric cost. A template compiled once renders the same text."""
    from lm_eval import utils

    original = utils.env.from_string
    utils.env.from_string = functools.lru_cache(maxsize=1024)(original)
    try:
        yield
    finally:
        utils.env.from_string = original


def _load_tasks(tasks: TaskSet, indices: list[int], cfg: SweepConfig) -> dict:
    """lm-eval's task objects, set up as simple_evaluate sets them up (few-shot count and seed)."""
    loaded = tasks.manager.load([tasks.specs[i] for i in indices])
    for task in loaded["tasks"].values():
        if cfg.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=cfg.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=cfg.seed)
    return loaded


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _evaluate(lm, loaded: dict, cfg: SweepConfig, bootstrap_iters: int, log_samples: bool,
              progress_bars: bool = True) -> dict:
    from lm_eval.evaluator import evaluate

    _seed(cfg.seed)
    with lm_eval_output(quiet=cfg.quiet, progress_bars=progress_bars), _compiled_templates():
        return evaluate(lm=lm, task_dict=loaded, limit=cfg.limit, bootstrap_iters=bootstrap_iters,
                        log_samples=log_samples, verbosity="ERROR")


def _keep_requests(loaded: dict) -> None:
    """Later evaluate calls reuse the requests built by the first (their answers are reset per call)."""
    for task in loaded["tasks"].values():
        task.build_all_requests = lambda **kwargs: None


def _reset_answers(loaded: dict) -> None:
    for task in loaded["tasks"].values():
        for instance in task.instances:
            instance.resps = []
            instance.filtered_resps = {}


class ReplaySweep:
    """A sweep plan's cells by replay: the recording is made once, when the first cell needs it."""

    def __init__(self, ck: Checkpoint, tasks: TaskSet, cfg: SweepConfig, sweep: SweepPlan,
                 progress: Any | None = None):
        check_replayable(cfg)
        self.ck, self.tasks, self.cfg = ck, tasks, cfg
        self.replan(sweep, progress)
        self.recording: RecordingLM | None = None

    def replan(self, sweep: SweepPlan, progress: Any | None = None) -> None:
        """Take the plan's cells (and the progress display). A recording made already is kept: `--thresholds
        quantiles:N` records before its grid, and so its plan, is known; a recording depends on no threshold."""
        self.sweep, self.progress = sweep, progress
        groups = self.ck.model.loop_groups()
        self.configs: dict[str, ExitConfig] = {}
        for _, c, _ in sweep.cells:
            self.configs.setdefault(cells.cell_id(c.to_dict()), c)
        self.policies = {cid: c.bound_policies(groups)
                         for cid, c in self.configs.items()}
        depth = max(p.max_steps for ps in self.policies.values() for p in ps)
        assert getattr(self, "depth", depth) == depth, "a new plan must need the depth recorded"
        self.depth = depth
        self.indices = sorted({t for t, _, _ in sweep.cells})
        # exitbench's own progress display replaces lm-eval's bars (they would print a bar per cell)
        self.lm_eval_bars = progress is None

    def record(self, costs: bool = True) -> None:
        """The recording pass, then (`costs`) the cost model that prices replay cells' time."""
        model, cfg = self.ck.model, self.cfg
        groups = model.loop_groups()
        first = [ps[0] for ps in self.policies.values()]
        recorder = Recorder(model, self.depth, first,
                            [c.threshold for c in self.configs.values() if c.policy == "fixed"], cfg.seed,
                            readout_steps=[min(g.default_steps, self.depth) for g in groups],
                            oracle=any(p.retrospective for p in first))
        with lm_eval_output(quiet=cfg.quiet, progress_bars=self.lm_eval_bars):
            self.loaded = _load_tasks(self.tasks, self.indices, cfg)
        if self.progress:
            self.progress.cell_started(f"recording {', '.join(self.tasks.names[i] for i in self.indices)} at depth "
                                       f"{self.depth}")
        t0 = time.perf_counter()
        self.recording = RecordingLM.over(self.ck, recorder, cfg.batch_size, cfg.add_bos_token, cfg.seed,
                                          on_progress=self.progress.requests if self.progress else None)
        _evaluate(self.recording, self.loaded, cfg, bootstrap_iters=0, log_samples=False,
                  progress_bars=self.lm_eval_bars)
        _keep_requests(self.loaded)
        self.record_s = time.perf_counter() - t0
        if not costs:
            return
        t0 = time.perf_counter()
        self.costs = measure(model, self.depth, first, self.recording.sample, cfg.batch_size, cfg.seed)
        self.costs_s = time.perf_counter() - t0

    def replay(self, cid: str, task_keys: list[tuple[int, dict]]) -> tuple[list[tuple[dict, list | None]], ReplayLM]:
        """The cells of one exit config on the given tasks, and the model that answered them."""
        if self.recording is None:
            self.record()
        cfg, config = self.cfg, self.configs[cid]
        started = run_metadata(seed=cfg.seed, run_id=self.sweep.run_id, batch_size=cfg.batch_size,
                               device=str(self.ck.model.device), dtype=self.ck.dtype, world_size=1)
        if cfg.derived:  # not in the key: a cell at τ is the same cell however τ was chosen
            started["thresholds"] = cfg.derived
        t0 = time.perf_counter()
        _reset_answers(self.loaded)
        lm = ReplayLM(self.recording, config, self.costs, tokens=cfg.log_samples)
        res = _evaluate(lm, self.loaded, cfg, cfg.bootstrap_iters, cfg.log_samples, self.lm_eval_bars)
        elapsed = time.perf_counter() - t0
        chosen = [self.tasks.names[t] for t, _ in task_keys]
        produced = task_cells(res, chosen, [k for _, k in task_keys], self.sweep.model,
                              resolved_policy(config, self.policies[cid][0]),
                              [s for s in lm.request_stats if s["task_name"] in chosen], started, cfg.log_samples,
                              elapsed)
        for cell, _ in produced:
            name = cell["task"]["name"]
            cell["mode"] = "replay"
            cell["wall_clock"]["estimated"] = True
            cell["replay"] = {
                "recording_depth": self.depth, "record_s": self.record_s, "cost_model_s": self.costs_s,
                "costs": self.costs.to_dict(), "generation": lm.generation.get(name),
                # what the cost model's unit costs were timed on (sweep/replay/costs.py), for the label that
                # says the cell's wall-clock is an estimate
                "cost_sample": {"requests": len(self.recording.sample), "scored_tokens": SCORED,
                                "depth": min(self.depth, TIMED_DEPTH)},
                # Fixed depth on scored tasks: every position recomputed at r (one loop group) or in a pass of
                # its own (several), so the same computation as the exact run's.
                "exact_by_construction": config.policy == "fixed" and name not in lm.generation}
        return [(cells.strict(cell), samples) for cell, samples in produced], lm

    def run(self, out: Path, poll_s: float = 1.0) -> list[dict[str, Any]]:
        """Every cell of the plan not on disk yet; returns all of the plan's cells.

        Cells are claimed as the exact sweep claims them (`exitbench.sweep.schedule.run_cells`), one exit config's cells
        right before they are replayed: a second sweep into the same directory replays the configs this one
        has not claimed (recording on its own if it has to), and collects the cells this one writes.
        """
        sweep, progress, cfg = self.sweep, self.progress, self.cfg
        finished = {cells.cell_id(key): sweep.done[cells.cell_id(key)].cell for _, _, key in sweep.cells
                    if cells.cell_id(key) in sweep.done}
        waiting: list[tuple[int, ExitConfig, dict]] = []
        for t, c, key in sweep.cells:
            if cells.cell_id(key) in finished:
                if progress:
                    progress.cell_skipped(cells.cell_id(key))
            else:
                waiting.append((t, c, key))
        disk.clear_stale_claims(out)
        if waiting:
            out.mkdir(parents=True, exist_ok=True)
        settled: set[str] = set()
        # Each write waits on the disk (fsync) longer than a replay cell computes: overlap them. A cell's claim
        # is let go once its file is written, so a sweep that finds the claim gone finds the cell.
        with ThreadPoolExecutor(max_workers=4) as writer:
            writes: list[Future] = []
            while waiting:
                computed_any = False
                for cid, task_keys in _by_config(waiting).items():
                    claims = [disk.Claim(out, cells.cell_id(key)) for _, key in task_keys]
                    granted = claim_cells(claims, out, cfg.samples_required)
                    mine = [(tk, claim) for tk, claim, ok in zip(task_keys, claims, granted) if ok]
                    if not mine:
                        continue
                    config = self.configs[cid]
                    label = (f"{exit_config_label(config)} on "
                             f"{', '.join(self.tasks.names[t] for (t, _), _ in mine)} (replay)")
                    if progress:
                        progress.cell_started(label)
                    try:
                        produced, _ = self.replay(cid, [tk for tk, _ in mine])
                    except BaseException:
                        for _, claim in mine:
                            claim.release()
                        raise
                    for (cell, samples), (_, claim) in zip(produced, mine):
                        writes.append(writer.submit(_write_then_release, out, cell, samples, claim))
                        finished[cell["cell_id"]] = cell
                    settled.update(cells.cell_id(key) for (_, key), _ in mine)
                    computed_any = True
                    if progress:
                        for _ in mine:
                            progress.cell_finished(label)
                waiting = self._collect(out, waiting, settled, finished)
                if waiting and not computed_any:
                    time.sleep(poll_s)  # every remaining cell is another sweep's: wait until it writes them
        for write in writes:
            write.result()  # a failed write fails the sweep, as it does when written in line
        return [finished[cells.cell_id(key)] for _, _, key in sweep.cells if cells.cell_id(key) in finished]

    def _collect(self, out: Path, waiting: list[tuple[int, ExitConfig, dict]], settled: set[str],
                 finished: dict[str, dict]) -> list[tuple[int, ExitConfig, dict]]:
        """The cells still to do after one pass: those another sweep claimed and has not written yet (its owner
        may also have died and freed the claim); the ones it wrote are taken into `finished`."""
        left = [item for item in waiting if cells.cell_id(item[2]) not in settled]
        stored = disk.written(out, [cells.cell_id(key) for _, _, key in left])
        still = []
        for t, c, key in left:
            there = stored.get(cells.cell_id(key))
            if there is not None and (there.has_samples or not self.cfg.samples_required):
                finished[there.cell["cell_id"]] = there.cell
                if self.progress:
                    self.progress.cell_finished(f"{exit_config_label(c)} on {self.tasks.names[t]} "
                                                "(computed by another run)")
            else:
                still.append((t, c, key))
        return still


def _by_config(items: list[tuple[int, ExitConfig, dict]]) -> dict[str, list[tuple[int, dict]]]:
    groups: dict[str, list[tuple[int, dict]]] = {}
    for t, c, key in items:
        groups.setdefault(cells.cell_id(c.to_dict()), []).append((t, key))
    return groups


def _write_then_release(out: Path, cell: dict, samples: list | None, claim: disk.Claim) -> Path:
    try:
        return disk.write(out, cell, samples)
    finally:
        claim.release()

