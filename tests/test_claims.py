"""Sweeps that share a directory never compute a cell twice: a sweep, exact or `--replay`, claims each cell (an
flock on `.ID.lock`) right before computing it; a cell another live sweep holds is left to it and collected once
written; the claim of a sweep that died is taken over; no lock file outlives a sweep, nor a killed one's resume.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exitbench.store import cells, disk as results
from exitbench.sweep.replay import ReplaySweep
from exitbench.sweep.schedule import plan, run_cells

from helpers.cells import held_by_another_sweep
from helpers.cli import subprocess_env


@pytest.fixture
def counted_writes(monkeypatch):
    """run_id → cell ids of every cell file a sweep in this process writes."""
    writes: dict[str, list[str]] = {}
    real = results.write

    def write(directory, cell, samples=None):
        writes.setdefault(cell["run"]["run_id"], []).append(cell["cell_id"])
        return real(directory, cell, samples)

    monkeypatch.setattr(results, "write", write)
    return writes


# ---- exact sweeps ------------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from exitbench.store import disk as results
claim = results.Claim(Path(sys.argv[1]), sys.argv[2])
assert claim.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
if len(sys.argv) > 4:  # finish the cell, as a real sweep would, before letting go
    Path(sys.argv[4]).write_text(Path(sys.argv[5]).read_text())
"""


def _hold(directory: Path, cid: str, seconds: float, *write: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), cid, str(seconds), *write],
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_excludes_others_until_its_owner_dies(tmp_path):
    proc = _hold(tmp_path, "abc", 60)
    mine = results.Claim(tmp_path, "abc")
    try:
        assert not mine.acquire()
        proc.kill()  # a kill -9'd sweep: the kernel drops its lock
        proc.wait()
        assert mine.acquire()
    finally:
        mine.release()
        proc.kill()
    assert not (tmp_path / ".abc.lock").exists()


@pytest.mark.slow  # 5 s, 3 of them waiting on the other sweep; the same collection with the claim held in this
# process (test_a_cell_claimed_through_another_file_is_collected_once_written) stays fast
def test_a_cell_another_sweep_holds_is_collected_not_recomputed(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    reference = tmp_path / "reference"
    made = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, reference, "cpu")}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    # The other "sweep" holds the fixed cell for 3 s, then writes it (marked, so we can tell) and exits.
    theirs = {**made["fixed"], "cell_id": cells.cell_id(fixed_key), "key": fixed_key,
              "run": {**made["fixed"]["run"], "run_id": "the-other-sweep"}}
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    proc = _hold(out, cells.cell_id(fixed_key), 3, str(out / cells.filename(theirs)), str(tmp_path / "theirs.json"))
    try:
        done = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.2)}
    finally:
        proc.wait(timeout=30)
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not computed twice
    assert done["second_order"]["run"]["run_id"] == sweep.run_id


def test_a_cell_claimed_through_another_file_is_collected_once_written(tmp_path, small_sweep):
    """The collection above without a second process or its 3 s: an flock belongs to the open file, so a claim
    this test holds refuses the sweep's own claim on the cell just as another sweep's would. The holder writes
    the cell (atomically) and lets go 0.5 s into the sweep; the sweep collects that cell and computes the rest."""
    ck, tasks, cfg = small_sweep
    made = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, tmp_path / "reference", "cpu")}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    with held_by_another_sweep(out, fixed_key, made["fixed"], tmp_path / "theirs.json", 0.5):
        done = {c["policy"]["policy"]: c for c in run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.05)}
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not computed twice
    assert done["second_order"]["run"]["run_id"] == sweep.run_id
    assert not list(out.glob(".*.lock"))


def test_a_dead_sweeps_claim_is_taken_over(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    proc = _hold(out, cells.cell_id(sweep.cells[0][2]), 1)  # dies after 1 s without writing its cell
    t0 = time.monotonic()
    done = run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep, poll_s=0.2)
    proc.wait(timeout=30)
    assert len(done) == 2 and all(c["run"]["run_id"] == sweep.run_id for c in done)
    assert time.monotonic() - t0 >= 1.0
    assert not list(out.glob(".*.lock"))


