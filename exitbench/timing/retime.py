"""A cell's wall-clock timed again, several times, beside full depth: a time ratio that carries its spread.

A cell's ms/token is one pass over its documents, and the full-depth cell it is divided by ran minutes before
or after it: whatever else the machine did in between lands in the ratio unseen. So after a cell's evaluation
some of each task's documents run again `repeats` times, under the cell's exit config and under full depth
alternately (the cell first on even repeats, full depth first on odd ones, so a machine slowing down or speeding
up over the repeats weighs on both sides alike). Each repeat gives one paired ratio of per-token times; their
median is the cell's time ratio to full depth, and their range says how far to trust it.

Which documents: a stratified draw over the whole task, never its first ones. Tasks are often ordered (the
shipped chains tasks by the hops an answer needs, easiest first), so the first eighth of a task is where a rule
exits earliest, and a speed-up timed there is the easy end's. The evaluation has just counted every document's
FLOPs under the cell's rule, so the documents are ranked by that cost (per token, relative to full depth's) and
one is drawn from each of `sample_size` equal strata of the ranking: a draw whose cost spans the task's whatever
the order of its documents. Of the few ways to take one per stratum, the one whose FLOP ratio to full depth is
nearest the whole task's is taken. The cell records which documents were timed.

Two clocks, each paired with full depth (docs/engine.md, two clocks):
- *throughput*: the run's batch size over a stream of documents (STREAM_BATCHES batches' worth, drawn across the
  task as above), under the run's refill; its time per token is the engine's steady state, its wall-clock while
  the queue still held requests (prefills left out), per token at the stream's iterations per token, so the
  drain at the end, where rows idle with nothing left to take, is no part of it. This is `repeats`, the cell's
  `speed-up` and `overhead`.
- *latency*: one request at a time (batch size 1) on LATENCY_DOCUMENTS documents drawn the same way, the decode's
  wall-clock per token, prefills left out: the paper's ms/token.
Both are wall-clock, the engine's bookkeeping included, not its phases alone. The requests are lm-eval's own, as
the evaluation received them, so a repeat runs exactly what was scored. (A model that keeps no such clock, the
vLLM bridge's, gives the scored tokens' own phase times, `cells.request_stats`.)

The same passes count their FLOPs (the engine's cost model), so the repeats also give the cell's FLOP ratio to
full depth on the very requests timed (`flops_ratio`), and with it the cell's overhead: time ratio ÷ FLOP ratio,
how much more the cell's time costs than its arithmetic says (1 when a rule runs as fast as its FLOPs allow).
Where the timed documents' FLOP ratio still strays more than MAX_SAMPLE_OFF from the whole task's (a task of a
few dozen documents has strata too coarse to match it), the time ratio is carried over to the whole task at the
same overhead (`corrected_ratio`), and the tables say so.

An overhead above 1 has two sources, and the repeats tell them apart. A batch steps until its slowest row has
exited, so its loop steps can exceed what its tokens' iterations say even when every step is as cheap as full
depth's: `schedule` = (the cell's loop steps ÷ full depth's) ÷ (its iterations ÷ full depth's), counted by the
engine over the same passes, is that part (1 at batch size 1 or at a fixed depth; on a batch of a few tokens per
row, the batch's straggler floor). What is left, overhead ÷ schedule, is the engine's own step against a step at
full depth.
"""
from __future__ import annotations

import gc
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .trust import MAX_SAMPLE_OFF

DEFAULT_REPEATS = 3
MIN_DOCUMENTS = 16  # below a batch of 16, a repeat is a few milliseconds, as much scheduling noise as loop
CLOCKS = ("throughput", "latency")
# A throughput stream holds this many batches of documents (at most MAX_SHARE of the task): enough that the steady
# state, up to the moment the queue runs dry, outlasts the rows' first and last requests.
STREAM_BATCHES = 3
# The latency clock's documents, one at a time: each is a prefill and its tokens' decode at batch size 1. Six and
# a stream of three batches keep the main job's retiming under a third of its time (bench/RESULTS.md, two clocks).
LATENCY_DOCUMENTS = 6
# At most this share of a task's documents is retimed, so the 2 × repeats passes cost at most 3/4 of the cell's
# own evaluation where a task has few documents (a perplexity task's document is a whole text); a task of fewer
# than 1 / MAX_SHARE documents is not retimed at all.
MAX_SHARE = 1 / 8


