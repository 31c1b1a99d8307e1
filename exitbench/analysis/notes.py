"""What the readers of result cells say beside their tables, as data: notes (how to read the numbers) and
warnings (numbers not to be trusted as they are), on a set of cells and their frontiers (`frontier.report`).

Every such text is written here, once. A reader picks the topics it prints: `pareto` PARETO (and PUBLISHED after
its published table), the report page REPORT, `run` and `check --wall-clock` TIMING (`timing_notes`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from ..store import cells
from ..store.loading import model_label
from .frontier import collapse_tolerances, groups, references, report, split_setups
from .labels import config_label
from ..timing.speedup import CLOCKS, on_clock, record
from ..timing.trust import MAX_REPEATS, MAX_SAMPLE_OFF, UNRELIABLE_SPREAD, busy, threads_advice, wide_spread

# How far a speed-up from two evaluations may stray from its paired repeats' before the two say different things:
# the repeats time both sides within seconds of each other on documents drawn across the task, the evaluations
# minutes apart, and on an idle machine the two agree within DRIFT on every embedded model's cells
# (bench/RESULTS.md).
DRIFT = 2.0


@dataclass(frozen=True)
class Note:
    level: str  # "note" or "warning"
    text: str

    def __str__(self) -> str:
        return f"{self.level}: {self.text}"


def notes(cell_list: list[dict[str, Any]], rep: dict[str, Any] | None = None,
          topics: tuple[str, ...] | None = None) -> list[Note]:
    """The notes and warnings these cells call for on `topics` (names of TOPICS, in the order given; default
    every topic `pareto` prints). `rep`: their frontiers, computed here when a topic needs them and none are
    given."""
    topics = PARETO + PUBLISHED if topics is None else topics
    if rep is None and set(topics) & ON_FRONTIERS:
        rep = report(cell_list)
    found = []
    for topic in topics:
        level, write = TOPICS[topic]
        text = write(cell_list, rep)
        if text:
            found.append(Note(level, text))
    return found


def timing_notes(cell_list: list[dict[str, Any]]) -> list[Note]:
    """Every note and warning on how far the cells' wall-clock can be trusted (the machine's load, the repeats'
    spread and sample, tasks too small to retime)."""
    return notes(cell_list, topics=TIMING)


# ---- one text per topic (None: nothing to say) ----------------------------------------------------------------
def mode_note(cell_list: list[dict[str, Any]]) -> str | None:
    """Cells measured by replay rather than exact runs say so; a cell without a mode is exact."""
    counts = Counter(cells.mode(c) for c in cell_list)
    if set(counts) <= {"exact"}:
        return None
    return ("measurement mode: " + ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))
            + " cells (replay cells are estimated from recorded trajectories; the cell table's mode column says "
              "which is which)")


def split_note(keys) -> str | None:
    """A line saying which task/metric pairs were split into setups, and by what."""
    split = split_setups(keys)
    if not split:
        return None
    fields = sorted({name for names in split.values() for name in names})
    return (f"cells of {', '.join(f'{t} · {m}' for t, m in sorted(split))} were measured under different setups "
            f"({', '.join(fields)}) and are kept in separate frontiers; write each experiment to its own --out "
            "to keep them apart")


def replay_points(rep: dict[str, Any]) -> dict[str, int]:
    """Per group, how many of its frontier points (any cost axis) and matched-quality rows are replay cells."""
    out = {}
    for group, entry in rep.items():
        n = sum(p["mode"] == "replay" for pts in entry["frontiers"].values() for p in pts)
        n += sum(r["mode"] == "replay" for r in entry["matched_quality"])
        if n:
            out[group] = n
    return out


def replay_note(rep: dict[str, Any]) -> str | None:
    """A line naming the groups whose frontiers rest on replay cells, and how to rerun them exactly."""
    replayed = replay_points(rep)
    if not replayed:
        return None
    return (f"frontiers of {', '.join(replayed)} rest on replay cells (marked ᴿ; wall-clock there is estimated); "
            "`exitbench run --replay --verify` reruns them exactly")


def nonfinite(cell_list: list[dict[str, Any]]) -> list[str]:
    """The cells (by file name) some of whose tokens went NaN or infinite: their numbers rest on broken
    arithmetic, however they were made or reused."""
    return [cells.filename(c) for c in cell_list if (c.get("numerics") or {}).get("nonfinite_tokens")]


def nonfinite_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A warning line when some cells' tokens went NaN or infinite (`nonfinite`)."""
    broken = nonfinite(cell_list)
    if not broken:
        return None
    return (f"{len(broken)} cells had tokens whose states or logits went NaN or infinite "
            f"(numerics.nonfinite_tokens), e.g. {broken[0]}: their numbers are not to be trusted")


