"""What an exit rule buys a server: decode throughput projected from a cell's recorded exit schedule.

A cell records, per request, each token's iterations (`iterations.schedule`; or its samples file's exit steps).
This module replays those schedules through a discrete-event model of a batched decode server with `batch` rows,
under three schedulers:

- `full`: every token runs the model's full depth (the baseline; what the cell's requests cost without exits);
- `static`: a batch step advances every row by one token and lasts as long as its slowest row's token; a row
  whose token exited early leaves the loop steps that remain and waits for the batch step's end (the engine's
  `--refill wave`);
- `continuous` (continuous depth batching): each row moves to its next token as soon as its token exits, and
  a loop step runs only the rows that have a token in flight.

In all three a finished request frees its row for the next request at once (request-level continuous batching),
so the schedulers differ only in what they do with a token's early exit, and at full depth all three are equal.

A loop step costs `fixed_s + row_s × rows in it` (a step's launch and host work, and each row's arithmetic), a
token `token_s` once (its readout, sampling, joining and leaving the loop), each step at which tokens exit
`leave_s` (their states are taken out and the rows left are compacted), each time new tokens join the rows in
flight `regroup_s` (their entry, and where each token reads its keys worked out again: continuous batching at
every exit, static once per batch step, full depth once per token), admitting a request `prefill_s`, and, for
a rule that decodes (kl, entropy, confidence...), each row's readout of the next-token distribution at every
step `readout_s`, and each step whose rows sit at different iterations of their tokens `mixed_s` (each row's
cache slot is looked up on its own, where rows at one iteration share one: only continuous batching has such
steps): the `CostModel`, fitted from the engine's own timings by bench/serve_sim_cost.py. Throughput is relative
to `full` on the same requests, so a cell's figures do not depend on how many requests it had; the ideal is the
iteration ratio (full depth ÷ mean iterations), what a step whose cost were all per row would give.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ExitbenchError
from ..store import cells as cellmod
from ..store.disk import samples_path
from ..store.schema import schedule_requests

SCHEDULERS = ("full", "static", "continuous")
DEFAULT_COST = Path(__file__).with_name("serve_sim_cost.json")
COST_SCHEMA = "exitbench.serving-cost"
COST_FIELDS = ("fixed_s", "row_s", "token_s", "leave_s", "regroup_s", "prefill_s", "readout_s", "mixed_s")


@dataclass(frozen=True)
class CostModel:
    """Seconds per loop step (`fixed_s`), per row in a step (`row_s`), per token (`token_s`), per step at which
    tokens exit (`leave_s`), per entry of new tokens among those in flight (`regroup_s`), per request admitted
    (`prefill_s`), per row's readout in a step of a rule that decodes (`readout_s`) and per step whose rows sit at
    different iterations (`mixed_s`)."""

    fixed_s: float
    row_s: float
    token_s: float
    leave_s: float
    regroup_s: float
    prefill_s: float
    readout_s: float
    mixed_s: float
    source: str = "given"  # where the figures come from: what the output states

    @property
    def steps_free(self) -> bool:
        """A loop step costs nothing: what no machine does, so a model that says it (a fit of noise) projects
        nothing and is neither read nor written."""
        return self.fixed_s + self.row_s == 0

    def seconds(self, counts: "Counts") -> float:
        return (self.fixed_s * counts.steps + self.row_s * counts.row_steps + self.token_s * counts.tokens
                + self.leave_s * counts.leaves + self.regroup_s * counts.regroups + self.prefill_s * counts.requests
                + self.readout_s * counts.readouts + self.mixed_s * counts.mixed)

    def describe(self) -> str:
        return (f"cost model {self.source}: a loop step {1e6 * self.fixed_s:.1f} µs + {1e6 * self.row_s:.2f} µs "
                f"per row, {1e6 * self.token_s:.0f} µs per token, {1e6 * self.leave_s:.0f} µs per step at which "
                f"tokens exit, {1e6 * self.regroup_s:.0f} µs each time new tokens join those in flight, "
                f"{1e6 * self.prefill_s:.0f} µs per request admitted, {1e6 * self.readout_s:.1f} µs per row's "
                f"readout in a step of a rule that decodes, {1e6 * self.mixed_s:.0f} µs per step whose rows sit at "
                f"different iterations")


# No part of one loop step costs a minute on any machine; figures near float's range would also overflow a run's
# sum of them to inf, and every projection to nan.
MAX_COST_S = 60.0


def load_cost(path: Path | str | None = None) -> CostModel:
    """The cost model in `path` (default: the one fitted on the project's CPU machine, shipped with exitbench),
    or ExitbenchError in one line naming the file and what is wrong with it."""
    path = Path(path) if path is not None else DEFAULT_COST
    if path.is_dir():  # an empty --cost '' reaches here as "."
        shown = "'' (read as the current folder)" if str(path) == "." else str(path)
        raise ExitbenchError(f"--cost {shown} is a folder; name a cost file, written by "
                             "`python bench/serve_sim_cost.py --out FILE`, or leave --cost out for the shipped one")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExitbenchError(f"--cost {path} is not a readable cost file ({exc}); write one with "
                             "`python bench/serve_sim_cost.py --out FILE`") from None
    if not isinstance(data, dict) or data.get("schema") != COST_SCHEMA:
        raise ExitbenchError(f"--cost {path} is not a serving cost file (schema {COST_SCHEMA!r} expected); write "
                             "one with `python bench/serve_sim_cost.py --out FILE`")
    figures = {}
    for name in COST_FIELDS:
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or value > MAX_COST_S:
            raise ExitbenchError(f"--cost {path}: {name} must be a number of seconds from 0 to {MAX_COST_S:g}, "
                                 f"got {value!r}")
        figures[name] = float(value)
    where = "default" if path == DEFAULT_COST else str(path)
    cost = CostModel(**figures, source=f"{where} ({data.get('device', '?')}, {data.get('model', '?')}, "
                                       f"{data.get('date', 'undated')})")
    if cost.steps_free:
        raise ExitbenchError(f"--cost {path}: a loop step costs nothing (fixed_s and row_s are 0); nothing to project")
    return cost


def save_cost(path: Path, cost: CostModel, **provenance: Any) -> None:
    from ..runtime.files import atomic_write

    data = {"schema": COST_SCHEMA, **{k: v for k, v in asdict(cost).items() if k != "source"}, **provenance}
    atomic_write(Path(path), lambda f: f.write(json.dumps(data, indent=2) + "\n"))


@dataclass(frozen=True)
class Counts:
    """What a simulated run did: loop steps, rows charged summed over steps, tokens run, steps at which tokens
    exited, entries of new tokens among those in flight, requests admitted, rows' readouts (a rule that decodes
    reads out every row at every step: its row steps; 0 for one that does not), and steps whose rows sit at
    different iterations of their tokens (only continuous batching has them)."""

    steps: int
    row_steps: int
    tokens: int
    leaves: int
    regroups: int
    requests: int
    readouts: int = 0
    mixed: int = 0


def simulate(requests: Sequence[Sequence[int]], batch: int, scheduler: str, depth: int | None = None,
             decodes: bool = False) -> Counts:
    """Replay `requests` (each its tokens' iterations, in order) on `batch` rows under `scheduler`; `depth`, when
    given, runs every token at that depth instead (the full-depth baseline, which reads nothing out); `decodes`:
    the rule reads out every row at every step. Event-driven: between two tokens' exits the rows in flight do not
    change, so the steps in between are counted at once."""
    if batch < 1:
        raise ExitbenchError(f"--batch-size must be ≥ 1, got {batch}")
    if scheduler not in SCHEDULERS:
        raise ExitbenchError(f"unknown scheduler {scheduler!r}; one of {', '.join(SCHEDULERS)}")
    if scheduler == "full" and depth is None:
        raise ValueError("the full-depth scheduler needs the depth")
    lockstep = scheduler == "static"
    queue = iter([[depth if depth is not None else k for k in r] for r in requests])
    steps = row_steps = leaves = regroups = mixed = admitted = 0
    rows: list[list[int]] = []  # each row: its request's remaining tokens' iterations, the current one first
    ran: list[int] = []  # each row's current token: the iterations it has run

    def admit() -> list[int] | None:
        nonlocal admitted
        for request in queue:
            admitted += 1
            if request:  # a request that generated nothing costs its admission only
                return list(request)
        return None

    for _ in range(batch):
        row = admit()
        if row is None:
            break
        rows.append(row)
        ran.append(0)
    while rows:
        regroups += 1  # new tokens joined since the last segment: where each reads is worked out again
        depths = [r[0] for r in rows]
        if lockstep:  # the batch step: rows drop out of its loop steps as their tokens exit, at each distinct depth
            n = max(depths)
            row_steps += sum(depths)
            leaves += len(set(depths))
        else:  # up to the first exit, after which the exited rows take their next tokens
            n = min(depths)
            row_steps += n * len(rows)
            leaves += 1
            if len(set(ran)) > 1:  # (static's and full depth's rows always sit at one iteration)
                mixed += n
        steps += n
        kept, kept_ran = [], []
        for row, k in zip(rows, ran):
            row[0] -= n
            k += n
            if row[0] <= 0:  # the token is done (static: every row's is): the row's next token, or request
                row.pop(0)
                row, k = row or admit(), 0
            if row is not None:
                kept.append(row)
                kept_ran.append(k)
        rows, ran = kept, kept_ran
    return Counts(steps, row_steps, sum(len(r) for r in requests), leaves, regroups, admitted,
                  row_steps if decodes and depth is None else 0, mixed)


def schedule(cell: dict[str, Any], path: Path | None = None) -> list[list[int]] | None:
    """The cell's per-request token iterations: the cell's own record (its grammar, depth and mean checked with
    the cell, store/schema.py), else its samples file's exit steps (each token's steps summed over loop groups),
    else None. ValueError saying why when the samples file cannot give them."""
    recorded = cell["iterations"].get("schedule")
    if recorded is not None:
        return schedule_requests(recorded)
    if path is None or not cell.get("samples") or not samples_path(path).exists():
        return None
    out = []
    text = samples_path(path).read_text(errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
            steps = sample.get("exitbench", {}).get("exit_steps") if isinstance(sample, dict) else None
            if steps is None:
                return None
            tokens = [sum(s) for s in steps]
            if not all(type(k) is int and k >= 1 for k in tokens):
                raise TypeError
        except (json.JSONDecodeError, TypeError, AttributeError):
            raise ValueError(f"its samples file's line {number} has no exit steps as whole numbers ≥ 1") from None
        out.append(tokens)
    return out


def full_depth(cell: dict[str, Any]) -> int:
    """A token's iterations at the cell's deepest: max steps times the loop groups (a fixed depth's max steps
    are its own r, so the model's full depth is the largest over a task's cells: `project_cells`)."""
    return int(cell["policy"]["max_steps"]) * max(1, len(cell["iterations"].get("per_group_mean") or [1]))


@dataclass
class Projection:
    """One cell at one batch size: throughput under each scheduler relative to full depth."""

    task: str
    policy: str
    threshold: float | None
    mean_iterations: float
    batch_size: int
    throughput: dict[str, float]
    ideal: float
    quality: float | None = None
    ms_per_token: float | None = None  # the cell's measured wall-clock, for the tables that put them side by side

    @property
    def share(self) -> float:
        """The achieved share of the ideal speed-up under continuous depth batching."""
        return self.throughput["continuous"] / self.ideal

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "share_of_ideal": self.share}


def project(requests: Sequence[Sequence[int]], depth: int, batch: int, cost: CostModel, decodes: bool = False
            ) -> tuple[dict[str, float], float]:
    """Each scheduler's throughput relative to full depth, and the ideal (the iteration ratio); `decodes`: the
    rule reads out the next-token distribution at every step."""
    base = cost.seconds(simulate(requests, batch, "full", depth))
    throughput = {s: base / cost.seconds(simulate(requests, batch, s, None if s != "full" else depth, decodes))
                  for s in SCHEDULERS}
    tokens = [k for r in requests for k in r]
    ideal = depth * len(tokens) / sum(tokens) if tokens and sum(tokens) else 1.0
    return throughput, ideal


def project_cells(found: Iterable[tuple[Path, dict[str, Any]]], batches: Sequence[int], cost: CostModel
                  ) -> tuple[list[Projection], list[str]]:
    """A projection per cell with a recorded schedule and per batch size, and a note per cell skipped."""
    for b in batches:
        if b < 1:
            raise ExitbenchError(f"--batch-size must be ≥ 1, got {b}")
    found = list(found)
    depths: dict[str, int] = {}
    for _, cell in found:
        if cell["policy"]["max_steps"] is not None:
            depths[cell["task"]["name"]] = max(depths.get(cell["task"]["name"], 0), full_depth(cell))
    rows, skipped = [], []
    for path, cell in found:
        label = f"{cell['task']['name']} {cellmod.series(cell['policy'])} τ={cell['policy']['threshold']}"
        try:
            requests = schedule(cell, path)
        except ValueError as exc:
            skipped.append(f"{label}: {exc}; rerun it into a new --out to project it")
            continue
        if requests is None:
            why = "a replay cell" if cellmod.mode(cell) == "replay" else "written before schedules were recorded"
            skipped.append(f"{label}: no per-token exits recorded ({why}); rerun it into a new --out to project it")
            continue
        if not any(requests) or cell["task"]["name"] not in depths:
            skipped.append(f"{label}: " + ("no tokens scored" if not any(requests) else "no max_steps recorded")
                           + "; nothing to project")
            continue
        depth = depths[cell["task"]["name"]]
        for b in batches:
            throughput, ideal = project(requests, depth, b, cost, bool(cell["policy"].get("needs_logits")))
            per_token = cell["wall_clock"].get("per_token_s")
            rows.append(Projection(cell["task"]["name"], cellmod.series(cell["policy"]), cell["policy"]["threshold"],
                                   cell["iterations"]["mean"], b, throughput, ideal, cell["quality"]["value"],
                                   None if per_token is None else 1e3 * per_token))
    rows.sort(key=lambda p: (p.task, p.batch_size, p.policy != "fixed", p.policy,
                             -math.inf if p.threshold is None else p.threshold))
    return rows, skipped


def skip_lines(skipped: Sequence[str], named: int = 3) -> list[str]:
    """`project_cells`' notes ("LABEL: reason") as lines, one per reason: a folder of cells written before
    schedules says so once, naming a few of them, not once per cell."""
    by_reason: dict[str, list[str]] = {}
    for note in skipped:
        label, _, reason = note.partition(": ")
        by_reason.setdefault(reason, []).append(label)
    lines = []
    for reason, labels in by_reason.items():
        if len(labels) == 1:
            lines.append(f"skipped {labels[0]}: {reason}")
        else:
            shown = ", ".join(labels[:named]) + (", …" if len(labels) > named else "")
            lines.append(f"skipped {len(labels)} cells ({shown}): {reason}")
    return lines


def parse_batches(text: str) -> list[int]:
    """`1,16,64` → [1, 16, 64], or one line naming the bad entry."""
    out = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ExitbenchError(f"--batch-size takes whole numbers ≥ 1 separated by commas (e.g. 1,16,64), "
                                 f"got {part.strip()!r}") from None
        if value < 1:
            raise ExitbenchError(f"--batch-size must be ≥ 1, got {value}")
        out.append(value)
    return out


def as_json(rows: Sequence[Projection]) -> str:
    return json.dumps([p.row() for p in rows], indent=2)


def table(rows: Sequence[Projection], cost: CostModel):
    """The rich table `serve-sim` prints: one row per cell and batch size."""
    from rich.table import Table

    t = Table(title="decode throughput relative to full depth, projected from each cell's exit schedule",
              caption=f"static: a batch step waits for its slowest row; continuous: a row that exits moves to its "
                      f"next token at once; ideal: full depth ÷ mean iterations; share: continuous ÷ ideal. "
                      f"{cost.describe()}", caption_justify="left")
    for name, justify in (("task", "left"), ("policy", "left"), ("τ", "right"), ("mean iters", "right"),
                          ("batch", "right"), ("full", "right"), ("static", "right"), ("continuous", "right"),
                          ("ideal", "right"), ("share", "right")):
        t.add_column(name, justify=justify)
    for p in rows:
        tau = "" if p.threshold is None else (f"r = {p.threshold:g}" if p.policy == "fixed" else f"{p.threshold:g}")
        t.add_row(p.task, p.policy, tau, f"{p.mean_iterations:.2f}", str(p.batch_size),
                  *(f"{p.throughput[s]:.2f}×" for s in SCHEDULERS), f"{p.ideal:.2f}×", f"{p.share:.0%}")
    return t


REPORT_BATCHES = (1, 16, 64)


def wide(rows: Sequence[Projection]) -> tuple[list[str], list[list[Any]]]:
    """One row per cell: quality, mean iterations and measured ms/token beside the projected throughput at each
    batch size under static and under continuous depth batching (one column at batch 1, where they are the same),
    and the ideal (what `pareto --cost serving` and the report show). Both, because which one wins is the cost
    model's: on the shipped CPU one static batching does, where a step costs the same at any mix of iterations
    continuous batching would (docs/serving-sim.md)."""
    batches = sorted({p.batch_size for p in rows})
    columns = [(b, s) for b in batches for s in (("static",) if b == 1 else ("static", "continuous"))]
    by_cell: dict[tuple, dict[int, Projection]] = {}
    for p in rows:
        by_cell.setdefault((p.task, p.policy, p.threshold), {})[p.batch_size] = p
    headers = ["task", "policy", "τ", "quality", "mean iters", "ms/token",
               *(f"batch {b}" if b == 1 else f"{s} {b}" for b, s in columns), "ideal"]
    body = []
    for (task, policy, threshold), at in by_cell.items():
        first = next(iter(at.values()))
        body.append([task, policy, threshold, first.quality, first.mean_iterations, first.ms_per_token,
                     *(at[b].throughput[s] if b in at else None for b, s in columns), first.ideal])
    return headers, body


def projected_table(cell_list: Sequence[dict[str, Any]]):
    """`wide` as a rich table, at the report's batch sizes under the default cost model."""
    from rich.table import Table

    cost = load_cost()
    rows, skipped = project_cells([(None, c) for c in cell_list], REPORT_BATCHES, cost)
    if not rows:
        return f"no cell has per-token exits recorded ({len(skipped)} written before schedules): no serving projection"
    headers, body = wide(rows)
    t = Table(title="projected decode throughput relative to full depth, under static and continuous depth batching",
              caption=f"{cost.describe()}; `exitbench serve-sim` gives the share of the ideal",
              caption_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i < 2 else "right")
    for row in body:
        t.add_row(*("" if v is None else f"{v:.2f}×" if i >= 6 else f"{v:.4g}" if isinstance(v, float) else str(v)
                    for i, v in enumerate(row)))
    return t
