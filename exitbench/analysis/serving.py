"""What a rule buys a server: decode throughput projected from a cell's recorded exit schedule.

A cell's mean iterations say how much less loop work its rule does; a server's throughput also depends on how
the work is batched. In a batch, a token that exits early waits for the slowest row unless the engine hands its
row the next token at once. Continuous Depth Batching (kschwethelm/continuous-depth-batching) measures its
schedulers by replaying recorded exit schedules; every exact cell records one (`cells.exit_schedule`: each
request's prompt and each of its tokens' iterations), so this module replays a cell's requests through
`batch` rows under three schedulers, event by event:

- `full`: every token runs the policy's max steps, each batch step as long as its tokens (the baseline);
- `static`: the tokens of a batch step start together and the step lasts until its slowest token exits;
  a token that exited waits, its row idle (compacted: an idle row costs nothing per loop step);
- `continuous`: Continuous Depth Batching's rule, one kind of work per tick: a loop step for the rows still
  looping, the exit work of rows whose tokens exited, or the prefill of waiting requests into free rows,
  whichever the most rows wait for; a row takes its next token when its exit work ran, not when its batch's
  slowest token exits.

In all three a request that finishes frees its row for the next request in line, prefilled when it joins, so
the schedulers differ only in what exits do. The requests are the cell's own, with its own token counts, so
`full` is the same work at full depth, and its throughput is the baseline each other is divided by.

Time comes from a cost model (`Cost`), measured on a machine by `bench/serving_cost.py`, not assumed: a loop
step costs a fixed part and a part per row iterating in it; tokens that exit together cost one event (coda,
head and the next token's entry), a fixed part and a part per token; requests that join together cost one
prefill, a fixed part and a part per prompt token. The ideal is the iteration ratio (full depth's iterations
over the cell's): what the rule would buy if time were only per-row loop work.
"""
from __future__ import annotations

import functools
import heapq
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ..errors import ExitbenchError
from ..store import cells

SCHEDULERS = ("full", "static", "continuous")
# exitbench's own engine, for checking the simulation against it (bench/serve_sim_check.py): continuous as
# above, but a finished request's row takes the next request at the next tick, whatever else waits.
ENGINE = "engine"
DEFAULT_COST_FILE = Path(__file__).with_name("serving_cost.json")


@dataclass(frozen=True)
class Cost:
    """Seconds of each kind of work (see the module's docstring) and where the figures come from."""
    step_s: float
    row_s: float
    exit_s: float
    exit_row_s: float
    prefill_s: float
    prefill_token_s: float
    source: str
    # What each rule's signal adds to a loop step (fixed, per row), measured where the file names the rule: a
    # decoding rule's readout (kl, confidence) costs a coda and head per row per step, a latent rule's a few ops.
    probes: dict[str, tuple[float, float]] = field(default_factory=dict)
    # A loop step at which tokens exit: what their leaving costs the step itself (the engine's copy of their
    # entries to the later slots, its new token set), calibrated on requests apart from any checked.
    leave_s: float = 0.0
    policy: str | None = None  # the rule whose probe a step pays (`for_policy`)

    def step(self, rows: int) -> float:
        fixed, per_row = self.probes.get(self.policy, (0.0, 0.0)) if self.policy else (0.0, 0.0)
        return self.step_s + fixed + (self.row_s + per_row) * rows

    def for_policy(self, policy: str) -> "Cost":
        return replace(self, policy=policy)

    def exits(self, tokens: int) -> float:
        return self.exit_s + self.exit_row_s * tokens

    def prefill(self, prompt_tokens: int) -> float:
        return self.prefill_s + self.prefill_token_s * prompt_tokens

    @classmethod
    def read(cls, path: Path | None = None) -> "Cost":
        """A cost file (bench/serving_cost.py writes one), or the packaged default measured on the embedded
        model; one line naming what is wrong when it cannot be used."""
        path = Path(path) if path is not None else DEFAULT_COST_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ExitbenchError(f"--cost {path}: not a readable cost file ({exc}); write one with "
                                 "`python bench/serving_cost.py --out FILE`") from None
        names = [f for f in cls.__dataclass_fields__ if f not in ("source", "probes", "policy")]
        if isinstance(raw, dict) and "leave_s" not in raw:
            names.remove("leave_s")  # optional: older cost files price no leaving
        bad = [n for n in names if not isinstance(raw.get(n) if isinstance(raw, dict) else None, (int, float))
               or raw[n] < 0]
        if bad:
            raise ExitbenchError(f"--cost {path}: {', '.join(bad)} must be numbers ≥ 0 (seconds); write the file "
                                 "with `python bench/serving_cost.py --out FILE`")
        probes = raw.get("probes") or {}
        if not isinstance(probes, dict) or not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and x >= 0 for x in v)
                for v in probes.values()):
            raise ExitbenchError(f"--cost {path}: probes must map each rule to [fixed, per row] seconds ≥ 0")
        return cls(**{n: float(raw[n]) for n in names if n != "leave_s"}, leave_s=float(raw.get("leave_s", 0.0)),
                   source=str(raw.get("source") or path),
                   probes={k: (float(a), float(b)) for k, (a, b) in probes.items()})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("policy")
        return out


