"""Every reader shows a cell's two clocks (issue 69): the throughput clock's speed-up and overhead (`repeats`) and the
latency clock's (`latency`, batch size 1) beside them, each paired with full depth, with its iteration bound and its
overhead; a cell written before the two clocks still reads, its one clock named "batch (before two clocks)"."""
from __future__ import annotations

import copy
import csv
import io
import json
import re

import pytest

from exitbench.analysis import frontier, notes, report, tables
from exitbench.timing.speedup import BEFORE_CLOCKS, estimate, repeats_clock, text
from exitbench.cli import app
from exitbench.sweep.run import summary_rows

from helpers.cells import ACC, paired, two_clocks, write_cells
from helpers.cli import assert_one_line_error, explain, runner
from helpers.cli import rendered as render_at


def rendered(renderables, width: int = 120) -> str:  # (this file's tables at 120 columns)
    return render_at(renderables, width)


def flat(text_: str) -> str:
    return " ".join(text_.split())


def timed_acc():
    """The hand-made accuracy task with kl τ=0.001 (6 of 16 iterations: bound 2.67×) and full depth retimed on both
    clocks: kl 2.00× (1.82–2.22) on the throughput clock, 1.25× (1.18–1.43) at batch size 1."""
    cell_list = copy.deepcopy(ACC)
    by = {(c["policy"]["policy"], c["policy"]["threshold"]): c for c in cell_list}
    two_clocks(by[("kl", 1e-3)], [0.45, 0.5, 0.55], [0.7, 0.8, 0.85])
    two_clocks(by[("fixed", 16)], [0.9, 1.0, 1.1], [0.95, 1.0, 1.02])
    return cell_list, by


def test_each_clock_is_its_own_paired_estimate_and_overhead():
    cell_list, by = timed_acc()
    kl, full = by[("kl", 1e-3)], by[("fixed", 16)]
    throughput, latency = estimate(kl, full), estimate(kl, full, "latency")
    assert (throughput.value, throughput.basis) == (2.0, "paired") and throughput.timed["clock"] == "throughput"
    assert (latency.value, latency.basis, latency.bound) == (1.25, "paired", pytest.approx(16 / 6))
    assert text(latency) == "1.25× (1.18–1.43)" and latency.timed["documents"] == 8
    assert repeats_clock(kl) == "throughput"
    # each clock's time ratio over the same FLOP ratio (6 / 16, the cells')
    assert frontier.overhead(kl, full)["overhead"] == pytest.approx(0.5 / (6 / 16))
    assert frontier.overhead(kl, full, "latency")["overhead"] == pytest.approx(0.8 / (6 / 16))
    # full depth against itself is 1 by definition on both, whatever its self-paired repeats' noise
    assert [frontier.overhead(full, full, c)["overhead"] for c in ("throughput", "latency")] == [1.0, 1.0]
    assert text(estimate(full, full, "latency")) == "ref"


def test_the_latency_clock_has_paired_repeats_or_nothing():
    """Two evaluations divided ran at the run's batch size: no latency speed-up, whatever they say; the bound
    stays, and a latency speed-up above it is flagged as a throughput one is."""
    cell_list = copy.deepcopy(ACC)
    by = {(c["policy"]["policy"], c["policy"]["threshold"]): c for c in cell_list}
    kl, full = by[("kl", 1e-3)], by[("fixed", 16)]
    assert estimate(kl, full).basis == "evaluations"
    none = estimate(kl, full, "latency")
    assert none.value is None and none.bound == pytest.approx(16 / 6) and text(none) == "-"
    assert text(estimate(full, full, "latency")) == "-"  # a full depth without latency repeats is no reference
    assert frontier.overhead(kl, full, "latency") is None
    paired(kl, [0.25, 0.3, 0.35], clock="latency", documents=8)  # 3.33×: above 2.67×
    flagged = estimate(kl, full, "latency")
    assert flagged.flagged and flagged.flag.startswith("3.33× is above the iteration bound 2.67×")
    rep = frontier.report(cell_list)
    assert "second_order" not in notes.bound_note(rep) and "kl τ=0.001 (bs1): 3.33×" in notes.bound_note(rep)
    shown = flat(rendered([tables.summary_table(summary_rows(cell_list), "cells")], width=160))
    assert "3.33× (2.86–4.00) ‼" in shown and "‼ kl τ=0.001 (bs1): not a result: 3.33× is above" in shown


