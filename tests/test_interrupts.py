"""An interrupted sweep: Ctrl-C (exit 130, the shell's code for SIGINT) and a scheduler's SIGTERM (exit 143) keep
the cells finished, say how many and that the same command resumes, and leave no claim behind. A kill -9 and the
resume after it: tests/test_run.py (slow)."""
from __future__ import annotations

import os

from typer.testing import CliRunner

from exitbench.cli import app

from helpers.cells import load_cells
from helpers.cli import explain, runner
from helpers.sweeps import SMALL


def test_ctrl_c_says_what_is_kept_and_that_a_rerun_resumes(tmp_path, monkeypatch):
    """Interrupted mid-sweep, `run` says how many of its cells are on disk and that the same command resumes,
    and exits 130 (the shell's code for SIGINT), not silently."""
    import exitbench.sweep.run

    runner = CliRunner()
    args = ["run", "--tasks", "chains_lambada", "--limit", "2", "--baselines", "4", "--out", str(tmp_path), "--quiet"]
    first = runner.invoke(app, [*args, "-p", "second_order", "--thresholds", "0.1"])
    assert first.exit_code == 0, explain(first)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(exitbench.sweep.run, "execute", interrupted)
    res = runner.invoke(app, [*args, "-p", "second_order", "--thresholds", "0.1,0.2"])
    assert res.exit_code == 130, explain(res)
    assert "interrupted: 2 of the sweep's 3 cells are finished and kept in" in " ".join(res.stderr.split())
    assert "rerun the same command to resume" in " ".join(res.stderr.split())


def test_sigterm_stops_a_sweep_as_ctrl_c_does(tmp_path, monkeypatch):
    """A scheduler's kill (SIGTERM) mid-sweep: the cells finished are kept, the command says so and how to
    resume, exit 143; the second cell never starts and leaves no claim behind."""
    import signal

    import exitbench.sweep.schedule

    real, calls = exitbench.sweep.schedule.run_config, []

    def then_terminated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered to this process's handler
        return real(*args, **kwargs)

    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", then_terminated)
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    res = runner.invoke(app, ["run", *SMALL, "--timing-repeats", "0", "--out", str(out)])
    assert res.exit_code == 143, explain(res)
    assert "interrupted: 1 of the sweep's 2 cells are finished and kept" in " ".join(res.stderr.split())
    assert len(load_cells(out)) == 1 and not list(out.glob(".*.lock"))
    assert signal.getsignal(signal.SIGTERM) == before  # the handler lives for the sweep only
