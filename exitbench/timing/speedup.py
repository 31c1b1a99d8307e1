"""A cell's speed-up over full depth as every reader states it: an estimate with its interval, its basis and the
bound it cannot pass.

Full depth's time per token ÷ the cell's, from the best timing the cell has:
- `paired`: its repeats, timed alternately beside full depth on documents drawn across the task
  (timing/retime.py): their median, and their range as the interval;
- `corrected`: the same, where the timed documents' FLOP ratio strayed from the whole task's (a small task), carried
  to the whole task at the same overhead;
- `first requests`: repeats of a cell written before the draw, which timed the task's first requests only;
- `evaluations`: no repeats, the two cells' own evaluations divided (minutes apart on the machine's clock);
- `estimated`: a replay cell's, priced by the replay cost model (no loop ran);
- `reference`: the full-depth cell itself.

A cell is timed on two clocks (docs/sweeps.md): the throughput clock, `wall_clock.repeats`, its run's batch size
over a stream of documents, the speed-up every table shows first; and the latency clock, `wall_clock.latency`,
one request at a time (batch size 1), paired repeats only. Cells written before the two clocks carry one,
`repeats` without a `clock`: BEFORE_CLOCKS.

The bound is the iteration bound, full depth's mean iterations ÷ the cell's: every iteration a cell runs costs at
least what one of full depth's does (the same core step, plus a probe for a decoding rule), and the prelude and
coda cost both alike, so no cell runs faster than that. A speed-up above it is flagged with the likeliest reason
and never stated as a result. A speculation cell's bound counts its loop steps per token instead of its
iterations (`speculation.steps_per_token`): its verify pass runs k + 1 positions' iterations in one step, which
is how it can beat its own iteration count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .trust import flag, warnings

BASES = ("paired", "corrected", "first requests", "evaluations", "estimated", "reference")
REPEATED = ("paired", "corrected", "first requests", "reference")  # the bases a clock's repeats give
CLOCKS = ("throughput", "latency")
# The one clock of cells written before the two: a batch of documents at the run's batch size, the scored tokens'
# loop phases only.
BEFORE_CLOCKS = "batch (before two clocks)"


@dataclass(frozen=True)
class SpeedUp:
    value: float | None                 # full depth's time per token ÷ the cell's
    basis: str | None = None            # one of BASES
    low: float | None = None            # the repeats' range, as speed-ups (paired bases only)
    high: float | None = None
    bound: float | None = None          # full depth's mean iterations ÷ the cell's
    flag: str | None = None             # why `value` is no result (above the bound), else None
    # documents timed, of how many, repeats, the clock and how it measured (paired bases only)
    timed: dict[str, Any] | None = None

    @property
    def flagged(self) -> bool:
        return self.flag is not None

    def to_dict(self, name: str = "speedup") -> dict[str, Any]:
        """As a table row's plain fields (JSON, CSV, the report): the throughput clock's under `speedup`, with
        the bound and what was timed; another clock's under `name` (`speedup_latency`), beside them."""
        timed = self.timed or {}
        fields = {name: self.value, f"{name}_low": self.low, f"{name}_high": self.high, f"{name}_basis": self.basis}
        if name != "speedup":
            return {**fields, f"{name}_flag": self.flag, f"{name}_documents": timed.get("documents")}
        return {**fields, "iteration_bound": self.bound, "speedup_flag": self.flag,
                "timed_documents": timed.get("documents"), "of_documents": timed.get("of"),
                "timing_repeats": timed.get("repeats"), "clock": timed.get("clock"),
                "clock_measured": timed.get("measured")}

    @classmethod
    def from_row(cls, row: dict[str, Any], name: str = "speedup") -> "SpeedUp":
        """The estimate back from a row's fields (`to_dict` under the same `name`)."""
        if name != "speedup":
            timed = {"documents": row.get(f"{name}_documents"), "clock": "latency"}
            return cls(row.get(name), row.get(f"{name}_basis"), row.get(f"{name}_low"), row.get(f"{name}_high"),
                       row.get("iteration_bound"), row.get(f"{name}_flag"), timed if timed["documents"] else None)
        timed = {"documents": row.get("timed_documents"), "of": row.get("of_documents"),
                 "repeats": row.get("timing_repeats"), "clock": row.get("clock"), "measured": row.get("clock_measured")}
        return cls(row.get("speedup"), row.get("speedup_basis"), row.get("speedup_low"), row.get("speedup_high"),
                   row.get("iteration_bound"), row.get("speedup_flag"), timed if timed["documents"] else None)


NONE = SpeedUp(None)


