"""`--thresholds quantiles:N`: each rule's grid from the quantiles of its own recorded signal (sweep/quantiles.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from exitbench.engine import ExitConfig
from exitbench.engine.recorder import Recorder, Sequence_, variant_key
from exitbench.errors import ExitbenchError
from exitbench.models.checkpoint import open_checkpoint
from exitbench.policies.grids import MAX_QUANTILES, parse_quantiles
from exitbench.sweep.quantiles import derive_grids, quantile_grid, signal_values, trajectories
from helpers.cli import assert_one_line_error, run_cli, run_ok, runner
from helpers.paths import REPO


@pytest.fixture(scope="module")
def tiny():
    return open_checkpoint(None)


@pytest.fixture(scope="module")
def recorded(tiny):
    """Six chains prompts, their one-token answers recorded at depth 16 for four rules (one of them counts)."""
    names = ["second_order", "kl", "argmax_stability", "confidence"]
    configs = [ExitConfig(n) for n in names]
    groups = tiny.model.loop_groups()
    policies = [c.bound_policies(groups)[0] for c in configs]
    docs = [json.loads(line) for line in (REPO / "tasks/chains/test.jsonl").read_text().splitlines()[:6]]
    seqs = []
    for d in docs:
        ctx = tiny.tokenizer.encode(d["prompt"], add_bos=True)
        answer = tiny.tokenizer.encode(" " + d["answer"])[:1]
        seqs.append(Sequence_(ctx + answer[:-1], len(ctx) - 1, [answer]))
    recorder = Recorder(tiny.model, 16, policies, [], 0, [16], oracle=False)
    return configs, policies, recorder.record(seqs)


def _by_numpy(trajs, policy, n):
    """The grid as the issue states it, straight from the recorded arrays."""
    values = np.concatenate([t.signals[0][variant_key(policy)][:, :policy.max_steps].ravel() for t in trajs])
    values = values[np.isfinite(values)]
    return sorted({float(f"{q:.3g}") for q in np.quantile(values, np.linspace(0.02, 0.98, n)) if q > 0})


def test_grid_is_numpys_quantiles_of_the_recorded_signal(tiny, recorded):
    configs, policies, trajs = recorded
    grids = derive_grids(trajs, configs, tiny.model.loop_groups(), 5)
    for policy in policies:
        if policy.integer_threshold:
            continue
        assert grids[policy.name] == _by_numpy(trajs, policy, 5), policy.name
        assert len(grids[policy.name]) >= 2, policy.name  # a grid, not one point: the signals spread
    # Different rules, different scales: the point of deriving them.
    assert grids["kl"] != grids["second_order"]
    assert all(0 < t <= 1 for t in grids["confidence"])


def test_counting_rule_gets_whole_numbers(tiny, recorded):
    configs, policies, trajs = recorded
    grid = derive_grids(trajs, configs, tiny.model.loop_groups(), 7)["argmax_stability"]
    assert grid and all(isinstance(t, int) and t >= 1 for t in grid)
    policy = next(p for p in policies if p.name == "argmax_stability")
    runs = np.concatenate([t.signals[0][variant_key(policy)].ravel() for t in trajs])
    assert grid == sorted({max(1, int(round(q))) for q in np.quantile(runs, np.linspace(0.02, 0.98, 7))})


def test_rounding_dedup_and_nonpositive_values():
    values = np.array([0.0] * 10 + [1.234567e-3] * 80 + [0.5] * 10)
    # The 2% quantile is 0 (dropped: thresholds are > 0); the middle ones coincide once rounded.
    assert quantile_grid(values, 5, "kl") == [0.00123, 0.5]
    assert quantile_grid(np.array([3.0, 3.0]), 1, "kl") == [3.0]
    with pytest.raises(ExitbenchError, match="kl's recorded signal") as err:
        quantile_grid(np.array([-1.0, 0.0, 0.0]), 3, "kl")
    assert "\n" not in str(err.value)
    with pytest.raises(ExitbenchError, match="no finite value"):
        quantile_grid(np.zeros(0), 3, "second_order")


def test_a_conjunction_reads_its_varied_members_column():
    """A conjunction records (n, K, members); its grid is that of the member a sweep varies."""
    from types import SimpleNamespace

    from exitbench.engine.recorder import Trajectories

    cols = np.stack([np.full((2, 4), 0.5), np.arange(8.0).reshape(2, 4) + 1], -1)
    conj = SimpleNamespace(variant="all_of[x,y]", max_steps=3, varied=1)
    traj = Trajectories([0, 1], [{"all_of[x,y]": cols}], [None], [[None]], [np.zeros((2, 4))], np.ones((2, 4), bool))
    assert sorted(signal_values([traj], [conj]).tolist()) == [1.0, 2.0, 3.0, 5.0, 6.0, 7.0]
    conj.varied = 0
    assert signal_values([traj], [conj]).tolist() == [0.5] * 6


@pytest.mark.parametrize("conjunction", [False, True])
def test_a_derived_count_at_which_the_rule_cannot_exit_is_no_point_of_its_grid(tiny, conjunction):
    """argmax runs that reach 15 on a 16-step loop put τ = 15 among the quantiles; at τ = 15 the rule (or the peer's
    conjunction varying it, min_steps and patience 2) could never exit before full depth, so the grid stops short."""
    from exitbench.engine.recorder import Trajectories

    runs = np.tile(np.arange(16.0), (40, 1))  # every token's argmax settled from the start: runs 0 … 15
    rules = [{"policy": "margin", "threshold": 0.125}, {"policy": "argmax_stability"}]
    config = (ExitConfig("all_of", rules=rules, min_steps=2, patience=2) if conjunction
              else ExitConfig("argmax_stability"))
    variant = variant_key(config.bound_policies(tiny.model.loop_groups())[0])
    signal = np.stack([np.zeros_like(runs), runs], -1) if conjunction else runs
    traj = Trajectories(list(range(40)), [{variant: signal}], [None], [[None]], [np.zeros((40, 16))],
                        np.ones((40, 16), bool))
    grid = derive_grids([traj], [config], tiny.model.loop_groups(), 9)["argmax_stability"]
    assert grid == sorted({max(1, int(round(q))) for q in np.quantile(np.arange(16.0), np.linspace(0.02, 0.98, 9))
                           if q < (13.5 if conjunction else 14.5)})


@pytest.mark.parametrize("text,n", [("quantiles:3", 3), (" Quantiles:100 ", 100), ("quantiles:1", 1),
                                    ("1e-3,1e-2", None), (None, None)])
def test_parse(text, n):
    assert parse_quantiles(text) == n


@pytest.mark.parametrize("bad", ["quantiles:0", "quantiles:101", "quantiles:2.5", "quantiles:", "quantiles",
                                 "quantiles:x", "quantiles=3"])
def test_bad_n_is_refused_in_one_line(bad):
    with pytest.raises(ExitbenchError) as err:
        parse_quantiles(bad)
    message = str(err.value)
    assert bad.strip() in message and f"1 to {MAX_QUANTILES}" in message and "\n" not in message


def test_bad_n_on_the_command_line(tmp_path):
    res, _ = run_cli("--tasks", "chains", "--policy", "kl", "--thresholds", "quantiles:0", "--limit", "2",
                     "--out", str(tmp_path / "o"))
    assert_one_line_error(res, ["quantiles:0", "1 to 100"])
    res, _ = run_cli("--tasks", "chains", "--policy", "oracle", "--thresholds", "quantiles:3", "--limit", "2",
                     "--out", str(tmp_path / "o"))
    assert_one_line_error(res, ["quantiles:3", "none of the policies"])


def test_calibrate_refuses_a_derived_grid():
    """calibrate's guarantee needs its grid fixed before it reads the documents, so it takes numbers only."""
    from exitbench.cli import app

    res = runner.invoke(app, ["calibrate", "--policy", "kl", "--thresholds", "quantiles:5"])
    assert_one_line_error(res, ["quantiles:5", "before the documents are read"])


