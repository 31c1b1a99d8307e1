"""Threads and machine load, what a run's timings depend on: `--threads` sets torch's threads for the run and each
cell records them with the machine's load around it; a machine busier than its cores is warned about once, before
the first cell, with advice that fits the run's threads."""
from __future__ import annotations

import os

import torch

from exitbench.cli import app

from helpers.cells import load_cells
from helpers.cli import explain, invoke, runner
from helpers.sweeps import SMALL


def test_a_run_on_a_busy_machine_says_so_before_it_computes(tmp_path, capfd, monkeypatch):
    """Load above the cores as the run starts: one warning, before the first cell, with advice that fits the
    threads the run uses; nothing when the machine is idle (the session's patched load)."""
    import exitbench.sweep.schedule

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the first cell: what was said by then was said before any compute

    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", stop)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * os.cpu_count(), 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        for threads, advice in (("2", "or with --threads 1"), ("1", "rerun on an idle machine")):
            res = runner.invoke(app, ["run", *SMALL, "--threads", threads, "--out", str(tmp_path / threads)])
            assert res.exit_code == 130, explain(res)
            warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
            assert len(warnings) == 1 and "is busy as this run starts" in warnings[0], res.stderr
            assert advice in warnings[0] and (threads == "2" or "--threads 1" not in warnings[0]), warnings
        monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
        res = runner.invoke(app, ["run", *SMALL, "--out", str(tmp_path / "idle")])
        assert res.exit_code == 130 and "warning:" not in res.stderr, explain(res)
    finally:
        torch.set_num_threads(before)


def test_threads_are_taken_recorded_and_checked(tmp_path, capfd):
    """--threads sets torch's threads for the run; each cell records them and the machine's load around it."""
    before = torch.get_num_threads()
    out = tmp_path / "out"
    try:
        code, lines, _ = invoke(["run", *SMALL, "--threads", "1", "--out", str(out)], capfd)
        assert code == 0, lines
    finally:
        torch.set_num_threads(before)
    for cell in load_cells(out).values():
        assert cell["run"]["machine"]["cpu_threads"] == 1
        load = cell["run"]["load"]
        assert load["cpus"] == os.cpu_count() and load["start"] is not None and load["end"] is not None
    code, lines, _ = invoke(["run", *SMALL, "--threads", "0", "--out", str(tmp_path / "bad")], capfd)
    assert code == 2 and any("--threads must be ≥ 1" in line for line in lines)