def estimate(cell: dict[str, Any], full: dict[str, Any] | None, clock: str = "throughput") -> SpeedUp:
    """The speed-up of `cell` over its full-depth cell `full` on `clock` (CLOCKS; None where its sweep has none:
    then only its repeats can say). The latency clock has paired repeats or nothing: two evaluations divided
    ran at the run's batch size, not one request at a time."""
    bound = iteration_bound(cell, full, clock)
    rep = record(cell, clock)
    if clock == "latency" and not rep:
        return SpeedUp(None, bound=bound)
    if full is not None and full.get("cell_id") == cell.get("cell_id"):
        return SpeedUp(1.0, "reference", bound=1.0)
    wall = cell.get("wall_clock") or {}
    if rep and rep.get("ratio") and (full is None or rep.get("full_depth") == full["policy"]["threshold"]):
        ratio = rep.get("corrected_ratio") or rep["ratio"]
        scale = ratio / rep["ratio"]
        basis = "corrected" if rep.get("corrected_ratio") else "paired" if "documents" in rep else "first requests"
        ratios = rep.get("ratios") or [rep["ratio"]]
        timed = {"documents": len(rep["documents"]) if "documents" in rep else None,
                 "of": rep.get("of_documents"), "requests": rep.get("requests"), "repeats": rep.get("repeats"),
                 "clock": rep.get("clock") or BEFORE_CLOCKS, "measured": rep.get("measured")}
        value, low, high = 1 / ratio, 1 / (scale * max(ratios)), 1 / (scale * min(ratios))
        return SpeedUp(value, basis, low, high, bound, flag(value, bound, basis, cell, low), timed)
    mine, theirs = wall.get("per_token_s"), ((full or {}).get("wall_clock") or {}).get("per_token_s")
    if clock == "latency" or not (mine and theirs):
        return SpeedUp(None, bound=bound)
    value = theirs / mine
    basis = "estimated" if wall.get("estimated") or (full or {}).get("wall_clock", {}).get("estimated") \
        else "evaluations"
    return SpeedUp(value, basis, bound=bound, flag=flag(value, bound, basis, cell, None))


def record(cell: dict[str, Any], clock: str = "throughput") -> dict[str, Any] | None:
    """The cell's paired repeats on `clock` (CLOCKS): `wall_clock.repeats` for throughput (or, in a cell written
    before the two clocks, its one clock), `wall_clock.latency` for latency; None where it has none."""
    wall = cell.get("wall_clock") or {}
    return wall.get("repeats" if clock == "throughput" else "latency") or None


def on_clock(cell: dict[str, Any], clock: str) -> dict[str, Any]:
    """The cell as retime's readers (`warnings`, `wide_spread`) see its repeats, with `clock`'s repeats (`record`)
    standing as them: those readers know one clock."""
    return {**cell, "wall_clock": {**(cell.get("wall_clock") or {}), "repeats": record(cell, clock)}}


def clock_warnings(cell: dict[str, Any], clock: str = "throughput") -> list[str]:
    """Why a cell's speed-up on `clock` is not to be trusted, one reason each (a busy machine, that clock's
    repeats spread too far: timing/retime.py `warnings`). Empty when neither."""
    return warnings(on_clock(cell, clock))


def unreadable(s: SpeedUp, warnings: list[str] | None) -> bool:
    """Whether `warnings` (`clock_warnings`: a busy machine, repeats spread wide) leave `s` no number to read: the
    tables show `?` in its place. Never full depth's own (the reference) nor one already flagged above its bound."""
    return bool(warnings) and s.value is not None and s.basis != "reference" and not s.flagged


def repeats_clock(cell: dict[str, Any]) -> str | None:
    """Which clock the cell's `wall_clock.repeats` (its `speed-up` and `overhead`) were timed on: "throughput",
    BEFORE_CLOCKS for a cell written before the two clocks, None for a cell without repeats."""
    rep = record(cell)
    return None if rep is None else rep.get("clock") or BEFORE_CLOCKS


def iteration_bound(cell: dict[str, Any], full: dict[str, Any] | None, clock: str = "throughput") -> float | None:
    """Full depth's mean iterations ÷ the cell's (a speculation cell's loop steps per token): its full-depth cell's
    where known, else the depth its repeats on `clock` were paired with, once per loop group."""
    mine = (cell.get("speculation") or {}).get("steps_per_token") or (cell.get("iterations") or {}).get("mean")
    if not mine:
        return None
    if full is not None and (full.get("iterations") or {}).get("mean"):
        return full["iterations"]["mean"] / mine
    rep = record(cell, clock) or {}
    if rep.get("full_depth"):
        groups = len((cell.get("iterations") or {}).get("per_group_mean") or [0])
        return rep["full_depth"] * groups / mine
    return None


def text(s: SpeedUp, interval: bool = True) -> str:
    """The one way every table writes a speed-up: `2.13× (1.98–2.27)` from paired repeats, `2.13×ᶜ` corrected
    by the FLOP ratios, `2.13×*` from two evaluations, `≈2.13×` estimated by replay, `2.13×ᶠ` from a task's
    first requests, `ref` for full depth itself, `‼` after one above its bound; '-' for none."""
    if s.value is None:
        return "-"
    if s.basis == "reference":
        return "ref"
    mark = {"corrected": "ᶜ", "evaluations": "*", "first requests": "ᶠ"}.get(s.basis or "", "")
    shown = ("≈" if s.basis == "estimated" else "") + f"{s.value:.2f}×{mark}"
    if interval and s.low is not None and s.high is not None and s.basis != "reference":
        shown += f" ({s.low:.2f}–{s.high:.2f})"
    return shown + (" ‼" if s.flagged else "")