def test_replay_sweep_cells_carry_the_derived_grid(tiny, tmp_path):
    """quantiles:3 on a replay sweep: the grid is numpy's quantiles of the sweep's own recording (no second
    pass), each rule's cells sit at its grid, and every cell says how the grid was made."""
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.sweep import SweepConfig, execute, open_sweep

    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order", "argmax_stability"], quantiles=3,
                      baselines=[16], limit=4, replay=True, quiet=True, timing_repeats=0, out=tmp_path / "o")
    sweep = open_sweep(cfg, tiny, resolve_tasks(["chains_lambada"]))
    trajs = trajectories(sweep.replayer.recording)
    policy = ExitConfig("second_order").bound_policies(tiny.model.loop_groups())[0]
    grids = cfg.derived["grids"]
    assert grids["second_order"] == _by_numpy(trajs, policy, 3)
    assert all(isinstance(t, int) for t in grids["argmax_stability"])
    cells = execute(sweep).cells
    swept = {}
    for c in cells:
        swept.setdefault(c["policy"]["policy"], []).append(c["policy"]["threshold"])
        assert c["run"]["thresholds"]["from"] == "quantiles:3"
        assert c["run"]["thresholds"]["grids"] == grids
    assert sorted(swept["second_order"]) == grids["second_order"]
    assert sorted(swept["argmax_stability"]) == grids["argmax_stability"]
    assert swept["fixed"] == [16]


def test_exact_sweep_derives_the_same_grid_and_resumes(tmp_path):
    """Without --replay: a recording of the first documents places the grid, the cells run exactly at it, and a
    rerun records the same grid and reuses every cell (about a second on the tiny model)."""
    out = tmp_path / "o"
    args = ["--tasks", "chains_lambada", "--policy", "kl", "--thresholds", "quantiles:3", "--baselines", "16",
            "--limit", "4", "--timing-repeats", "0", "--out", str(out)]
    run_ok(*args)
    files = sorted(out.glob("*.json"))
    cells = [json.loads(f.read_text()) for f in files]
    grid = cells[0]["run"]["thresholds"]["grids"]["kl"]
    assert sorted(c["policy"]["threshold"] for c in cells if c["policy"]["policy"] == "kl") == grid
    assert "first 4 documents" in cells[0]["run"]["thresholds"]["recorded"]
    stamps = {f.name: f.stat().st_mtime_ns for f in files}
    run_ok(*args)  # the same recording, the same grid: every cell reused, none written again
    assert {f.name: f.stat().st_mtime_ns for f in sorted(out.glob("*.json"))} == stamps
