"""Repeated, interleaved timing of a cell beside full depth (exitbench/harness/retime.py), on stand-in models
whose per-token times are set, so the pairing and the order can be checked exactly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from exitbench.harness import retime


class Timed:
    """An ExitbenchLM's surface as retime uses it: a request method recording per-request stats, with the
    per-token seconds of each successive call taken from `times`."""

    def __init__(self, name: str, times: list[float], log: list[str]):
        self.name, self.times, self.log = name, list(times), log
        self.request_stats = [{"mine": True}]  # the evaluation's own stats, which retiming must leave alone
        self.on_progress = print

    def generate_until(self, requests):
        assert self.on_progress is None  # no progress bar moves while retiming
        self.log.append(self.name)
        per_token = self.times.pop(0)
        for _ in requests:  # two scored tokens per request
            self.request_stats.append({"iterations": [3, 4], "token_seconds": 2 * per_token})
        return ["" for _ in requests]


def requests(task: str, n: int) -> list:
    return [SimpleNamespace(task_name=task, idx=i) for i in range(n)]


def test_repeats_alternate_and_pair_each_cell_timing_with_its_neighbour():
    log: list[str] = []
    cell = Timed("cell", [1.0, 2.0, 1.5, 1.0], log)
    full = Timed("full", [4.0, 4.0, 5.0, 2.0], log)
    work = [("generate_until", requests("t", 3))]
    got = retime.retime(cell, full, work, 4, full_depth=16)
    # Even repeats time the cell first, odd ones full depth first: a machine that speeds up or slows down
    # over the repeats weighs on both sides alike.
    assert log == ["cell", "full", "full", "cell", "cell", "full", "full", "cell"]
    assert got["per_token_s"] == [1.0, 2.0, 1.5, 1.0] and got["full_per_token_s"] == [4.0, 4.0, 5.0, 2.0]
    assert got["ratios"] == [0.25, 0.5, 0.3, 0.5]
    assert got["ratio"] == pytest.approx(0.4)  # the median of four
    assert got["spread"] == pytest.approx((0.5 - 0.25) / 0.4)
    assert got["repeats"] == 4 and got["requests"] == 3 and got["full_depth"] == 16
    for lm in (cell, full):  # the evaluation's statistics and progress callback are as they were
        assert lm.request_stats == [{"mine": True}] and lm.on_progress is print


def test_nothing_to_time_is_no_timing():
    log: list[str] = []
    assert retime.retime(Timed("c", [], log), Timed("f", [], log), [], 3, 16) is None
    assert retime.retime(Timed("c", [1.0], log), Timed("f", [1.0], log), [("generate_until", [])], 0, 16) is None
    assert log == []


def test_each_task_times_its_own_first_requests_of_each_kind():
    received = {"loglikelihood": requests("a", 5) + requests("b", 5), "generate_until": requests("b", 30)}
    received["generate_until"] += requests("b", 170)
    work = dict(retime.task_work(received, "b", 16))
    # One batch of 16 of 200 generations, but no more than an eighth of a task's requests: none of its 5
    # scorings (retiming them would cost more than scoring them did).
    assert "loglikelihood" not in work and len(work["generate_until"]) == 16
    assert all(r.task_name == "b" for reqs in work.values() for r in reqs)
    assert [r.idx for r in work["generate_until"]] == list(range(16))  # lm-eval's order, from the start
    assert retime.task_work(received, "c", 16) == []
    assert retime.sample_size(1, 600) == retime.sample_size(16, 600) == 16 and retime.sample_size(64, 600) == 64
    assert retime.sample_size(16, 24) == 3 and retime.sample_size(16, 8) == 1 and retime.sample_size(16, 7) == 0


def test_a_cell_says_why_its_timing_is_unreliable():
    cell = {"run": {"load": {"start": 0.4, "end": 0.6, "cpus": 2}},
            "wall_clock": {"repeats": {"repeats": 3, "ratio": 0.4, "spread": 0.1}}}
    assert retime.warnings(cell) == []
    cell["run"]["load"]["end"] = 6.0
    cell["wall_clock"]["repeats"]["spread"] = retime.UNRELIABLE_SPREAD + 0.1
    reasons = retime.warnings(cell)
    assert len(reasons) == 2
    assert "busy machine (load 6 on 2 cores)" in reasons[0]
    assert "3 repeated timings spread 60%" in reasons[1] and "0.4 to full depth" in reasons[1]
    assert retime.warnings({"run": {}, "wall_clock": {}}) == []  # a cell timed once, before repeats existed


def test_the_run_table_shows_the_paired_ratio_and_marks_an_unreliable_one():
    """As a speed-up (full depth's time ÷ the cell's: a ratio of 0.4 is 2.50×), the convention of every table."""
    from exitbench.analysis.tables import _paired_speedup

    assert _paired_speedup({"time_ratio": None}) == "-"  # timed once
    assert _paired_speedup({"time_ratio": 0.4, "time_spread": 0.1, "warnings": []}) == "2.50× ±5%"
    marked = _paired_speedup({"time_ratio": 0.4, "time_spread": 0.8, "warnings": ["spread"]})
    assert marked == "[red]2.50× ±40% ![/red]"
