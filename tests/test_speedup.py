"""A cell's speed-up as every reader states it (exitbench/timing/speedup.py): its basis, its interval, its
iteration bound, and the flag on one above that bound, in every table, export, figure and the report; and replay
cells' wall-clock labelled an estimate wherever it is shown."""
from __future__ import annotations

import copy
import re

import pytest

from exitbench.analysis import export, frontier, notes, plot, report, tables
from exitbench.timing.speedup import BEFORE_CLOCKS, clock_basis, estimate, text
from exitbench.sweep.run import summary_rows

from helpers.cells import ACC, paired, write_cells


def acc(policy, threshold):
    cell_list = copy.deepcopy(ACC)
    return cell_list, next(c for c in cell_list if c["policy"]["policy"] == policy and c["policy"]["threshold"] == threshold)


def full_of(cell_list):
    return next(c for c in cell_list if c["policy"]["policy"] == "fixed" and c["policy"]["threshold"] == 16)


def test_each_basis_and_its_interval():
    cell_list, kl = acc("kl", 1e-3)  # 6 iterations against 16: bound 2.67
    full = full_of(cell_list)
    plain = estimate(kl, full)  # no repeats: 1.0 ms over 0.8 ms, two evaluations
    assert (plain.value, plain.basis, plain.low, plain.bound) == (pytest.approx(1.25), "evaluations", None,
                                                                  pytest.approx(16 / 6))
    assert text(plain) == "1.25×*"
    paired(kl, [0.45, 0.5, 0.55])
    s = estimate(kl, full)
    assert (s.basis, s.value, s.low, s.high) == ("paired", 2.0, pytest.approx(1 / 0.55), pytest.approx(1 / 0.45))
    assert s.timed == {"documents": 16, "of": 128, "requests": 16, "repeats": 3, "clock": BEFORE_CLOCKS,
                       "measured": None} and not s.flagged
    assert text(s) == "2.00× (1.82–2.22)"
    paired(kl, [0.45, 0.5, 0.55], corrected=0.6)  # the draw's FLOPs strayed: carried to the task
    s = estimate(kl, full)
    assert s.basis == "corrected" and s.value == pytest.approx(1 / 0.6) and s.high == pytest.approx(0.5 / 0.6 / 0.45)
    assert text(s).startswith("1.67×ᶜ (")
    paired(kl, [0.45, 0.5, 0.55], drawn=False)  # written before the draw: the task's first requests
    assert estimate(kl, full).basis == "first requests" and text(estimate(kl, full)).startswith("2.00×ᶠ")
    assert text(estimate(full, full)) == "ref"
    kl["wall_clock"] = {"per_token_s": 0.5e-3, "probe_share": 0.0, "estimated": True}
    assert text(estimate(kl, full)) == "≈2.00×" and estimate(kl, full).basis == "estimated"


@pytest.mark.parametrize("how,reason", [
    ("drawn=False", "first requests only"),
    ("busy", "busy machine"),
    ("noise", "timing noise around a speed-up near the bound"),
    ("spread", "spread over noise alone"),
    ("evaluations", "the machine's speed changed between them"),
])
def test_a_speedup_above_its_iteration_bound_is_flagged_with_why(how, reason):
    """kl τ=1e-3 runs 6 iterations of 16: no timing of it can honestly be faster than 2.67×."""
    cell_list, kl = acc("kl", 1e-3)
    if how == "drawn=False":
        paired(kl, [0.2, 0.25, 0.3], drawn=False)
    elif how == "busy":
        paired(kl, [0.2, 0.25, 0.3])
        kl["run"]["load"] = {"start": 8.0, "end": 8.0, "cpus": 2}
    elif how == "noise":
        paired(kl, [0.35, 0.36, 0.4])  # 2.78×, its repeats down to 2.5×
    elif how == "spread":
        paired(kl, [0.2, 0.25, 0.3])
    else:
        kl["wall_clock"]["per_token_s"] = 0.25e-3
    s = estimate(kl, full_of(cell_list))
    assert s.flagged and s.flag.startswith(f"{s.value:.2f}× is above the iteration bound 2.67×") and reason in s.flag
    assert text(s).endswith(" ‼")