LEGEND = {"paired": "the median of paired repeats beside full depth (their range in brackets)",
          "corrected": "ᶜ paired repeats whose documents' FLOP ratio strayed over 10% from the task's, carried to "
                       "the task at the same overhead",
          "first requests": "ᶠ paired repeats on the task's first requests only (cells written before the draw "
                            "across the task)",
          "evaluations": "* the two cells' own evaluations divided (no repeats)",
          "estimated": "≈ replay's estimate from its cost model, not a timing",
          "reference": "ref: full depth itself"}


def legend(estimates: list[tuple[str, SpeedUp]], latency: list[tuple[str, SpeedUp]] = (),
           columns: str = "speed-up, overhead") -> str | None:
    """What the speed-ups shown rest on, one clause per basis present, how many repeats timed them and on which
    clocks (`clocks_said`, of the table's `columns`; `latency`, the bs1 columns'); then each flagged one's reason,
    by its label and clock. None when no speed-up is shown."""
    shown = [(label, s) for label, s in estimates if s.value is not None]
    bs1 = [(label, s) for label, s in latency if s.value is not None]
    if not shown + bs1:
        return None
    bases = [b for b in BASES if any(s.basis == b for _, s in shown + bs1)]
    parts = [LEGEND[b] for b in bases]
    timed = {(s.timed["documents"], s.timed["of"], s.timed["repeats"]) for _, s in shown
             if s.timed and s.timed.get("documents")}
    if len(timed) == 1:
        docs, of, repeats = next(iter(timed))
        # (since the two clocks, each clock's documents are said in its own clause below)
        parts.append(f"{repeats} repeats of {docs} of the {of} documents, drawn across the task"
                     if set(_clocks([s for _, s in shown])) <= {BEFORE_CLOCKS} else
                     f"{repeats} repeats on each clock, on documents drawn across the task's {of}")
    lines = ["speed-up: full depth's time per token ÷ the cell's; " + "; ".join(parts)]
    said = clocks_said([s for _, s in shown], [s for _, s in bs1], columns)
    if said:
        lines.append(said)
    lines += [f"‼ {label}: not a result: {s.flag}" for label, s in shown if s.flagged]
    lines += [f"‼ {label} (bs1): not a result: {s.flag}" for label, s in bs1 if s.flagged]
    return "\n".join(lines)


# How each clock's seconds were measured (timing/retime.py MEASURES), the weakest last, as a clause says it.
MEASURED = {"steady state": " in its steady state", "whole pass": ", the whole pass (too short for a steady state)",
            "phases": ", the scored tokens' loop phases"}


def clocks_said(throughput: list[SpeedUp], latency: list[SpeedUp] = (), columns: str = "speed-up, overhead"
                ) -> str | None:
    """What a table's `columns` (its speed-up and overhead) were timed on, and its bs1 columns, in one line:
    `speed-up, overhead: the throughput clock, the run's batch size over a stream of 64 documents in its steady
    state; bs1: the latency clock, one request at a time, on 8 documents`; a cell written before the two clocks
    names its one, BEFORE_CLOCKS. None when no speed-up was timed by repeats."""
    said = []
    for name in _clocks(throughput):
        timed = [s.timed for s in throughput if s.timed and s.timed.get("clock") == name]
        docs = _count(t.get("documents") for t in timed)
        if name == BEFORE_CLOCKS:
            said.append(f"{BEFORE_CLOCKS}, the run's batch size on one batch of {docs} documents, the scored tokens' "
                        "loop phases only")
            continue
        measured = [m for m in MEASURED if any(t.get("measured") == m for t in timed)]
        said.append(f"the {name} clock, the run's batch size over a stream of {docs} documents"
                    + (MEASURED[measured[-1]] if measured else ""))
    line = f"{columns}: " + "; ".join(said) if said else ""
    docs = _count(s.timed.get("documents") for s in latency if s.timed)
    if docs:
        line += ("; " if line else "") + f"bs1: the latency clock, one request at a time, on {docs} documents"
    return line or None


def _clocks(estimates: list[SpeedUp]) -> list[str]:
    """The clocks these speed-ups were timed on, in order of appearance."""
    return list(dict.fromkeys(s.timed["clock"] for s in estimates if s.timed and s.timed.get("clock")))


def _count(numbers) -> str:
    """`64`, or `16–64` where clocks of several sweeps timed different numbers of documents ('' for none)."""
    found = sorted({n for n in numbers if n})
    return "" if not found else f"{found[0]}" if len(found) == 1 else f"{found[0]}–{found[-1]}"


def clock_basis(cell: dict[str, Any]) -> str | None:
    """Where a replay cell's wall-clock comes from, in words (None for a timed cell): no loop ran, so its time is
    the replay cost model's price of its exits."""
    if not (cell.get("wall_clock") or {}).get("estimated"):
        return None
    sample = (cell.get("replay") or {}).get("cost_sample")
    timed = (f" timed by the exact engine on {sample['requests']} requests at {sample['depth']} iterations"
             if sample else "")
    return f"estimated by replay: its exits priced by per-iteration unit costs{timed}, not a timing"
