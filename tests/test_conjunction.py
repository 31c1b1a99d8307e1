"""The all_of conjunction: a token exits only when every member rule would.

- its array form (replay, calibration) and its streaming form (the engine's `decide`) equal a plain-loop
  reference on any trajectories (NaN, ±inf, patience per member and over the conjunction, min_steps);
- in the engine its members' signals are their own rules' direct formulas, its exits are the reference's on
  them, and it never exits before any member alone;
- batched equals batch size 1, depth-major equals token-major, and a recording replays the engine's exits;
- it is given in an exit-config file (run, lm-eval model args), sweeps its varied member's threshold, reads
  under a readable name, and calibrates.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.recorder import Recorder, Sequence_, variant_key
from exitbench.errors import ExitbenchError
from exitbench.policies import REGISTRY
from exitbench.store import cells
from exitbench.sweep.config import RunOptions, SweepConfig, grid

from helpers.engine import direct_signals, direct_trajectory, tiny
from helpers.paths import REPO

K = 12
EXIT_MODEL = REPO / "results" / "exit-models" / "tiny-raven.json"  # the committed model fitted on tiny-raven
T0 = [3, 5, 8, 2, 9]
T1 = [7, 11, 13, 17, 19]


def reference_exit(columns: np.ndarray, members: list[dict], patience: int, min_steps: int, K: int) -> int:
    """The conjunction as a plain loop over one token's member signals (K, m): each member's own streak of
    hits, the joint streak of iterations where every member's streak has reached its patience."""
    own, joint = [0] * len(members), 0
    for k in range(1, K + 1):
        for i, m in enumerate(members):
            v = float(columns[k - 1, i])
            hit = v >= m["threshold"] if m["above"] else v < m["threshold"]  # NaN never hits
            own[i] = own[i] + 1 if hit else 0
        joint = joint + 1 if all(s >= m["patience"] for s, m in zip(own, members)) else 0
        if k >= K or (k >= min_steps and joint >= patience):
            return k
    raise AssertionError("unreachable")


def _conjunction(rules, **knobs):
    return ExitConfig("all_of", rules=rules, **knobs).build_policy().bind(K)


def _described(policy) -> list[dict]:
    return [{"threshold": m.threshold, "above": not m.exits_below, "patience": m.patience} for m in policy.members]


@pytest.mark.parametrize("rules,knobs", [
    ([{"policy": "second_order", "threshold": 0.4}, {"policy": "confidence", "threshold": 0.5}], {}),
    ([{"policy": "first_order", "threshold": 0.6, "patience": 3}, {"policy": "argmax_stability", "threshold": 2}],
     {"patience": 2, "min_steps": 3}),
    ([{"policy": "margin", "threshold": 0.3}, {"policy": "kl", "threshold": 0.5},
      {"policy": "contraction", "threshold": 0.7}], {"patience": 1, "min_steps": 2, "max_steps": 9}),
])
def test_array_and_streaming_forms_equal_the_reference(rules, knobs):
    policy = _conjunction(rules, **knobs)
    rng = np.random.default_rng(1)
    values = rng.random((300, K, len(rules)))
    for i, m in enumerate(policy.members):
        if m.integer_threshold:
            values[:, :, i] = np.floor(values[:, :, i] * 5)
        values[rng.random((300, K)) < 0.05, i] = np.nan
        values[:, :m.defined_from - 1, i] = m.never
    values[rng.random((300, K)) < 0.03, -1] = np.inf
    want = [reference_exit(v, _described(policy), policy.patience, policy.min_steps, policy.max_steps)
            for v in values]
    assert policy.first_exits(values).tolist() == want
    assert [policy.first_exit([list(row) for row in v]) for v in values] == want
    assert len(set(want)) >= 4  # the cases spread their exits, so the comparison can fail


def test_a_conjunction_never_exits_before_any_of_its_rules_alone():
    rules = [{"policy": "second_order", "threshold": 0.5, "patience": 2}, {"policy": "confidence", "threshold": 0.4}]
    policy = _conjunction(rules, patience=2)
    rng = np.random.default_rng(2)
    values = rng.random((500, K, 2))
    values[:, 0, 0] = np.inf
    both = policy.first_exits(values)
    for i, m in enumerate(policy.members):
        alone = m.first_exits(values[:, :, i])
        assert np.all(both >= alone)
        assert np.any(both > alone)  # and the conjunction does hold some back


@pytest.fixture(scope="module")
def trajectories():
    model = tiny()
    eng = ExitEngine(model, ExitConfig(policy="fixed", threshold=K))
    import torch

    x = model.embed(torch.zeros(1, 1, dtype=torch.long))
    noise = eng.noise.rows(0, 1, x.dtype, x.device)[0]
    per_row = [direct_trajectory(model, [t], K, noise) for t in T0]
    return model, np.concatenate([st for st, _ in per_row]), np.concatenate([lp for _, lp in per_row])