def test_export_has_both_clocks_and_names_the_clock_of_speedup(tmp_path):
    cell_list, by = timed_acc()
    paired(by[("second_order", 0.1)], [0.45, 0.5, 0.55])  # written before the two clocks
    write_cells(tmp_path, cell_list)
    res = runner.invoke(app, ["export", str(tmp_path)])
    assert res.exit_code == 0, explain(res)
    rows = {(r["policy"], float(r["threshold"])): r for r in csv.DictReader(io.StringIO(res.stdout))}
    new, old = rows[("kl", 1e-3)], rows[("second_order", 0.1)]
    untimed, ref = rows[("oracle", 0.01)], rows[("fixed", 16)]
    assert (new["clock"], new["clock_measured"]) == ("throughput", "steady state")
    assert float(new["speedup"]) == float(new["speedup_throughput"]) == 2.0
    assert float(new["overhead"]) == float(new["overhead_throughput"]) == pytest.approx(4 / 3)
    assert float(new["speedup_latency"]) == 1.25 and new["speedup_latency_basis"] == "paired"
    assert (float(new["speedup_latency_low"]), float(new["speedup_latency_high"])) == (pytest.approx(1 / 0.85),
                                                                                       pytest.approx(1 / 0.7))
    assert float(new["overhead_latency"]) == pytest.approx(0.8 / (6 / 16)) and new["speedup_latency_flag"] == ""
    # the one clock of a cell written before the two: named, its speed-up and overhead kept, no throughput or latency
    assert old["clock"] == BEFORE_CLOCKS and float(old["speedup"]) == 2.0 and float(old["overhead"]) > 0
    assert old["speedup_throughput"] == old["overhead_throughput"] == old["speedup_latency"] == ""
    assert old["overhead_latency"] == ""
    # untimed: two evaluations divided are no clock's
    assert untimed["clock"] == untimed["speedup_throughput"] == untimed["speedup_latency"] == ""
    assert untimed["speedup"] != ""
    assert ref["overhead_timing"] == "reference" and float(ref["overhead_latency"]) == 1.0
    assert float(ref["speedup_latency"]) == 1.0 and ref["speedup_latency_basis"] == "reference"


def test_run_table_shows_both_clocks_at_120_columns_and_names_them():
    cell_list, by = timed_acc()
    shown = rendered([tables.summary_table(summary_rows(cell_list), "cells")])
    lines = shown.splitlines()
    assert all(len(line) <= 120 for line in lines) and "…" not in shown, shown
    heading = flat(" ".join(line for line in lines if line.startswith("┃")))
    # (the headings fold at 120: `bs1` above `speed-up` and `overhead`)
    assert heading.count("bs1") == heading.count("speed-up") == heading.count("overhead") == 2, heading
    kl = next(i for i, line in enumerate(lines) if line.startswith("│ kl ") and "0.001" in line)
    cells_ = [c.strip() for c in lines[kl].split("│")] + [c.strip() for c in lines[kl + 1].split("│")]
    assert {"2.00×", "(1.82–2.22)", "1.33×", "1.25×", "(1.18–1.43)", "2.13×"} <= set(cells_), shown
    said = flat(shown)
    assert ("speed-up, overhead: the throughput clock, the run's batch size over a stream of 64 documents in its "
            "steady state; bs1: the latency clock, one request at a time, on 8 documents") in said
    wide = flat(rendered([tables.summary_table(summary_rows(cell_list), "cells")], width=200))
    assert re.search(r"kl │ 0\.001 │.* 2\.00× \(1\.82–2\.22\) │ 1\.33× │ 1\.25× \(1\.18–1\.43\) │ 2\.13× │", wide), wide


def test_a_cell_before_the_two_clocks_reads_and_names_its_clock(tmp_path):
    cell_list = copy.deepcopy(ACC)
    kl = next(c for c in cell_list if c["policy"]["policy"] == "kl" and c["policy"]["threshold"] == 1e-3)
    paired(kl, [0.45, 0.5, 0.55])
    assert repeats_clock(kl) == BEFORE_CLOCKS and repeats_clock(cell_list[0]) is None
    shown = rendered([tables.summary_table(summary_rows(cell_list), "cells")])
    assert "bs1" not in shown and re.search(r"│ kl +│ +0\.001 │.*2\.00× \(1\.82–2\.22\)", shown)
    assert (f"speed-up, overhead: {BEFORE_CLOCKS}, the run's batch size on one batch of 16 documents, the scored "
            "tokens' loop phases only") in flat(shown)
    rep = frontier.report(cell_list)
    matched = rendered(tables.pareto_tables(rep), width=160)
    assert "bs1" not in matched and "frontier over wall-clock on the batch clock (before two clocks)" in flat(matched)
    row = next(r for r in rep["t · acc"]["matched_quality"] if r["policy"] == "kl")
    assert row["clock"] == BEFORE_CLOCKS and row["speedup_latency"] is None and row["overhead_latency"] is None
    write_cells(tmp_path, cell_list)
    res = runner.invoke(app, ["pareto", str(tmp_path)])
    assert res.exit_code == 0, explain(res)
    page = report.build(tmp_path)
    assert "bs1 speed-up" not in page[page.index('id="matched"'):page.index('id="serving"')]