def lossy_speculation(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speculation cells whose quality is not their full-depth cell's: speculation emits full depth's greedy
    tokens by construction, so such a cell is a fault (or float rounding that flipped a near tie), never a trade."""
    full = references(cell_list)
    return [c for c in cell_list if c["policy"].get("draft_tokens") and c["cell_id"] in full
            and c["quality"]["value"] != full[c["cell_id"]]["quality"]["value"]]


def lossless_note(cell_list: list[dict[str, Any]]) -> str | None:
    lossy = lossy_speculation(cell_list)
    if not lossy:
        return None
    return (f"{len(lossy)} speculation cells' quality differs from full depth's, e.g. {cells.filename(lossy[0])}: "
            "depth speculation emits full depth's greedy tokens by construction, so their generations differ where "
            "they should not; report it with the cell")


def busy_cells(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells timed while other work competed for the cores (their run's recorded load)."""
    return [c for c in cell_list if busy(c.get("run", {}).get("load"))]


def busy_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A warning line when some cells were timed on a busy machine (None when none were)."""
    hot = busy_cells(cell_list)
    if not hot:
        return None
    used = {c.get("run", {}).get("machine", {}).get("cpu_threads") for c in hot}
    peak = lambda c: max(c["run"]["load"]["start"] or 0, c["run"]["load"]["end"] or 0)  # noqa: E731
    worst = max(hot, key=peak)
    return (f"{len(hot)} of {len(cell_list)} cells were timed on a busy machine (load up to "
            f"{peak(worst):g} on {worst['run']['load']['cpus']} cores, e.g. "
            f"{worst['task']['name']} {config_label(worst['policy']['policy'], worst['policy']['threshold'])}): their "
            f"wall-clock and speed-ups are unreliable; {threads_advice(1 if used == {1} else None)}")


def spread_note(cell_list: list[dict[str, Any]], clock: str = "throughput") -> str | None:
    """A warning line when some cells' repeated timings on `clock` spread too far for their ratio to be read."""
    seen = [on_clock(c, clock) for c in cell_list]
    wide = [c for c in seen if wide_spread(c)]
    if not wide:
        return None
    worst = max(wide, key=lambda c: c["wall_clock"]["repeats"]["spread"])
    on = "" if clock == "throughput" else " on the latency clock (bs1)"
    return (f"{len(wide)} of {len(cell_list)} cells' repeated timings{on} spread more than "
            f"{100 * UNRELIABLE_SPREAD:.0f}% around their ratio to full depth (up to "
            f"{100 * worst['wall_clock']['repeats']['spread']:.0f}%, {worst['task']['name']} "
            f"{config_label(worst['policy']['policy'], worst['policy']['threshold'])}): their speed-ups are unreliable "
            f"(shown as ?, their repeats' range beside it, and off the wall-clock frontier); rerun them "
            f"{spread_advice(wide)}")


def spread_advice(cell_list: list[dict[str, Any]]) -> str:
    """Where to rerun cells whose repeats spread: an idle machine, and what the cells did not already use, one
    thread and more repeats (never advice a run took: --threads 1 to a one-thread run, more repeats past the most)."""
    ways = []
    if any(((c.get("run") or {}).get("machine") or {}).get("cpu_threads") != 1 for c in cell_list):
        ways.append("--threads 1")
    if any((c["wall_clock"].get("repeats") or {}).get("repeats", 0) < MAX_REPEATS for c in cell_list):
        ways.append("more --timing-repeats")
    return "on an idle machine" + (f", with {' or '.join(ways)}" if ways else "")


def drift_note(rep: dict[str, Any], cell_list: list[dict[str, Any]] | None = None) -> str | None:
    """A warning line where a matched-quality speed-up's two timings, the cells' evaluations divided and the
    cell's paired repeats, disagree by more than DRIFT, naming why (`timing_cause`, from the cells where given)."""
    by_id = {c["cell_id"]: c for c in cell_list or []}
    off = [(entry.get("title", group), r) for group, entry in rep.items()
           for r in collapse_tolerances(entry["matched_quality"])
           if r["evaluation_speedup"] and r.get("paired_speedup")
           and max(r["evaluation_speedup"] / r["paired_speedup"], r["paired_speedup"] / r["evaluation_speedup"]) > DRIFT]
    if not off:
        return None
    group, r = off[0]
    cause = timing_cause(by_id.get(r.get("cell_id")))
    return (f"{len(off)} speed-ups disagree with their cells' paired repeats by more than {DRIFT:g}× (e.g. "
            f"{group} {config_label(r['policy'], r['threshold'])}: {r['evaluation_speedup']:.2f}× from the evaluations, "
            f"{r['paired_speedup']:.2f}× repeated beside full depth): {cause}")


def timing_cause(cell: dict[str, Any] | None) -> str:
    """Why a cell's evaluation and its paired repeats may time it differently, the likeliest cause first: a
    sample that stands for part of the task, a busy machine, repeats spread wide, else the machine's speed
    between the two evaluations."""
    rep = ((cell or {}).get("wall_clock") or {}).get("repeats") or {}
    if rep and "documents" not in rep:
        return ("the repeats timed the task's first requests only (a cell written before exitbench drew them "
                "across the task), an unrepresentative sample; rerun the cell into a fresh --out")
    if rep.get("representative") is False:
        return ("the timed documents' FLOP ratio strays from the task's (a small task); the speed-up shown is "
                "carried to the whole task by the FLOP ratios")
    if cell is not None and busy(cell.get("run", {}).get("load")):
        return "the cell was timed on a busy machine; rerun it on an idle one"
    if cell is not None and wide_spread(cell):
        return f"the repeats spread widely; rerun it {spread_advice([cell])}"
    return ("the machine's speed changed between the two evaluations, minutes apart; the repeats, timed side by "
            "side, are the number shown")


def sample_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A warning line for cells retimed on their task's first requests (written before the draw across it)."""
    old = [c for c in cell_list if (rep := c["wall_clock"].get("repeats")) and "documents" not in rep]
    if not old:
        return None
    return (f"{len(old)} of {len(cell_list)} cells were retimed on their task's first requests only (written before "
            "exitbench drew timed documents across the task): on a task ordered by difficulty that is its easy "
            "end, so their speed-ups (marked ᶠ) may not stand for the task; rerun them into a fresh --out")


def corrected_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A note for cells whose timed documents' FLOP ratio strayed from the task's, their speed-up corrected."""
    off = [c for c in cell_list if ((c["wall_clock"].get("repeats") or {}).get("representative")) is False]
    if not off:
        return None
    return (f"{len(off)} cells' timed documents have a FLOP ratio to full depth more than {100 * MAX_SAMPLE_OFF:g}% "
            "from their whole task's (tasks of few documents, whose strata are coarse): their speed-ups are carried "
            "to the whole task at the same overhead (marked ᶜ)")


def noise_note(cell_list: list[dict[str, Any]]) -> str | None:
    """What full depth timed beside itself says: its paired ratios' span on each clock is the clock's noise on this
    machine (issue 72: its overhead, 1 by definition, once read 0.95× quiet and 56× under load)."""
    spans = []
    for clock in CLOCKS:
        ratios = [r for c in cell_list if c["policy"]["policy"] == "fixed"
                  and (rep := record(c, clock)) and rep.get("full_depth") == c["policy"]["threshold"]
                  for r in rep.get("ratios", [])]
        if ratios:
            spans.append(f"{min(ratios):.2f}–{max(ratios):.2f} on the {clock} clock")
    if not spans:
        return None
    return (f"full depth timed beside itself: its paired ratios span {' and '.join(spans)}, the clocks' noise on "
            "this machine; its speed-up and overhead are 1 by definition, and a cell's within that span of 1 is no "
            "difference")


def untimed_note(cell_list: list[dict[str, Any]]) -> str | None:
    """A line for tasks too small to retime: which, and that their cells carry no speed-up."""
    said = sorted({c["wall_clock"]["untimed"] for c in cell_list if c["wall_clock"].get("untimed")})
    return "; ".join(said) or None


def bound_note(rep: dict[str, Any]) -> str | None:
    """A warning line for speed-ups above their iteration bound on the frontiers and matched tables: no results."""
    flagged = {(entry.get("title", group), r["policy"], r["threshold"], clock): r[field]
               for group, entry in rep.items()
               for r in [*entry["matched_quality"], *entry["frontiers"].get("wall_clock", [])]
               for field, clock in (("speedup_flag", ""), ("speedup_latency_flag", " (bs1)")) if r.get(field)}
    if not flagged:
        return None
    (group, policy, threshold, clock), flag = next(iter(flagged.items()))
    return (f"{len(flagged)} speed-ups are above their cells' iteration bounds and are no results (‼), e.g. {group} "
            f"{config_label(policy, threshold)}{clock}: {flag}")


def mixed_note(rep: dict[str, Any]) -> str | None:
    """A warning line naming the groups whose matched-quality speed-ups divide two cells' own timings from
    different runs. A paired speed-up is exempt: its repeats timed full depth beside the cell, in the cell's run,
    so a directory that gathers several runs' cells (the quickstart adds rules to its first sweep's) is fine."""
    mixed = [entry.get("title", group) for group, entry in rep.items()
             if any(not r["same_run"] and r.get("speedup_basis") == "evaluations" for r in entry["matched_quality"])]
    if not mixed:
        return None
    return (f"speed-ups in {', '.join(mixed)} divide timings measured by different runs, without repeats beside "
            "full depth (a rerun reused older cells); rerun into a fresh --out to compare wall-clock")


def published_model_note(cell_list: list[dict[str, Any]]) -> str | None:
    """Where a preset's published numbers are for another model than the cells': what the rows show."""
    from ..presets import published_rows

    others = sorted({r["published_for"] for r in published_rows(cell_list) if not r["same_model"]})
    if not others:
        return None
    return (f"the published numbers are for {', '.join(others)}; these cells ran {model_label(cell_list[0])}, so "
            "the rows show the protocol's plumbing, not a reproduction")


def published_limit_note(cell_list: list[dict[str, Any]]) -> str | None:
    """Where measured numbers beside published ones cover fewer documents than the paper's."""
    from ..presets import published_rows

    if not any(r["limit"] is not None for r in published_rows(cell_list)):
        return None
    return "some measured numbers use --limit; the published ones use every document"