def sample_size(batch_size: int, available: int, clock: str = "throughput", stream: int | None = None) -> int:
    """Documents per task retimed out of `available`, no more than MAX_SHARE of them (none, for a task that
    small): for the throughput clock a stream of `stream` documents, by default STREAM_BATCHES batches and at least
    MIN_DOCUMENTS; for the latency clock LATENCY_DOCUMENTS."""
    if clock == "latency":
        wanted = LATENCY_DOCUMENTS
    else:
        wanted = stream if stream is not None else max(STREAM_BATCHES * batch_size, MIN_DOCUMENTS)
    return min(wanted, math.floor(MAX_SHARE * available))


def too_small(task: str, documents: int) -> str:
    """Why a task's cells carry no speed-up: too few documents to time an eighth of them."""
    return (f"{task}: {documents} documents are too few to retime (at least {math.ceil(1 / MAX_SHARE)}: the "
            f"repeats time an eighth of a task); its cells have no paired speed-up: those shown (marked *) divide "
            f"the cells' own evaluations, one pass each")


# FLOPs of `tokens` tokens whose contexts sum to `context_sum`, at full depth (`full_depth_flops`).
FullFlops = Callable[[int, int], float]


def full_depth_flops(lm: Any) -> FullFlops:
    """What tokens cost at `lm`'s own depth with no probe (lm: a full-depth ExitbenchLM): the engine's cost
    model is a + b · context per token, so the tokens of a request need only their count and context sum."""
    flops = lm.engine.flops
    steps = [p.max_steps for p in lm.engine.policies]
    a = flops.token(0, steps, [0] * len(steps))["total"]
    b = flops.token(1, steps, [0] * len(steps))["total"] - a
    return lambda tokens, context_sum: tokens * a + b * context_sum


@dataclass
class Sample:
    """The documents of one task drawn for retiming, and what the evaluation says about them."""
    work: list[tuple[str, list]]       # (request method, requests) of the drawn documents, in lm-eval's order
    documents: list[Any]               # their doc ids, in the task's order
    of: int                            # the task's documents
    whole_flops_ratio: float | None    # every document's FLOPs over full depth's, from the evaluation's counts
    expected_flops_ratio: float | None  # the same over the drawn documents
    drawn: str = "stratified by cost"  # how: by each document's FLOP ratio, or by position where none is known

    def record(self) -> dict[str, Any]:
        return {"documents": self.documents, "of_documents": self.of, "drawn": self.drawn,
                "whole_flops_ratio": self.whole_flops_ratio, "expected_flops_ratio": self.expected_flops_ratio}


def draw(received: dict[str, list], stats: list[dict[str, Any]], task: str, batch_size: int,
         full_flops: FullFlops | None = None, size: int | None = None) -> Sample:
    """The documents of `task` to retime (`size` of them, by default `sample_size`, one per stratum of the cost
    ranking; none for a task too small), from the requests the model received and the evaluation's per-request
    `stats`. `full_flops` prices a document at full depth; without it (or without FLOP counts) the strata are
    positions."""
    order: dict[Any, int] = {}
    for requests in received.values():
        for r in requests:
            if r.task_name == task:
                order.setdefault(r.doc_id, len(order))
    cost: dict[Any, list[float]] = {doc: [0.0, 0.0] for doc in order}
    priced = full_flops is not None
    for s in stats:
        if s["task_name"] != task or s["doc_id"] not in cost:
            continue
        if s.get("flops") is None or "context_sum" not in s:
            priced = False
            continue
        cost[s["doc_id"]][0] += s["flops"]
        cost[s["doc_id"]][1] += full_flops(len(s["iterations"]), s["context_sum"]) if full_flops else 0.0
    docs = list(order)
    m = min(size, len(docs)) if size is not None else sample_size(batch_size, len(docs))
    if m < 1:
        return Sample([], [], len(docs), None, None)

    def ratio(chosen) -> float | None:
        cell, full = sum(cost[d][0] for d in chosen), sum(cost[d][1] for d in chosen)
        return cell / full if priced and full > 0 else None

    whole = ratio(docs)
    ranked = sorted(docs, key=lambda d: (cost[d][0] / cost[d][1] if cost[d][1] else 0.0, order[d]))         if whole is not None else docs
    stride = len(docs) / m
    ways = max(1, math.ceil(stride))  # offsets within a stratum; the middle one first, so ties keep the middle
    offsets = sorted(range(ways), key=lambda j: abs(j - (ways - 1) / 2))
    candidates = [[ranked[min(len(ranked) - 1, math.floor((i + (j + 0.5) / ways) * stride))] for i in range(m)]
                  for j in offsets]
    if whole is not None:
        candidates.sort(key=lambda c: abs(ratio(c) / whole - 1))  # stable: the middle offset wins ties
    chosen = set(candidates[0])
    work = []
    for kind, requests in received.items():
        mine = [r for r in requests if r.task_name == task and r.doc_id in chosen]
        if mine:
            work.append((kind, mine))
    return Sample(work, sorted(chosen, key=order.get), len(docs), whole, ratio(candidates[0]),
                  "stratified by cost" if whole is not None else "stratified by position")