def test_a_claim_left_beside_a_finished_cell_is_swept_on_resume(tmp_path, small_sweep, counted_writes):
    """A sweep killed after writing a cell but before letting go of its claim leaves the lock file; the cell is
    done, so no later sweep claims it again. The resume removes such a lock, and leaves a live one alone."""
    ck, tasks, cfg = small_sweep
    out = tmp_path / "out"
    made = run_cells(ck, tasks, cfg, out, "cpu")
    stale = out / f".{made[0]['cell_id']}.lock"
    stale.touch()  # what the killed sweep left: a lock file nobody holds
    live = results.Claim(out, "a-cell-of-another-live-sweep")
    assert live.acquire()
    try:
        sweep = plan(ck, tasks, cfg, out, "cpu")
        assert len(run_cells(ck, tasks, cfg, out, "cpu", sweep=sweep)) == 2
        assert sweep.run_id not in counted_writes  # every cell was on disk: nothing recomputed
        assert not stale.exists()
        assert live.path.exists()
    finally:
        live.release()


# ---- replay sweeps -----------------------------------------------------------------------------------------------

def test_replay_sweeps_that_planned_together_compute_each_cell_once(tmp_path, replay_sweep, counted_writes):
    """The race, made deterministic: both sweeps look at the empty directory (their plans), then one computes.
    The other finds every cell written once it holds the cell's claim, and collects instead of recomputing."""
    ck, tasks, cfg = replay_sweep
    out = tmp_path / "out"
    first, second = plan(ck, tasks, cfg, out, "cpu"), plan(ck, tasks, cfg, out, "cpu")
    assert not first.done and not second.done
    made = ReplaySweep(ck, tasks, cfg, first).run(out)
    collected = ReplaySweep(ck, tasks, cfg, second).run(out)
    assert len(made) == len(collected) == 2
    assert sorted(counted_writes[first.run_id]) == sorted(c["cell_id"] for c in made)
    assert second.run_id not in counted_writes  # nothing computed, nothing written twice
    assert {c["run"]["run_id"] for c in collected} == {first.run_id}
    assert not list(out.glob(".*.lock"))


def test_a_cell_a_live_sweep_holds_is_collected_not_replayed(tmp_path, replay_sweep, counted_writes):
    """A claim held through another open file refuses the sweep's claim as another process's would. The
    holder writes the cell 0.3 s in and lets go; the sweep replays the rest and collects the held cell."""
    ck, tasks, cfg = replay_sweep
    ref = tmp_path / "ref"
    reference = {c["policy"]["policy"]: c for c in ReplaySweep(ck, tasks, cfg, plan(ck, tasks, cfg, ref, "cpu")).run(ref)}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    with held_by_another_sweep(out, fixed_key, reference["fixed"], tmp_path / "theirs.json", 0.3):
        done = {c["policy"]["policy"]: c for c in ReplaySweep(ck, tasks, cfg, sweep).run(out)}
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not replayed a second time
    assert done["second_order"]["run"]["run_id"] == sweep.run_id
    assert counted_writes[sweep.run_id] == [done["second_order"]["cell_id"]]
    assert not list(out.glob(".*.lock"))


# Runs `exitbench ARGV` once a go-file appears, logging each cell file it writes (one line per write).
COUNTING_RUN = """
import sys, time
from pathlib import Path
from exitbench.store import disk as results
from exitbench.cli import app
log, go, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
real = results.write
def write(directory, cell, samples=None):
    path = real(directory, cell, samples)
    with open(log, "a") as fh:
        fh.write(cell["cell_id"] + "\\n")
    return path
results.write = write
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
app(argv)
"""


@pytest.mark.slow  # two processes at once, ~10 s; the two fast tests above cover the claim and the collection
def test_two_replay_sweeps_at_once_compute_each_cell_once(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    args = ["run", "--tasks", "chains_lambada,chains_mc", "--policy", "second_order", "--thresholds", "0.1,1",
            "--baselines", "4,16", "--limit", "24", "--replay", "--quiet", "--out", str(out)]
    procs = [subprocess.Popen([sys.executable, "-c", COUNTING_RUN, str(tmp_path / f"writes-{i}"), str(go), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for i in range(2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    go.touch()  # both plan over the same empty directory
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    written = [cid for i in range(2) if (tmp_path / f"writes-{i}").exists()
               for cid in (tmp_path / f"writes-{i}").read_text().split()]
    on_disk = {cells.read(p)["cell_id"] for p in out.glob("*.json")}
    assert len(on_disk) == 2 * 4
    assert sorted(written) == sorted(on_disk)  # every cell written once, by one of the two
    assert not list(out.glob(".*.lock"))