# ---- the topics -----------------------------------------------------------------------------------------------
Writer = Callable[[list[dict[str, Any]], dict[str, Any] | None], str | None]
# Each topic's level and text, from the cells and their frontiers.
TOPICS: dict[str, tuple[str, Writer]] = {
    "mode": ("note", lambda cell_list, rep: mode_note(cell_list)),
    "setups": ("note", lambda cell_list, rep: split_note(groups(cell_list))),
    "replay": ("note", lambda cell_list, rep: replay_note(rep)),
    "nonfinite": ("warning", lambda cell_list, rep: nonfinite_note(cell_list)),
    "busy": ("warning", lambda cell_list, rep: busy_note(cell_list)),
    "lossless": ("warning", lambda cell_list, rep: lossless_note(cell_list)),
    "spread": ("warning", lambda cell_list, rep: spread_note(cell_list)),
    "latency spread": ("warning", lambda cell_list, rep: spread_note(cell_list, "latency")),
    "drift": ("warning", lambda cell_list, rep: drift_note(rep, cell_list)),
    "sample": ("warning", lambda cell_list, rep: sample_note(cell_list)),
    "corrected": ("note", lambda cell_list, rep: corrected_note(cell_list)),
    "untimed": ("note", lambda cell_list, rep: untimed_note(cell_list)),
    "noise": ("note", lambda cell_list, rep: noise_note(cell_list)),
    "bound": ("warning", lambda cell_list, rep: bound_note(rep)),
    "mixed": ("warning", lambda cell_list, rep: mixed_note(rep)),
    "published model": ("note", lambda cell_list, rep: published_model_note(cell_list)),
    "published limit": ("note", lambda cell_list, rep: published_limit_note(cell_list)),
}
ON_FRONTIERS = {"replay", "drift", "mixed", "bound"}  # the topics read from the frontiers
# What each reader prints, in its order.
PARETO = ("setups", "replay", "nonfinite", "lossless", "busy", "spread", "latency spread", "sample", "corrected",
          "untimed", "noise", "bound", "drift", "mixed")
PUBLISHED = ("published model", "published limit")  # pareto, under the published numbers' table
REPORT = ("mode", "setups", "lossless", "busy", "spread", "latency spread", "sample", "corrected", "untimed", "noise",
          "bound", "drift")
TIMING = ("busy", "spread", "latency spread", "sample", "corrected", "untimed", "noise")