def task_documents(received: dict[str, list], task: str) -> list[Any]:
    """The doc ids of `task` among the requests the model received, in their first order."""
    order: dict[Any, None] = {}
    for requests in received.values():
        for r in requests:
            if r.task_name == task:
                order.setdefault(r.doc_id, None)
    return list(order)


def task_work(received: dict[str, list], task: str, batch_size: int) -> list[tuple[str, list]]:
    """The requests of `task` to retime where no FLOP count is at hand: documents drawn evenly across the task
    by position (`draw` without costs)."""
    return draw(received, [], task, batch_size).work


def per_token_seconds(lm: Any, work: list[tuple[str, list]]) -> float | None:
    """One timed pass of `work` through an ExitbenchLM: seconds per scored token."""
    return timed_pass(lm, work).seconds


@dataclass
class Pass:
    """One timed pass: seconds and FLOPs per scored token (None where a request's stats carry none), and the
    engine's batched loop steps and the scored tokens' iterations over the pass (None where the model keeps no
    step count, or loops prompt tokens too: prefill `exit`); `measured` says what the seconds are."""
    seconds: float | None
    flops: float | None = None
    steps: float | None = None
    iterations: int | None = None
    measured: str | None = None


# What a pass's seconds per token are, by how they were measured (a cell says it in its clock's `measured`).
MEASURES = {"steady state": "wall-clock while the queue held requests, prefills left out, per token at the "
                            "stream's iterations per token",
            "whole pass": "wall-clock of the whole pass, prefills left out (the stream was too short for a steady "
                          "state: its drain is in it)",
            "phases": "the scored tokens' own loop phases (a model with no clock of its own)"}


def timed_pass(lm: Any, work: list[tuple[str, list]], clock: str = "throughput") -> Pass:
    """One pass of `work` through an ExitbenchLM, on `clock` (CLOCKS: the latency clock runs it at batch size
    1). The model's own request table, the requests it received, its batch size and its progress callback are
    left as they were, so a cell's statistics hold its evaluation alone and the next task's documents are still
    there to draw (a pass hands the model only this task's)."""
    kept, lm.request_stats = lm.request_stats, []
    received = dict(getattr(lm, "received", {}))
    progress, lm.on_progress = lm.on_progress, None
    batch_size = getattr(lm, "batch_size", None)
    engine = getattr(lm, "engine", None)
    before = dict(engine.stats) if engine is not None and "decode_s" in engine.stats else None
    steps_before = _engine_steps(lm)
    # No garbage collection inside a timed pass, as timeit does: a throughput stream's steady state lasts tens of
    # milliseconds on the embedded model, where one full collection (0.2 s with lm-eval's objects in memory) would
    # read as a pass several times slower than its repeats. (No collection before it either: at 0.2 s each, a
    # cell's twelve passes would pay more than they time.)
    collecting = gc.isenabled()
    gc.disable()
    try:
        if clock == "latency" and batch_size is not None:
            lm.batch_size = 1
        for kind, requests in work:
            getattr(lm, kind)(requests)
        stats = lm.request_stats
    finally:
        if collecting:
            gc.enable()
        lm.request_stats, lm.on_progress = kept, progress
        if batch_size is not None:
            lm.batch_size = batch_size
        if hasattr(lm, "received"):
            lm.received = received
    tokens = sum(len(s["iterations"]) for s in stats)
    if not tokens:
        return Pass(None)
    flops = None if any(s.get("flops") is None for s in stats) else sum(s["flops"] for s in stats) / tokens
    steps = None if steps_before is None else _engine_steps(lm) - steps_before
    iterations = sum(sum(s["iterations"]) for s in stats)
    if before is None:
        return Pass(sum(s["token_seconds"] for s in stats) / tokens, flops, steps, iterations, "phases")
    seconds, measured = clock_seconds({k: engine.stats[k] - before[k] for k in before}, tokens, clock)
    return Pass(seconds, flops, steps, iterations, measured)