# The peer's benchmark arm: a margin and an argmax run, with min_steps 2 and patience 2 over the conjunction.
PEER = [{"policy": "margin", "threshold": 0.1}, {"policy": "argmax_stability"}]


@pytest.mark.parametrize("threshold", [1, 2])
def test_engine_exits_are_the_reference_on_the_direct_signals(trajectories, threshold):
    model, states, logps = trajectories
    config = ExitConfig("all_of", rules=PEER, threshold=threshold, patience=2, min_steps=2, max_steps=K,
                        record_signals=True)
    policy = config.build_policy().bind(K)
    requests = [([T0[b], T1[b]], 1) for b in range(len(T0))]
    single = [ExitEngine(model, config).score([r])[0] for r in requests]
    batched = ExitEngine(model, config).score(requests)
    got = [r.records[0].exit_steps[0] for r in single]
    assert got == [r.records[0].exit_steps[0] for r in batched]  # batched equals batch size 1
    want = []
    for b in range(len(T0)):
        direct = np.stack([direct_signals(m["policy"], states[b], logps[b]) for m in PEER], -1)
        want.append(reference_exit(direct, _described(policy), 2, 2, K))
        recorded = np.array(single[b].records[0].signals[0], dtype=np.float64)[:got[b]]
        # each column is its member's own signal (margin: float64 log-probabilities, as test_policies' 1e-6)
        np.testing.assert_allclose(recorded, direct[:got[b]], rtol=1e-5, atol=1e-6)
    assert got == want and len(set(got)) >= 2
    # never before either rule alone, as each runs by itself in the engine
    for m in PEER:
        alone = ExitConfig(m["policy"], threshold=m.get("threshold", threshold), max_steps=K)
        steps = [r.records[0].exit_steps[0] for r in ExitEngine(model, alone).score(requests)]
        assert all(a >= s for a, s in zip(got, steps))


def test_depth_major_equals_token_major_and_recording_replays_the_engine(trajectories):
    model = tiny().double()  # float64: the two computations' batch shapes cannot move an exit at a threshold
    rules = [{"policy": "second_order", "threshold": 0.2}, {"policy": "first_order"}]
    config = ExitConfig("all_of", rules=rules, threshold=0.5, max_steps=K)
    requests = [([T0[b], *T0[:b], T1[b]], 1 + b) for b in range(len(T0))]  # one scored token each
    token = ExitEngine(model, config, schedule="token_major").score(requests, batch_size=2)
    auto_engine = ExitEngine(model, config)
    assert auto_engine.scoring_schedule == "depth_major"  # (both members decoding-free)
    auto = auto_engine.score(requests, batch_size=2)
    steps = [r.records[0].exit_steps[0] for r in token]
    assert steps == [r.records[0].exit_steps[0] for r in auto]
    assert len(set(steps)) >= 2
    policy = auto_engine.policies[0]
    recorder = Recorder(model, K, [policy], [], 0, auto_engine.readout_steps, oracle=False)
    trajs = recorder.record([Sequence_(t[:-1], n - 1, [t[n:]]) for t, n in requests])
    assert [int(policy.first_exits(t.signals[0][variant_key(policy)])[0]) for t in trajs] == steps


@pytest.mark.parametrize("bad,words", [
    ({}, ["all_of", "rules", "--exit-config"]),
    ({"rules": [{"policy": "kl"}]}, ["at least two"]),
    ({"rules": [{"policy": "kl"}, {"policy": "oracle"}]}, ["oracle", "cannot join"]),
    ({"rules": [{"policy": "kl"}, {"policy": "nope"}]}, ["'nope'", "valid:"]),
    ({"rules": [{"policy": "kl", "max_steps": 4}, {"policy": "margin"}]}, ["unknown knob 'max_steps'"]),
    ({"rules": [{"policy": "kl"}, {"policy": "margin"}], "vary": "cosine"}, ["vary", "'cosine'"]),
    ({"rules": [{"policy": "kl"}, {"policy": "argmax_stability"}], "vary": "argmax_stability", "threshold": 1.5},
     ["whole number"]),
    ({"rules": [{"policy": "kl"}, {"policy": "first_order", "relative": "yes"}]}, ["relative"]),
])
def test_bad_conjunctions_are_refused_in_one_line(bad, words):
    with pytest.raises(ExitbenchError) as err:
        ExitConfig("all_of", **bad)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_rules_belong_to_a_conjunction_only():
    with pytest.raises(ExitbenchError, match="rules and vary have no meaning for this policy"):
        ExitConfig("kl", rules=PEER)