def test_pareto_and_report_show_both_clocks(tmp_path):
    cell_list, by = timed_acc()
    rep = frontier.report(cell_list)
    row = next(r for r in rep["t · acc"]["matched_quality"] if r["policy"] == "kl")
    assert (row["speedup"], row["speedup_latency"], row["clock"]) == (2.0, 1.25, "throughput")
    assert row["overhead"] == pytest.approx(4 / 3) and row["overhead_latency"] == pytest.approx(0.8 / (6 / 16))
    shown = rendered(tables.pareto_tables(rep), width=200)
    assert re.search(r"│ kl +│ +0\.001 │.*│ 2\.00× \(1\.82–2\.22\) │ +1\.33× │ 1\.25× \(1\.18–1\.43\) │ +2\.13× │",
                     shown), shown
    assert "bs1 speed-up" in shown and "bs1 overhead" in shown
    assert "frontier over wall-clock on the throughput clock (speed-ups" in flat(shown)
    assert "bs1: the latency clock, one request at a time" in flat(shown)
    narrow = rendered(tables.pareto_tables(rep, "matched"))
    assert all(len(line) <= 120 for line in narrow.splitlines()) and "…" not in narrow, narrow
    assert json.loads(tables.format_tables(rep, "json", "matched"))[0].keys() >= {"speedup_latency", "overhead_latency"}
    write_cells(tmp_path, cell_list)
    page = report.build(tmp_path)
    matched = page[page.index('id="matched"'):page.index('id="serving"')]
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", matched)
    assert {"speed-up", "overhead", "bs1 speed-up", "bs1 range", "bs1 overhead"} <= set(headers)
    kl_row = re.findall(r"<td[^>]*>([^<]*)</td>", re.search(r"<tr><td>kl</td>(.*?)</tr>", matched).group(1))
    by_header = dict(zip(headers[1:], kl_row))
    assert [by_header[h] for h in ("speed-up", "range of repeats", "overhead", "bs1 speed-up", "bs1 range",
                                   "bs1 overhead")] == ["2.00×", "1.82–2.22×", "1.33×", "1.25×", "1.18–1.43×", "2.13×"]
    assert "quality against wall-clock per token (throughput clock)" in page


def test_a_wide_latency_spread_is_warned_and_marked():
    cell_list, by = timed_acc()
    paired(by[("kl", 1e-3)], [0.5, 0.8, 1.3], clock="latency", documents=8)  # spread 100%
    assert notes.spread_note(cell_list) is None
    said = notes.spread_note(cell_list, "latency")
    assert said.startswith("1 of 7 cells' repeated timings on the latency clock (bs1) spread more than 50%")
    assert "up to 100%, t kl τ=0.001" in said
    assert any(n.text == said for n in notes.timing_notes(cell_list))
    assert any(n.text == said for n in notes.notes(cell_list, topics=notes.REPORT))
    rows = {(r["policy"], r["threshold"]): r for r in summary_rows(cell_list)}
    assert rows[("kl", 1e-3)]["warnings"] == [] and "spread 100%" in rows[("kl", 1e-3)]["latency_warnings"][0]
    speed_up, _ = tables._latency_cells(rows[("kl", 1e-3)])
    assert speed_up == "[red]? (0.77–2.00) ![/red]"


def test_a_latency_record_is_typed_at_the_door(tmp_path):
    cell_list, by = timed_acc()
    by[("kl", 1e-3)]["wall_clock"]["latency"]["clock"] = "bs1"
    write_cells(tmp_path, cell_list)
    line = assert_one_line_error(runner.invoke(app, ["export", str(tmp_path)]), ["broken cell",
                                                                                 "wall_clock.latency.clock"])
    assert "kl" in line
