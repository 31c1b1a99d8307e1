"""A cell's overhead (issue 45): its time ratio to full depth over its FLOP ratio, on hand-made cells whose numbers
give it exactly, in the readers (pareto, run's table, the report, export) and from the retiming that stores it."""
from __future__ import annotations

import copy
import re

import pytest

from exitbench.analysis import export, frontier, labels, report, tables
from exitbench.timing import retime
from exitbench.sweep.run import summary_rows

from helpers.cells import ACC, hand_made_cell, paired
from helpers.cli import rendered as render_at


def rendered(renderables, width: int = 140) -> str:  # (this file's tables at 140 columns)
    return render_at(renderables, width)


def cell_of(cell_list, policy, tau):
    return next(c for c in cell_list if c["policy"]["policy"] == policy and c["policy"]["threshold"] == tau)


def test_overhead_is_time_ratio_over_flop_ratio():
    cell_list = copy.deepcopy(ACC)
    full, kl = cell_of(cell_list, "fixed", 16), cell_of(cell_list, "kl", 1e-3)
    # kl: 0.8 ms against 1.0 ms per token, 6000 against 16000 FLOPs per token
    got = frontier.overhead(kl, full)
    assert got["overhead"] == pytest.approx((0.8e-3 / 1.0e-3) / (6000 / 16000))
    assert got["time_ratio"] == pytest.approx(0.8) and got["flops_ratio"] == pytest.approx(6 / 16)
    assert got["timing"] == "plain"
    assert frontier.overhead(full, full)["overhead"] == pytest.approx(1.0)
    assert frontier.references(cell_list)[kl["cell_id"]] is full


def test_paired_repeats_win_over_the_cells_own_timings():
    cell_list = copy.deepcopy(ACC)
    full, kl = cell_of(cell_list, "fixed", 16), cell_of(cell_list, "kl", 1e-3)
    paired(kl, [0.45, 0.5, 0.55])
    got = frontier.overhead(kl, full)
    assert got["timing"] == "paired" and got["overhead"] == pytest.approx(0.5 / (6 / 16))
    # the repeats' own FLOP ratio (the same requests as their times) wins over the cells'
    kl["wall_clock"]["repeats"]["flops_ratio"] = 0.25
    assert frontier.overhead(kl, full)["overhead"] == pytest.approx(2.0)
    assert frontier.overhead(kl, None)["overhead"] == pytest.approx(2.0)
    # repeats paired with another depth than this full depth's are not this ratio
    kl["wall_clock"]["repeats"]["full_depth"] = 8
    assert frontier.overhead(kl, full)["timing"] == "plain"


def test_cells_without_times_or_flops_have_no_overhead():
    cell_list = copy.deepcopy(ACC)
    full, kl = cell_of(cell_list, "fixed", 16), cell_of(cell_list, "kl", 1e-3)
    kl["wall_clock"]["per_token_s"] = None
    del cell_of(cell_list, "oracle", 0.01)["flops"]
    assert frontier.overhead(kl, full) is None and frontier.overhead(kl, None) is None
    lone = hand_made_cell("v", "acc", True, "kl", 1e-3, 0.9, 6, 1e-3)  # no full depth beside it
    assert frontier.references([lone]) == {} and frontier.overhead(lone, None) is None
    rows = {(r["policy"], r["threshold"]): r for r in summary_rows(cell_list + [lone])}
    assert rows[("kl", 1e-3)]["overhead"] is None and rows[("oracle", 0.01)]["overhead"] is None
    assert labels.overhead(None) == "-"
    text = rendered([tables.summary_table(summary_rows(cell_list), "c")])
    assert re.search(r"│ kl +│ +0\.001 │.*│ +- │", text), text


def test_the_overhead_column_in_run_pareto_report_and_export(tmp_path):
    cell_list = copy.deepcopy(ACC)
    paired(cell_of(cell_list, "kl", 1e-3), [0.45, 0.5, 0.55])  # 0.5 / (6/16) = 1.33, paired
    run_text = rendered([tables.summary_table(summary_rows(cell_list), "cells")])
    assert "overhead" in run_text
    assert re.search(r"│ kl +│ +0\.001 │.*│ +1\.33× │", run_text), run_text
    # second_order 0.1: 0.5 ms over 1.0, 7000 FLOPs over 16000 → 1.14, from the cells' own timings: marked
    assert re.search(r"│ second_order +│ +0\.1 │.*│ +1\.14×\* │", run_text), run_text
    assert labels.PLAIN_OVERHEAD in " ".join(run_text.split())
    rep = frontier.report(cell_list)
    pareto_text = rendered(tables.pareto_tables(rep, "matched"))
    assert "overhead" in pareto_text
    assert re.search(r"│ kl +│ +0\.001 │.*│ +1\.33× │", pareto_text), pareto_text
    matched = frontier.table_rows(rep)[1]
    kl_row = next(r for r in matched if r["policy"] == "kl" and r["threshold"] == 1e-3)
    assert kl_row["overhead"] == pytest.approx(4 / 3) and kl_row["overhead_timing"] == "paired"
    html = report.matched_table(next(iter(rep.values())))
    assert "<th class=\"num\">overhead</th>" in html and "1.33×" in html and "1.14×*" in html
    row = export.row(tmp_path / "x.json", cell_of(cell_list, "kl", 1e-3), cell_of(cell_list, "fixed", 16))
    assert row["overhead"] == pytest.approx(4 / 3) and row["overhead_timing"] == "paired"
    assert {"overhead", "overhead_timing"} <= set(export.COLUMNS)


class Counted:
    """An ExitbenchLM's surface as retime uses it, its per-token seconds and FLOPs set."""

    def __init__(self, seconds: float, flops: float):
        self.seconds, self.flops = seconds, flops
        self.request_stats, self.on_progress = [], None

    def loglikelihood(self, requests):
        for _ in requests:
            self.request_stats.append({"iterations": [1], "token_seconds": self.seconds, "flops": self.flops})


def test_retiming_stores_the_flop_ratio_and_overhead_of_the_same_passes():
    got = retime.retime(Counted(3.0, 250.0), Counted(2.0, 1000.0), [("loglikelihood", [1, 2])], 2, 16)
    assert got["flops_ratio"] == pytest.approx(0.25) and got["overhead"] == pytest.approx(1.5 / 0.25)
    # stats without FLOPs (older stand-ins) time as before, with no overhead
    bare = retime.retime(Counted(1.0, None), Counted(1.0, None), [("loglikelihood", [1])], 1, 16)
    assert bare["ratio"] == 1.0 and bare["flops_ratio"] is None and bare["overhead"] is None