def test_an_exit_config_file_sets_the_sweep_and_thresholds_vary_one_member(tmp_path):
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump({"policy": "all_of", "rules": PEER, "patience": 2, "min_steps": 2}))
    knobs = {"min_steps": 1, "patience": None}
    cfg = SweepConfig.from_options(RunOptions(exit_config=path), dict(knobs), given={"exit_config"})
    assert cfg.policies == ["all_of"] and cfg.exit["rules"] == PEER and cfg.exit["min_steps"] == 2
    configs = [c for c in grid(cfg, K) if c.policy == "all_of"]
    assert [c.threshold for c in configs] == list(REGISTRY["argmax_stability"].default_grid)  # the varied rule's
    assert all(c.build_policy().members[0].threshold == 0.1 for c in configs)  # the other one stays
    cfg = SweepConfig.from_options(RunOptions(exit_config=path, thresholds="1,3"), dict(knobs),
                                   given={"exit_config", "thresholds"})
    assert [c.threshold for c in grid(cfg, K) if c.policy == "all_of"] == [1, 3]
    with pytest.raises(ExitbenchError, match="min_steps is set both in exit config .* and by --min-steps"):
        SweepConfig.from_options(RunOptions(exit_config=path), {**knobs, "min_steps": 3},
                                 given={"exit_config", "min_steps"})


def test_lm_eval_model_args_take_an_exit_config_file(tmp_path):
    from exitbench.harness.cli import check_model_args
    from exitbench.harness.model import ExitbenchLM

    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump({"policy": "all_of", "rules": PEER, "threshold": 2}))
    check_model_args({"exit_config": str(path), "max_steps": 8})
    lm = ExitbenchLM(exit_config=str(path), max_steps=8)
    assert lm.engine.policies[0].variant == "all_of[margin,argmax_stability]"
    assert lm.engine.policies[0].members[1].threshold == 2
    with pytest.raises(ExitbenchError, match="threshold is set both in exit config"):
        check_model_args({"exit_config": str(path), "threshold": 3})


def test_a_learned_member_brings_its_exit_model_to_the_conjunction():
    """What keys a learned rule's cells, names its model in the cell and refuses it on another checkpoint is the
    conjunction's too (a run crashed after its baselines, and trace ran tiny-raven's model on the looped GPT-2)."""
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.policies.learned import check_fitted_for

    config = ExitConfig("all_of", rules=[{"policy": "learned"}, {"policy": "margin", "threshold": 0.1}],
                        exit_model=str(EXIT_MODEL))
    fitted = config.fitted_exit_model
    assert fitted is not None and config.key_dict()["exit_model"] == "sha256:" + fitted.digest
    policy = config.build_policy().bind(16)
    assert policy.model is fitted and policy.members[0].model is fitted  # the file read once
    # a policy's knobs make a config again (replay's cost model does): the file by its path
    assert policy.exit_model == str(EXIT_MODEL)
    assert ExitConfig("all_of", exit_model=policy.exit_model, rules=policy.rules).key_dict() == config.key_dict()
    check_fitted_for(open_checkpoint("tiny-raven"), fitted)
    with pytest.raises(ExitbenchError, match="was fitted on checkpoint"):
        check_fitted_for(open_checkpoint("tiny-looped-gpt2"), fitted)


def test_a_conjunction_reads_as_its_rules():
    policy = {"policy": "all_of", "threshold": 2, "rules": PEER, "relative": False}
    assert cells.series(policy) == "margin 0.1 ∧ argmax_stability"
    name = cells.filename({"policy": policy, "task": {"name": "chains"}, "cell_id": "abc"})
    assert name == "chains__margin_0.1_argmax_stability-2__abc.json"


def test_calibrate_chooses_the_varied_members_threshold(trajectories):
    from exitbench.studies.calibrate import calibrate

    model = trajectories[0]
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 30, size=12)) for _ in range(40)]
    config = ExitConfig("all_of", rules=PEER, patience=2, max_steps=K)
    report = calibrate(model, docs, config, [1, 2, 4], epsilon=0.5, delta=0.2, replay=True, batch_size=8)
    assert [r["threshold"] for r in report["thresholds"]] == [4, 2, 1]  # argmax runs: the longest is safest
    assert report["config"]["rules"] == PEER
    iters = [r["mean_iterations"] for r in report["thresholds"]]
    assert iters == sorted(iters, reverse=True) and not math.isclose(iters[0], iters[-1])


def test_a_gate_tells_conjunctions_apart_by_their_rules():
    from exitbench.analysis.check import identity

    def cell(rules, threshold):
        return {"policy": {"policy": "all_of", "threshold": threshold, "rules": rules},
                "task": {"name": "chains", "limit": 48}, "quality": {"metric": "exact_match,none"}}

    other = [{"policy": "margin", "threshold": 0.5}, {"policy": "argmax_stability"}]
    assert identity(cell(PEER, 2)) == identity(cell(PEER, 2.0))  # a threshold read back as 2.0 is the same one
    assert identity(cell(PEER, 2)) != identity(cell(other, 2))