@dataclass(frozen=True)
class Request:
    prompt: int             # positions prefilled before its first exited token
    iterations: list[int]   # each token's loop iterations, in order


def requests_of(cell: dict[str, Any]) -> list[Request] | None:
    """A cell's requests with their exit schedules, or None where the cell recorded none (written before
    schedules were, or a replay cell)."""
    exits = cell.get("exits")
    if not exits or not exits.get("iterations"):
        return None
    return [Request(first or 0, list(its)) for first, its in zip(exits["first"], exits["iterations"]) if its]


def simulate(requests: list[Request], batch: int, scheduler: str, cost: Cost, max_steps: int) -> float:
    """Seconds to serve `requests` in order through `batch` rows under `scheduler`."""
    if scheduler not in (*SCHEDULERS, ENGINE):
        raise ExitbenchError(f"unknown scheduler {scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
    if batch < 1:
        raise ExitbenchError(f"--batch-size must be ≥ 1, got {batch}")
    if scheduler == "full":
        requests = [Request(r.prompt, [max_steps] * len(r.iterations)) for r in requests]
    if scheduler in ("continuous", ENGINE):
        return _continuous(requests, batch, cost, refill_at_once=scheduler == ENGINE)
    return _static(requests, batch, cost)


def _static(requests: list[Request], batch: int, cost: Cost) -> float:
    queue, rows, t = list(reversed(requests)), [], 0.0   # a row: [request, index of its next token]
    while queue or rows:
        joining = []
        while queue and len(rows) < batch:
            joining.append(queue.pop())
            rows.append([joining[-1], 0])
        if joining:
            t += cost.prefill(sum(r.prompt for r in joining))
        # one batch step: every row's token from iteration 1 until the slowest exits; an exited row idles
        lengths = sorted(req.iterations[i] for req, i in rows)
        done = 0
        for n, length in enumerate(lengths):
            if length > done:
                t += (length - done) * cost.step(len(lengths) - n) + cost.leave_s
            done = length
        t += cost.exits(len(rows))
        for row in rows:
            row[1] += 1
        rows = [row for row in rows if row[1] < len(row[0].iterations)]
    return t


def _continuous(requests: list[Request], batch: int, cost: Cost, refill_at_once: bool = False) -> float:
    """One kind of work per tick, the kind the most rows wait for: a loop step for the rows looping, the exit
    work of the rows whose tokens exited, or the prefill of the next requests into the free rows. So a tick's
    fixed cost is shared as a batch step's is, while a row takes its next token, or its row the next request,
    without waiting for the slowest token of a batch."""
    queue, t, now = list(reversed(requests)), 0.0, 0
    looping: list[tuple[int, int]] = []   # heap of (loop step its current token exits at, row id)
    waiting: list[int] = []               # rows whose token exited, their exit work not yet run
    rows: dict[int, list] = {}            # row id → [request, index of its current token]
    free = list(range(batch))
    while queue or rows:
        joinable = len(free) if queue else 0
        if joinable and (refill_at_once or joinable >= max(len(looping), len(waiting))):
            joining = []
            while queue and free:
                row, req = free.pop(), queue.pop()
                rows[row] = [req, 0]
                heapq.heappush(looping, (now + req.iterations[0], row))
                joining.append(req)
            # exitbench's engine pads its rows' prompts to the longest; a serving engine packs them
            t += cost.prefill(len(joining) * max(r.prompt for r in joining) if refill_at_once
                              else sum(r.prompt for r in joining))
        elif waiting and len(waiting) >= len(looping):
            t += cost.exits(len(waiting))
            for row in waiting:
                state = rows[row]
                state[1] += 1
                if state[1] < len(state[0].iterations):
                    heapq.heappush(looping, (now + state[0].iterations[state[1]], row))
                else:
                    del rows[row]
                    free.append(row)
            waiting = []
        else:
            at = looping[0][0]
            t += (at - now) * cost.step(len(looping)) + cost.leave_s  # every looping row to the next exit
            now = at
            while looping and looping[0][0] == now:
                waiting.append(heapq.heappop(looping)[1])
    return t


def project(cell: dict[str, Any], batch_sizes: Iterable[int], cost: Cost) -> list[dict[str, Any]] | None:
    """One row per batch size: the cell's throughput under each scheduler relative to full depth, the ideal
    (the iteration ratio) and the share of it continuous batching achieves. None for a cell without exits."""
    requests = requests_of(cell)
    if requests is None:
        return None
    policy = cell["policy"]
    K = sum(max_steps_per_group(cell))
    iterations = sum(sum(r.iterations) for r in requests)
    tokens = sum(len(r.iterations) for r in requests)
    ideal = K * tokens / iterations
    cost = cost.for_policy(policy["policy"])
    out = []
    for batch in batch_sizes:
        times = {s: simulate(requests, batch, s, cost, K) for s in SCHEDULERS}
        speed = {s: times["full"] / times[s] for s in SCHEDULERS}
        out.append({"task": cell["task"]["name"], "kind": cell["exits"].get("kind"), "policy": cells.series(policy),
                    "threshold": policy.get("threshold"), "mean_iterations": iterations / tokens, "max_steps": K,
                    "batch_size": batch, "requests": len(requests), "tokens": tokens,
                    **{f"throughput_{s}": speed[s] for s in SCHEDULERS}, "ideal": ideal,
                    "share_of_ideal": speed["continuous"] / ideal, "seconds": times})
    return out


def max_steps_per_group(cell: dict[str, Any]) -> list[int]:
    """Each loop group's max steps: a token's full-depth iterations are their sum."""
    per_group = cell["iterations"].get("per_group_mean") or [None]
    return [int(cell["policy"]["max_steps"])] * len(per_group)


def parse_batch_sizes(text: str) -> list[int]:
    """`--batch-size 1,8,64`: whole numbers ≥ 1, one line naming the bad one."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ExitbenchError(f"--batch-size must be comma-separated whole numbers, e.g. 1,8,64, got {text!r}"
                             ) from None
    for b in sizes:
        if b < 1:
            raise ExitbenchError(f"--batch-size must be ≥ 1, got {b}")
    return sizes


def serve_sim(cell_list: list[dict[str, Any]], batch_sizes: list[int], cost: Cost
              ) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for every cell with an exit schedule, and a note per cell skipped for lack of one."""
    rows, skipped = [], []
    for cell in sorted(cell_list, key=lambda c: (c["task"]["name"], cells.series(c["policy"]),
                                                 c["policy"].get("threshold") or 0)):
        got = project(cell, batch_sizes, cost)
        if got is None:
            skipped.append(f"{cell['task']['name']} {cells.series(cell['policy'])} "
                           f"τ={cell['policy'].get('threshold')}")
        else:
            rows.extend(got)
    return rows, skipped


@functools.lru_cache(maxsize=1)
def default_cost() -> Cost:
    return Cost.read()


def serving_fields(cell: dict[str, Any]) -> dict[str, Any]:
    """A table row's projected throughput over full depth at the cell's own batch size, under static and
    continuous batching with the packaged cost model (`exitbench serve-sim` for others); None without a
    recorded exit schedule."""
    rows = project(cell, [int(cell["key"].get("batch_size") or 1)], default_cost()) if requests_of(cell) else None
    return {"serving_static": rows and rows[0]["throughput_static"],
            "serving_continuous": rows and rows[0]["throughput_continuous"]}
