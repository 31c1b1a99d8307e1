"""A cell's wall-clock timed again, several times, beside full depth: a time ratio that carries its spread.

A cell's ms/token is one pass over its documents, and the full-depth cell it is divided by ran minutes before
or after it: whatever else the machine did in between lands in the ratio unseen. So after a cell's evaluation
the first requests of each of its tasks run again `repeats` times, under the cell's exit config and under full
depth alternately (the cell first on even repeats, full depth first on odd ones, so a machine slowing down
or speeding up over the repeats weighs on both sides alike). Each repeat gives one paired ratio of per-token
times; their median is the cell's time ratio to full depth, and their range says how far to trust it.

The per-token time is the one a cell reports (the scored tokens' own loops, `cells.request_stats`), and the
requests are lm-eval's own, as the evaluation received them, so a repeat runs exactly what was scored.

The same passes count their FLOPs (the engine's cost model), so the repeats also give the cell's FLOP ratio to
full depth on the very requests timed, and with it the cell's overhead: time ratio ÷ FLOP ratio, how much more
the cell's time costs than its arithmetic says (1 when a rule runs as fast as its FLOPs allow).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

DEFAULT_REPEATS = 3
# The most --timing-repeats a sweep takes: the noise floor does not narrow with more (bench/timing_noise.py), and
# each repeat reruns an eighth of every task twice.
MAX_REPEATS = 20
# Repeats spanning more than half their median leave a speed-up unknown to within ±25%: it no longer orders
# policies whose costs differ by less than that. The floor is the machine's: on an idle 2-core VM the same
# config paired with itself spans 0.2 to 0.7 of its median (bench/timing_noise.py, bench/RESULTS.md), so some
# cells are flagged even there; a machine another job competes with spans far more.
UNRELIABLE_SPREAD = 0.5
MIN_REQUESTS = 16  # below a batch of 16, a repeat is a few milliseconds, as much scheduling noise as loop
# At most this share of a task's requests is retimed, so the 2 × repeats passes cost at most 3/4 of the cell's
# own evaluation where a task has few requests (a perplexity task's request is a whole document); a task of
# fewer than 1 / MAX_SHARE requests is not retimed at all.
MAX_SHARE = 1 / 8


def sample_size(batch_size: int, available: int) -> int:
    """Requests per task retimed out of `available`: one full batch and at least MIN_REQUESTS, but no more
    than MAX_SHARE of them (none, for a task that small)."""
    return min(max(batch_size, MIN_REQUESTS), math.floor(MAX_SHARE * available))


def task_work(received: dict[str, list], task: str, batch_size: int) -> list[tuple[str, list]]:
    """The first requests of `task` of each request type the model received (`sample_size` of them), as
    (method, requests)."""
    work = []
    for kind, requests in received.items():
        mine = [r for r in requests if r.task_name == task]
        n = sample_size(batch_size, len(mine))
        if n:
            work.append((kind, mine[:n]))
    return work


def per_token_seconds(lm: Any, work: list[tuple[str, list]]) -> float | None:
    """One timed pass of `work` through an ExitbenchLM: seconds per scored token."""
    return timed_pass(lm, work)[0]


def timed_pass(lm: Any, work: list[tuple[str, list]]) -> tuple[float | None, float | None]:
    """One pass of `work` through an ExitbenchLM: (seconds, FLOPs) per scored token; FLOPs None where a request's
    stats carry none. The model's own request table and progress callback are left as they were, so a cell's
    statistics hold its evaluation alone."""
    kept, lm.request_stats = lm.request_stats, []
    progress, lm.on_progress = lm.on_progress, None
    try:
        for kind, requests in work:
            getattr(lm, kind)(requests)
        stats = lm.request_stats
    finally:
        lm.request_stats, lm.on_progress = kept, progress
    tokens = sum(len(s["iterations"]) for s in stats)
    if not tokens:
        return None, None
    flops = None if any(s.get("flops") is None for s in stats) else sum(s["flops"] for s in stats) / tokens
    return sum(s["token_seconds"] for s in stats) / tokens, flops


def retime(lm: Any, full_lm: Any, work: list[tuple[str, list]], repeats: int, full_depth: int
           ) -> dict[str, Any] | None:
    """`repeats` paired timings of `work` under `lm` and `full_lm` (full depth, `full_depth` steps), in
    alternating order. None when there is nothing to time (no request, or none scored a token)."""
    if repeats < 1 or not work:
        return None
    cell_s: list[float | None] = []
    full_s: list[float | None] = []
    flops: dict[int, float | None] = {}
    for r in range(repeats):
        pair = [(lm, cell_s), (full_lm, full_s)]
        for model, into in pair if r % 2 == 0 else pair[::-1]:
            seconds, flops[id(into)] = timed_pass(model, work)
            into.append(seconds)
    if any(t is None or t <= 0 for t in cell_s + full_s):
        return None
    ratios = [a / b for a, b in zip(cell_s, full_s)]
    median = statistics.median(ratios)
    # FLOPs do not vary between repeats: the last pass's count is every pass's.
    cell_f, full_f = flops[id(cell_s)], flops[id(full_s)]
    flops_ratio = cell_f / full_f if cell_f and full_f else None
    return {"repeats": repeats, "requests": sum(len(reqs) for _, reqs in work), "full_depth": full_depth,
            "per_token_s": cell_s, "full_per_token_s": full_s, "ratios": ratios, "ratio": median,
            "spread": (max(ratios) - min(ratios)) / median, "flops_ratio": flops_ratio,
            "overhead": median / flops_ratio if flops_ratio else None}


def wide_spread(cell: dict[str, Any]) -> bool:
    """Whether the cell's repeats spread too far for its ratio to be read (False for a cell timed once)."""
    rep = cell.get("wall_clock", {}).get("repeats")
    return bool(rep) and rep["spread"] > UNRELIABLE_SPREAD


def warnings(cell: dict[str, Any]) -> list[str]:
    """Why a cell's wall-clock ratios are not to be trusted, one reason each: the machine was busy while it was
    timed, or its repeated timings spread too far. Empty when neither."""
    from ..runtime.provenance import busy

    out = []
    load = cell.get("run", {}).get("load")
    if busy(load):
        peak = max(load.get("start") or 0, load.get("end") or 0)
        out.append(f"timed on a busy machine (load {peak:g} on {load['cpus']} cores)")
    if wide_spread(cell):
        rep = cell["wall_clock"]["repeats"]
        out.append(f"its {rep['repeats']} repeated timings spread {100 * rep['spread']:.0f}% around their ratio "
                   f"{rep['ratio']:.3g} to full depth")
    return out
