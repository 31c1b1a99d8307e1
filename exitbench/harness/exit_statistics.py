"""Exit statistics where a user of lm-eval's own CLI looks: its table, its results JSON and its samples.

`exitbench lm-eval run --model exitbench …` runs lm-eval's command line unchanged, so nothing of the exits would
reach lm-eval's outputs. Around lm-eval's `simple_evaluate` (which its CLI calls, then prints and saves what it
returns), `collecting()` keeps the exitbench models built inside, and `annotate` adds to the returned results:

- per task, rows `mean_iterations`, `p90_iterations` and `max_iterations` under the filter `exitbench` in
  `results[task]`, so lm-eval's printed table shows them beside the task's metrics;
- `config.exitbench.exit_statistics`: per task the tokens, iteration mean / median / p90 / max, the mean per
  loop group, the histogram and ms per token, in the results JSON;
- `sample["exitbench"]` in every logged sample: its requests' exit steps per token (as `exitbench run
  --log-samples` writes them).

Under torchrun each rank holds its own requests, and lm-eval builds results on rank 0: the statistics are rank
0's documents (`ranks` says how many there were).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..store import cells

FILTER = "exitbench"
TABLE_ROWS = ("mean", "p90", "max")

_collector: list | None = None


def register(lm: Any) -> None:
    """Called by every ExitbenchLM as it is built: kept while `collecting()` is active, else not at all."""
    if _collector is not None:
        _collector.append(lm)


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    global _collector
    saved, _collector = _collector, []
    try:
        yield _collector
    finally:
        _collector = saved


def per_task(stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each task's exit statistics from its requests' stats (one task's requests per lm-eval task name)."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for s in stats:
        by_task.setdefault(s["task_name"], []).append(s)
    out = {}
    for task, mine in sorted(by_task.items()):
        summary = cells.summarize(mine)
        it, wall = summary["iterations"], summary["wall_clock"]
        out[task] = {"tokens": it["tokens"], "requests": it["requests"], "mean": it["mean"], "median": it["median"],
                     "p90": it["p90"], "max": it["max"], "per_group_mean": it["per_group_mean"],
                     "histogram": it["histogram"],
                     "ms_per_token": None if wall["per_token_s"] is None else 1e3 * wall["per_token_s"]}
    return out


def annotate(results: dict[str, Any], models: list[Any]) -> None:
    """Add the exit statistics of `models` (the exitbench LMs an lm-eval call built) to its results."""
    stats = [s for lm in models for s in lm.request_stats]
    if not stats or "results" not in results:
        return
    tasks = per_task(stats)
    for task, numbers in tasks.items():
        if task in results["results"]:
            results["results"][task].update({f"{name}_iterations,{FILTER}": numbers[name] for name in TABLE_ROWS})
    config = results.setdefault("config", {}).setdefault("exitbench", {})
    config["exit_statistics"] = tasks
    config["ranks"] = max(getattr(lm, "world_size", 1) for lm in models)
    for task, samples in (results.get("samples") or {}).items():
        cells.attach_exits(samples, [s for s in stats if s["task_name"] == task])
