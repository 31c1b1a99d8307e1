"""Samples: on by default for the cells a run computes, without recomputing a finished cell that has none;
`--log-samples` by name makes a cell complete only with its samples file (a cell computed without one is computed
again); `--no-log-samples` writes none. Each sample carries its exited tokens' steps, text, log p and greedy flag, and the
samples file is written first and the cell last, so a sweep killed in between leaves no cell to skip on resume.
Damaged samples files at a reader's door: tests/test_readers.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from exitbench.harness.task_set import resolve_tasks
from exitbench.store import cells, disk as results
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import run_cells

from helpers.cells import load_cells
from helpers.cli import invoke
from helpers.sweeps import SMALL


def test_samples_are_written_by_default_and_asked_for_by_name_recompute_a_cell_that_has_none(tmp_path, capfd):
    out = tmp_path / "out"
    assert invoke(["run", *SMALL, "--out", str(out), "--no-log-samples"], capfd)[0] == 0
    assert not list(out.glob("*.samples.jsonl"))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    # the default writes samples for what it computes, and a finished cell without them is left as it is
    assert invoke(["run", *SMALL, "--out", str(out)], capfd)[0] == 0
    assert not list(out.glob("*.samples.jsonl"))
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before
    fresh = tmp_path / "fresh"
    assert invoke(["run", *SMALL, "--out", str(fresh)], capfd)[0] == 0
    assert len(list(fresh.glob("*.samples.jsonl"))) == len(before) > 0
    assert invoke(["run", *SMALL, "--out", str(out), "--log-samples"], capfd)[0] == 0
    for name, cell in load_cells(out).items():
        samples = results.samples_path(out / name)
        assert samples.exists(), name
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert len(rows) == 4 and all("exitbench" in r for r in rows)
        # Each exited token's text, log p and greedy flag ride beside its exit steps (what exit maps draw).
        assert all(len(r["exitbench"][k]) == len(r["exitbench"]["exit_steps"]) > 0 for r in rows
                   for k in ("token_text", "logprobs", "greedy"))
        assert cell["samples"] is True


def test_a_kill_between_samples_and_cell_leaves_no_cell(tmp_path, monkeypatch):
    """The samples go first and the cell last: dying in between leaves no cell to skip on resume."""
    ck_tasks = resolve_tasks(["chains_lambada"])
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16],
                      limit=4, log_samples=True)
    out = tmp_path / "out"
    real_write = results.atomic_write
    calls = []

    def dies_at_the_cell(path, write, mode="w"):
        calls.append(Path(path).name)
        if not str(path).endswith(results.SAMPLES_SUFFIX):
            raise KeyboardInterrupt("killed")
        return real_write(path, write, mode)

    monkeypatch.setattr(results, "atomic_write", dies_at_the_cell)
    with pytest.raises(KeyboardInterrupt):
        run_cells(ck, ck_tasks, cfg, out, "cpu")
    assert calls[0].endswith(results.SAMPLES_SUFFIX) and not list(out.glob("*.json"))
    monkeypatch.setattr(results, "atomic_write", real_write)
    done = run_cells(ck, ck_tasks, cfg, out, "cpu")
    assert len(done) == 2 and all(results.samples_path(out / cells.filename(c)).exists() for c in done)