def clock_seconds(delta: dict[str, float], tokens: int, clock: str) -> tuple[float, str]:
    """Seconds per token of a pass from the engine's clocks over it (`ExitEngine.stats` differences): the
    throughput clock's steady state where the pass had one, else (and on the latency clock) the whole pass."""
    if clock == "throughput" and delta["steady_work"] > 0 and delta["steady_tokens"] > 0:
        per_iteration = delta["steady_s"] / delta["steady_work"]
        return per_iteration * delta["steady_token_iterations"] / delta["steady_tokens"], "steady state"
    return delta["decode_s"] / tokens, "whole pass"


def _engine_steps(lm: Any) -> float | None:
    """The engine's loop steps so far, where they count the scored tokens' loops alone (prefill `full`: a
    prompt prefilled token by token under exits loops too, and its iterations are in no request's stats)."""
    engine = getattr(lm, "engine", None)
    if engine is None or getattr(engine.config, "prefill", "full") != "full":
        return None
    return engine.stats["steps"]


def retime(lm: Any, full_lm: Any, work: list[tuple[str, list]], repeats: int, full_depth: int,
           sample: Sample | None = None, clock: str = "throughput") -> dict[str, Any] | None:
    """`repeats` paired timings of `work` under `lm` and `full_lm` (full depth, `full_depth` steps) on `clock`,
    in alternating order; with the `sample` the work was drawn as, which documents they were and whether their
    FLOP ratio stands for the task's. None when there is nothing to time (no request, or none scored a token)."""
    if repeats < 1 or not work:
        return None
    cell_s: list[float | None] = []
    full_s: list[float | None] = []
    last: dict[int, Pass] = {}
    for r in range(repeats):
        pair = [(lm, cell_s), (full_lm, full_s)]
        for model, into in pair if r % 2 == 0 else pair[::-1]:
            last[id(into)] = timed_pass(model, work, clock)
            into.append(last[id(into)].seconds)
    if any(t is None or t <= 0 for t in cell_s + full_s):
        return None
    ratios = [a / b for a, b in zip(cell_s, full_s)]
    median = statistics.median(ratios)
    # FLOPs, steps and iterations do not vary between repeats: the last pass's counts are every pass's.
    cell, full = last[id(cell_s)], last[id(full_s)]
    flops_ratio = cell.flops / full.flops if cell.flops and full.flops else None
    steps_ratio = cell.steps / full.steps if cell.steps and full.steps else None
    schedule = steps_ratio / (cell.iterations / full.iterations) if steps_ratio and cell.iterations else None
    # (the cell's measure: the weaker of the two sides', a steady state only where both had one)
    measured = sorted({cell.measured, full.measured}, key=list(MEASURES).index)[-1]
    out = {"clock": clock, "batch_size": 1 if clock == "latency" else getattr(lm, "batch_size", None),
           "measured": measured,
           "repeats": repeats, "requests": sum(len(reqs) for _, reqs in work), "full_depth": full_depth,
           "per_token_s": cell_s, "full_per_token_s": full_s, "ratios": ratios, "ratio": median,
           "spread": (max(ratios) - min(ratios)) / median, "flops_ratio": flops_ratio,
           "overhead": median / flops_ratio if flops_ratio else None,
           "steps_ratio": steps_ratio, "schedule": schedule}
    if sample is not None:
        out.update(sample.record())
        out.update(representative(flops_ratio, sample.whole_flops_ratio, median))
    return out


def representative(timed: float | None, whole: float | None, ratio: float) -> dict[str, Any]:
    """Whether the timed documents' FLOP ratio `timed` stands for the whole task's (`whole`), within
    MAX_SAMPLE_OFF; where it does not, the time ratio carried to the whole task at the same overhead."""
    if not (timed and whole):
        return {"representative": None, "corrected_ratio": None}
    fits = abs(timed / whole - 1) <= MAX_SAMPLE_OFF
    return {"representative": fits, "corrected_ratio": None if fits else ratio * whole / timed}