def test_no_table_shows_a_speedup_above_its_bound_without_its_flag(tmp_path):
    """The run table, pareto's matched-quality table and wall-clock frontier, the CSV, the report: each marks
    the flagged speed-up and says why, or leaves it out of the frontier."""
    cell_list, kl = acc("kl", 1e-3)
    paired(kl, [0.2, 0.25, 0.3])  # 4.00×, bound 2.67×
    run_table = tables.summary_table(summary_rows(cell_list), "cells")
    shown = render(run_table)
    assert re.search(r"│ kl +│ +0\.001 │.*4\.00× \(3\.33–5\.00\) ‼", shown), shown
    assert "‼ kl τ=0.001: not a result: 4.00× is above the iteration bound 2.67×" in shown
    rep = frontier.report(cell_list)
    matched = render(*tables.pareto_tables(rep))
    assert re.search(r"│ kl +│ +0\.001 │.*4\.00× \(3\.33–5\.00\) ‼", matched)
    # left out of the wall-clock frontier: no result has no place on it
    assert all(p["speedup_flag"] is None for p in rep["t · acc"]["frontiers"]["wall_clock"])
    assert not any(p["policy"] == "kl" and p["threshold"] == 1e-3 for p in rep["t · acc"]["frontiers"]["wall_clock"])
    assert "speed-ups are above their cells' iteration bounds and are no results" in notes.bound_note(rep)
    paths = write_cells(tmp_path, cell_list)
    rows = export.tidy([tmp_path])
    row = next(r for r in rows if r["policy"] == "kl" and r["threshold"] == 1e-3)
    assert row["speedup"] == pytest.approx(4.0) and row["iteration_bound"] == pytest.approx(16 / 6)
    assert row["speedup_flag"].startswith("4.00× is above the iteration bound")
    page = report.build(tmp_path)
    kl_row = re.search(r"<tr><td>kl</td>(.*?)</tr>", page[page.index('id="matched"'):]).group(1)
    assert "4.00× ‼" in re.findall(r"<td[^>]*>([^<]*)</td>", kl_row)  # text, never sorted as a number
    assert len(paths) == len(cell_list)


def render(*renderables) -> str:
    from rich.console import Console

    console = Console(width=140, record=True, file=open("/dev/null", "w"))
    console.print(*renderables)
    return console.export_text()


def replayed(cell_list):
    for c in cell_list:
        c["mode"] = "replay"
        c["wall_clock"]["estimated"] = True
        c["replay"] = {"cost_sample": {"requests": 4, "scored_tokens": 16, "depth": 4}}
    return cell_list


def test_replay_time_is_labelled_an_estimate_everywhere(tmp_path):
    """Replay runs no loop: its ms/token is its cost model's. The run table, pareto's wall-clock frontier, the
    export, the figure and the report say so, and name what the cost model was timed on."""
    cell_list = replayed(copy.deepcopy(ACC))
    said = clock_basis(cell_list[0])
    assert said == ("estimated by replay: its exits priced by per-iteration unit costs timed by the exact engine on "
                    "4 requests at 4 iterations, not a timing")
    run_text = render(tables.summary_table(summary_rows(cell_list), "cells"))
    assert re.search(r"│ kl +│ +0\.001 │[^│]*│[^│]*│ +≈0\.800 │ +≈1\.25× ", run_text), run_text
    assert f"≈ ms/token {said}" in " ".join(run_text.split())
    rep = frontier.report(cell_list)
    wall = render(tables.pareto_tables(rep, "frontier")[-1])
    assert "≈0.800" in wall and "estimated by replay's cost model" in wall
    write_cells(tmp_path, cell_list)
    rows = export.tidy([tmp_path])
    assert all(r["wall_clock_estimated"] and r["wall_clock_basis"] == said for r in rows)
    assert {r["speedup_basis"] for r in rows if r["policy"] != "fixed"} == {"estimated"}
    fig = plot.draw(cell_list, "wall_clock")
    assert "hollow: replay estimates" in fig.axes[0].get_xlabel()
    hollow = [line for line in fig.axes[0].get_lines() if line.get_markerfacecolor() == "white"]
    assert hollow, "no replay point drawn hollow"
    page = report.build(tmp_path)
    kl_row = re.search(r"<tr><td>kl</td>(.*?)</tr>", page[page.index('id="matched"'):]).group(1)
    assert "≈1.25×" in re.findall(r"<td[^>]*>([^<]*)</td>", kl_row)


def test_a_cell_whose_repeats_are_broken_is_refused_in_one_line(tmp_path):
    """Every reader divides by the repeats' ratio: a hand-edited one that is no number is a broken cell, named
    before any reader touches it, not a traceback."""
    from helpers.cli import assert_one_line_error, runner

    from exitbench.cli import app

    cell_list, kl = acc("kl", 1e-3)
    paired(kl, [0.45, 0.5, 0.55])
    kl["wall_clock"]["repeats"]["ratio"] = "0.5"
    write_cells(tmp_path, cell_list)
    for command in (["pareto", str(tmp_path)], ["export", str(tmp_path)]):
        line = assert_one_line_error(runner.invoke(app, command), ["broken cell", "wall_clock.repeats.ratio"])
        assert "kl" in line
