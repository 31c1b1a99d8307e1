"""Pareto frontiers and the matched-quality table on hand-made cells with known answers, and the notes beside them
(busy or drifting machines, scattered repeats, speed-ups that mix runs)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from exitbench.analysis import frontier, notes, plot
from exitbench.store import cells, loading
from exitbench.store import disk as results
from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import run_cells

from helpers.cells import ACC, PPL, hand_made_cell, paired, write_cells
from helpers.cli import invoke


def one_group(cell_list):
    (points,) = frontier.groups(cell_list).values()
    return points


def by_policy(points):
    return [(p.policy, p.threshold) for p in points]


def test_frontier_higher_is_better():
    pts = one_group(ACC)
    assert by_policy(frontier.frontier(pts, "iterations", True)) == [
        ("fixed", 4), ("oracle", 0.01)]
    # By wall-clock the oracle is slow, so the cheap adaptive points come back.
    assert by_policy(frontier.frontier(pts, "wall_clock", True)) == [
        ("fixed", 4), ("second_order", 1.0), ("second_order", 0.1), ("kl", 1e-3)]


def test_frontier_lower_is_better():
    pts = one_group(PPL)
    assert by_policy(frontier.frontier(pts, "iterations", False)) == [("fixed", 1), ("oracle", 0.01)]
    assert by_policy(frontier.frontier(pts, "wall_clock", False)) == [
        ("fixed", 1), ("first_order", 1.0), ("first_order", 0.1), ("fixed", 16)]


def test_matched_quality_rows_and_speedups():
    rows = frontier.matched_quality(one_group(ACC))
    exact = {r["policy"]: r for r in rows if r["tolerance"] == 0.0}
    assert set(exact) == {"fixed", "kl", "oracle"}
    assert exact["kl"]["threshold"] == 1e-3 and exact["kl"]["mean_iterations"] == 6
    assert exact["kl"]["speedup"] == pytest.approx(1.0 / 0.8)
    assert exact["kl"]["iterations_over_oracle"] == pytest.approx(6 / 4.5)
    half = {r["policy"]: r for r in rows if r["tolerance"] == 0.005}
    assert half["second_order"]["threshold"] == 0.1 and half["second_order"]["speedup"] == pytest.approx(2.0)
    two = {r["policy"]: r for r in rows if r["tolerance"] == 0.02}
    assert "second_order" in two and two["kl"]["threshold"] == 1e-3  # 0.80 is 11% below: never within 2%


def test_matched_quality_lower_is_better():
    rows = frontier.matched_quality(one_group(PPL))
    assert {r["policy"] for r in rows if r["tolerance"] == 0.0} == {"fixed", "oracle"}
    half = {r["policy"]: r for r in rows if r["tolerance"] == 0.005}
    assert half["first_order"]["threshold"] == 0.1 and half["first_order"]["speedup"] == pytest.approx(2.0)
    assert half["first_order"]["iterations_over_oracle"] == pytest.approx(2.0)


def write(tmp_path, cell_list):
    for c in cell_list:
        results.write(tmp_path, c)
    return tmp_path


def test_cli_formats_and_plot(tmp_path):
    d = write(tmp_path / "cells", ACC + PPL)
    res = CliRunner().invoke(app, ["pareto", str(d), "--format", "json"])
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    assert set(rep) == {"t · acc", "u · ppl"} and rep["u · ppl"]["higher_is_better"] is False
    res = CliRunner().invoke(app, ["pareto", str(d), "--format", "md"])
    assert "## Matched quality" in res.stdout and "| group" in res.stdout
    res = CliRunner().invoke(app, ["pareto", str(d), "--format", "csv"])
    header, *rows = res.stdout.split("\n\n")[0].splitlines()
    # (wall-clock rows add their speed-up's fields after these: blank on the other axes)
    assert header.startswith("group,axis,policy,threshold,quality,cost,mode,speedup,")
    # Every cost axis is named in its rows (not overwritten by the cost value), and costs are numbers.
    assert {r.split(",")[1] for r in rows} == {"iterations", "wall_clock", "flops"}
    assert all(float(r.split(",")[5]) > 0 and r.split(",")[6] == "exact" for r in rows)
    fig = plot.plot(ACC + PPL, tmp_path / "p.png")
    axes = fig.axes
    assert len(axes) == 2 and (tmp_path / "p.png").stat().st_size > 0
    assert axes[0].get_xlabel() == "mean iterations per token" and "higher is better" in axes[0].get_ylabel()
    assert "lower is better" in axes[1].get_ylabel()
    labels = {line.get_label() for line in axes[0].get_lines()}
    assert {"fixed depth", "kl", "second_order", "oracle", "frontier"} <= labels


def test_frontier_labels_never_overprint(tmp_path):
    """Twelve frontier points a hair apart in cost and quality: their labels would overprint, so only those
    whose rendered boxes stay clear of the labels before them are kept (at least the first)."""
    crowded = [hand_made_cell("c", "acc", True, "fixed", 16, 0.90, 16, 1.0e-3),
               hand_made_cell("c", "acc", True, "fixed", 1, 0.30, 1, 0.1e-3)]  # stretches both axes
    crowded += [hand_made_cell("c", "acc", True, "second_order", 0.1 * (i + 1), 0.90 - 0.001 * i, 15 - 0.1 * i,
                               1e-3) for i in range(12)]
    fig = plot.draw(crowded)
    texts = fig.axes[0].texts
    assert 1 <= len(texts) < 14
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_refuses_other_files_and_empty_dirs(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ExitbenchError, match="no result cells.*1 JSON file.*not cells"):
        loading.load([tmp_path])
    old = dict(ACC[0], schema_version=0)
    (tmp_path / "x.json").write_text(json.dumps(old))
    res = CliRunner().invoke(app, ["pareto", str(tmp_path)])
    assert res.exit_code == 2 and "schema version" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExitbenchError, match="no result cells"):
        loading.load([empty])


def test_per_policy_frontiers():
    rep = frontier.report(ACC)["t · acc"]
    per = rep["policy_frontiers"]["iterations"]
    assert [(p["threshold"]) for p in per["kl"]] == [1e-2, 1e-3]       # 5 → 0.80, 6 → 0.90: both kept
    assert [(p["threshold"]) for p in per["second_order"]] == [0.1]      # τ=1 costs more for less
    assert [p["policy"] for p in rep["frontiers"]["iterations"]] == ["fixed", "oracle"]


def test_cells_of_different_setups_never_share_a_frontier(tmp_path):
    """A --limit 100 sweep and a batch-size-1 sweep written beside the main one: three frontiers, each named by
    what tells it apart, and a note saying so (the README's commands once mixed them into 30-52× speed-ups)."""
    import copy

    def variant(cell_list, **key):
        out = copy.deepcopy(cell_list)
        for c in out:
            c["key"].update(key)
            c["cell_id"] = cells.cell_id(c["key"])
        return out

    mixed = ACC + variant(ACC, limit=100) + variant(ACC, batch_size=1)
    grouped = frontier.groups(mixed)
    assert len(grouped) == 3 and all(len(pts) == len(ACC) for pts in grouped.values())
    names = sorted(frontier.group_names(grouped).values())
    assert names == ["t · acc · limit 100 · batch none", "t · acc · limit none · batch 1",
                     "t · acc · limit none · batch none"]
    assert "limit" in notes.split_note(grouped) and "batch" in notes.split_note(grouped)
    assert notes.split_note(frontier.groups(ACC)) is None
    assert sorted(frontier.report(mixed)) == names
    # What a check compares ignores how it was timed: batch size alone does not split there.
    assert len(frontier.groups(mixed, frontier.MEASURED)) == 2
    write_cells(tmp_path / "cells", mixed)
    res = CliRunner().invoke(app, ["pareto", str(tmp_path / "cells"), "--format", "md"])
    assert res.exit_code == 0, res.output
    assert "separate frontiers" in res.output and "limit 100" in res.output


def test_cells_timed_on_a_busy_machine_are_flagged(tmp_path):
    import copy

    hot = copy.deepcopy(ACC)
    for c in hot:
        c.setdefault("run", {})["load"] = {"start": 0.3, "end": 0.4, "cpus": 2}
    assert notes.busy_note(hot) is None  # an idle 2-core machine
    hot[2]["run"]["load"] = {"start": 5.0, "end": 7.5, "cpus": 2}
    note = notes.busy_note(hot)
    assert note.startswith("1 of 7 cells") and "load up to 7.5 on 2 cores" in note and "kl" in note
    assert "--threads 1" in note  # threads not recorded: fewer may help
    hot[2]["run"]["machine"] = {"cpu_threads": 1}
    assert "--threads 1" not in notes.busy_note(hot)  # it ran on one already: only an idle machine helps
    hot[2]["run"]["machine"] = {"cpu_threads": 2}
    assert "--threads 1" in notes.busy_note(hot)
    write_cells(tmp_path / "c", hot)
    res = CliRunner().invoke(app, ["pareto", str(tmp_path / "c"), "--format", "md"])
    assert res.exit_code == 0 and "busy machine" in res.output


def test_paired_repeats_give_speedups_their_spread_and_catch_a_drifting_machine(tmp_path):
    import copy

    cell_list = copy.deepcopy(ACC)
    kl = cell_list[2]  # kl τ=1e-3: 0.8 ms/token against full depth's 1.0, a speed-up of 1.25
    paired(kl, [0.76, 0.8, 0.84])
    (row,) = [r for r in frontier.matched_quality(one_group(cell_list), (0.01,)) if r["policy"] == "kl"]
    assert row["speedup"] == pytest.approx(1.25) and row["paired_speedup"] == pytest.approx(1.25)
    assert row["speedup_spread"] == pytest.approx(0.1)
    assert notes.timing_notes(cell_list) == [] and notes.drift_note(frontier.report(cell_list)) is None
    # Repeats paired with another depth than this group's full depth say nothing of its speed-up.
    paired(kl, [0.76, 0.8, 0.84], full_depth=8)
    (row,) = [r for r in frontier.matched_quality(one_group(cell_list), (0.01,)) if r["policy"] == "kl"]
    assert row["paired_speedup"] is None and row["speedup_spread"] is None

    # Repeats that scatter wide: the speed-up is unreliable, and pareto says so.
    paired(kl, [0.5, 0.8, 1.3])
    note = notes.spread_note(cell_list)
    assert note.startswith("1 of 7 cells' repeated timings spread more than 50%") and "up to 100%" in note
    assert "t kl τ=0.001" in note
    # What to do about it names only what the run did not already use (issue 72: a one-thread run at the most
    # repeats was told to use --threads 1 or more --timing-repeats).
    assert note.endswith("rerun them on an idle machine, with --threads 1 or more --timing-repeats"), note
    kl["run"]["machine"] = {"cpu_threads": 1}
    assert note_end(notes.spread_note(cell_list)) == "on an idle machine, with more --timing-repeats"
    kl["wall_clock"]["repeats"]["repeats"] = 20
    assert note_end(notes.spread_note(cell_list)) == "on an idle machine"
    # The two evaluations divided say 1.25×, the repeats beside full depth 0.4×: the machine changed speed
    # between the cells.
    paired(kl, [2.4, 2.5, 2.6])
    drift = notes.drift_note(frontier.report(cell_list), cell_list)
    assert drift.startswith("1 speed-ups disagree") and "1.25× from the evaluations, 0.40× repeated" in drift
    assert "the machine's speed changed between the two evaluations" in drift
    write_cells(tmp_path / "c", cell_list)
    res = CliRunner().invoke(app, ["pareto", str(tmp_path / "c")])
    # The table shows the paired speed-up with its repeats' range (as run does), the warning both numbers.
    assert res.exit_code == 0 and "0.40× (0.38–0.42)" in res.output and "speed-ups disagree" in res.output


def test_a_disagreement_names_its_cause():
    """The warning blames what the cell's record shows first: repeats on the task's first requests only (an
    unrepresentative sample), a busy machine, repeats spread wide; only then the machine's speed between the
    evaluations."""
    import copy

    cell_list = copy.deepcopy(ACC)
    kl = cell_list[2]

    def cause():
        return notes.drift_note(frontier.report(cell_list), cell_list).split("): ", 1)[1]

    paired(kl, [2.4, 2.5, 2.6], drawn=False)
    assert cause().startswith("the repeats timed the task's first requests only") and "unrepresentative" in cause()
    assert notes.sample_note(cell_list).startswith("1 of 7 cells were retimed on their task's first requests")
    paired(kl, [2.4, 2.5, 2.6], corrected=2.0)
    assert cause().startswith("the timed documents' FLOP ratio strays from the task's")
    assert "carried to the whole task at the same overhead (marked ᶜ)" in notes.corrected_note(cell_list)
    paired(kl, [2.4, 2.5, 2.6])
    kl["run"]["load"] = {"start": 9.0, "end": 9.0, "cpus": 2}
    assert cause().startswith("the cell was timed on a busy machine")
    kl["run"]["load"] = {"start": 0.1, "end": 0.1, "cpus": 2}
    paired(kl, [1.0, 2.5, 2.6])
    assert cause().startswith("the repeats spread widely")
    paired(kl, [2.4, 2.5, 2.6])
    assert cause().startswith("the machine's speed changed")


def test_matched_table_warns_when_speedups_mix_runs(tmp_path, capfd, small_sweep):
    ck, tasks, cfg = small_sweep
    out = tmp_path / "out"
    run_cells(ck, tasks, cfg, out, "cpu")
    code, lines, _ = invoke(["pareto", str(out)], capfd)
    assert code == 0 and not any("different runs" in line for line in lines)
    # a later run adds a threshold to the same directory: its speed-up divides by the older run's full depth
    run_cells(ck, tasks, SweepConfig(**{**cfg.__dict__, "thresholds": [1.0]}), out, "cpu")
    code, lines, _ = invoke(["pareto", str(out)], capfd)
    assert code == 0 and any("warning:" in line and "different runs" in line for line in lines), lines


def test_paired_speedups_from_several_runs_are_no_mix():
    """A cell's paired speed-up was timed beside full depth in its own run: one directory gathering several runs'
    cells (the quickstart's second step) divides nothing across runs, so nothing is said; two evaluations of
    different runs divided still are."""
    import copy

    cell_list = copy.deepcopy(ACC)
    for c in cell_list:
        if c["policy"]["policy"] != "fixed":
            c["run"]["run_id"] = "later"
            paired(c, [0.5, 0.55, 0.6])
    assert notes.mixed_note(frontier.report(cell_list)) is None
    kl = next(c for c in cell_list if c["policy"]["policy"] == "kl")
    del kl["wall_clock"]["repeats"]
    assert "divide timings measured by different runs" in notes.mixed_note(frontier.report(cell_list))


def test_figures_read_as_words_and_the_frontier_has_its_own_colour():
    """A series' variant in words (`second_order (relative)`, not `second_order-rel`), a log axis within one
    decade ticked at 1, 2, 5 (a perplexity from 1 to 9 showed only 1 and 10), and a frontier band whose colour
    no policy's curve shares (its light red was kl's)."""
    import copy

    from matplotlib.colors import to_hex

    from exitbench.studies.geometry_plot import HANDOFF_TITLE, LABELS

    cell_list = copy.deepcopy(ACC + PPL)
    for c in cell_list:
        if c["policy"]["policy"] == "first_order":
            c["policy"]["relative"] = True
    fig = plot.draw(cell_list, "iterations")
    acc_ax, ppl_ax = fig.axes
    names = {line.get_label() for line in ppl_ax.get_lines()}
    assert "first_order (relative)" in names and not any(n.endswith("-rel") for n in names)
    fig.canvas.draw()
    ticks = [t.get_text() for t in ppl_ax.get_yticklabels() if t.get_text()]
    assert {"1", "2", "5"} <= set(ticks), ticks
    front = next(line for line in acc_ax.get_lines() if line.get_label() == "frontier")
    others = {to_hex(line.get_color()) for ax in fig.axes for line in ax.get_lines() if line is not front
              and line.get_label() != "frontier"}
    assert to_hex(front.get_color()) not in others
    assert all(p.startswith("$") and p.endswith("$") for p in [*LABELS.values(), HANDOFF_TITLE])  # mathtext


def test_every_table_names_the_depth_full_depth_means():
    """Policies capped by --max-steps are compared against their cap: the titles say which depth that is, and
    where a deeper fixed depth sits beside it, the matched table says what it scores (a cell 120% worse than
    r = 16 read as "within 0–2% of full depth" without a word)."""
    import copy
    import re

    from rich.console import Console

    from exitbench.analysis import tables
    from exitbench.sweep.run import summary_rows

    def render(*things):
        console = Console(width=160, record=True, file=open("/dev/null", "w"))
        console.print(*things)
        return " ".join(console.export_text().split())

    cell_list = copy.deepcopy(ACC)
    assert "full depth r = 16" in render(tables.summary_table(summary_rows(cell_list), "cells"))
    capped = [hand_made_cell("t", "acc", True, "fixed", 4, 0.50, 4, 0.25e-3),
              hand_made_cell("t", "acc", True, "fixed", 16, 0.90, 16, 1.0e-3),
              hand_made_cell("t", "acc", True, "second_order", 0.1, 0.5, 3.5, 0.24e-3, max_steps=4)]
    shown = render(*tables.pareto_tables(frontier.report(capped)))
    assert "matched quality (ε relative to full depth r = 4;" in shown
    assert "frontier over wall-clock on the throughput clock (speed-ups over full depth r = 4)" in shown
    assert re.search(r"full depth here is r = 4, the policies' max steps \(quality 0\.5\); r = 16 ran beside them "
                     r"and scores 0\.9", shown), shown
    assert "full depth r = 4" in render(tables.summary_table(summary_rows(capped), "cells"))


def note_end(note: str) -> str:
    """Where a spread note says to rerun: what follows its last "rerun them "."""
    return note.rpartition("rerun them ")[2]


def test_an_unreliable_timing_is_no_number_and_no_point_on_the_wall_clock_frontier():
    """Issue 72: on a busy machine pareto's matched table read a 0.17× speed-up as the policy's, and the wall-clock
    frontier ranked it. A speed-up whose timing a warning discredits shows `?` in every table and leaves the
    wall-clock frontier; its cell keeps its quality and iterations on the others."""
    import copy

    from exitbench.analysis.tables import _matched_table

    from helpers.cli import rendered

    cell_list = copy.deepcopy(ACC)
    kl = cell_list[2]  # kl τ=1e-3
    paired(kl, [0.5, 1.0, 6.0])  # spread 550%: no ratio can be read
    ((name, entry),) = frontier.report(cell_list).items()
    (row,) = [r for r in entry["matched_quality"] if r["policy"] == "kl" and r["tolerance"] == 0.01]
    assert row["timing_warnings"] and "spread" in row["timing_warnings"][0]
    shown = rendered([_matched_table(name, entry)], width=160)
    kl_line = next(line for line in shown.splitlines() if " kl " in line)
    assert "? (0.17–2.00) !" in kl_line, shown
    assert all(p["policy"] != "kl" or p["threshold"] != 1e-3 for p in entry["frontiers"]["wall_clock"])
    paired(kl, [0.76, 0.8, 0.84])  # the control: repeats that agree put it back on that frontier, with its number
    ((name, entry),) = frontier.report(cell_list).items()
    assert any(p["policy"] == "kl" and p["threshold"] == 1e-3 for p in entry["frontiers"]["wall_clock"])
    assert "1.25× (1.19–1.32)" in rendered([_matched_table(name, entry)], width=160)


def test_full_depth_beside_itself_is_stated_as_the_clocks_noise():
    """Issue 72: full depth's own row read an overhead of 0.95× quiet and 56× under load, as if a result. It is
    1 by definition; what its self-pairing measures, the clocks' noise, is said in a note."""
    import copy

    cell_list = copy.deepcopy(ACC)
    full = next(c for c in cell_list if c["policy"]["policy"] == "fixed" and c["policy"]["threshold"] == 16)
    assert notes.noise_note(cell_list) is None  # nothing timed beside itself: nothing to say
    paired(full, [0.95, 1.0, 1.08], full_depth=16)
    said = notes.noise_note(cell_list)
    assert said.startswith("full depth timed beside itself: its paired ratios span 0.95–1.08 on the throughput clock")
    assert any(n.text == said for n in notes.timing_notes(cell_list))
    (row,) = [r for r in frontier.matched_quality(one_group(cell_list), (0.01,)) if r["policy"] == "fixed"]
    assert row["overhead"] == 1.0 and row["overhead_timing"] == "reference"
