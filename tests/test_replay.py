"""Replay sweeps: exits from recorded signals equal the exact engine's wherever exits cannot interact.

- the vectorised exit rule equals `ExitPolicy.first_exit` on any trajectory (NaNs, patience, min/max steps);
- the recording pass equals the engine on one-token continuations (the prefix at full depth, one scored
  token), for latent, decoding and retrospective rules and for every fixed depth, in float64;
- a replay sweep's scoring cells (one-token continuations, multiple choice) equal an exact sweep's cells;
- generation replay cuts an answer at the first token whose exit prediction differs, and says so;
- `--verify` reruns the frontier exactly and `pareto` takes an exact cell over its replay twin;
- lm-eval's bootstrap in process draws the same resamples as its pool.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from exitbench.store import cells, loading
from exitbench.models.checkpoint import open_checkpoint
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.policies import REGISTRY
from exitbench.engine.recorder import Recorder, Sequence_, variant_key

from helpers.cells import load_cells
from helpers.cli import assert_one_line_error, run_cli, run_ok
from helpers.engine import knobs_for
from helpers.paths import GSM8K_DIR, REPO


def _policy(name: str, **knobs):
    return REGISTRY[name](**knobs).bind(16)


@pytest.mark.parametrize("name,knobs", [
    ("first_order", {"threshold": 0.3}), ("second_order", {"threshold": 0.3}),
    ("second_order", {"threshold": 0.5, "patience": 3, "min_steps": 4}), ("confidence", {"threshold": 0.6}),
    ("argmax_stability", {"threshold": 3}), ("kl", {"threshold": 0.2, "max_steps": 9}),
    ("contraction", {"threshold": 0.4, "patience": 2}), ("margin", {"threshold": 0.5, "min_steps": 3}),
])
def test_first_exits_equal_the_policy_rule(name, knobs):
    rng = np.random.default_rng(0)
    policy = _policy(name, **knobs)
    values = rng.random((200, 16)) * (5 if name == "argmax_stability" else 1)
    values[rng.random(values.shape) < 0.05] = np.nan  # NaN never hits
    values[:, :policy.defined_from - 1] = policy.never
    want = [policy.first_exit(list(row)) for row in values]
    assert policy.first_exits(values).tolist() == want


def _one_token_requests(ck, n: int = 6) -> list[tuple[list[int], int]]:
    docs = [json.loads(line) for line in (REPO / "tasks/chains/test.jsonl").read_text().splitlines()[:n]]
    out = []
    for d in docs:
        ctx = ck.tokenizer.encode(d["prompt"], add_bos=True)
        out.append((ctx + ck.tokenizer.encode(" " + d["answer"])[:1], len(ctx)))
    return out


@pytest.fixture(scope="module")
def tiny64():
    # float64, so that the two computations' different batch shapes cannot move an exit at a threshold.
    ck = open_checkpoint(None)
    ck.model.double()
    return ck


@pytest.mark.parametrize("name,tau", [("second_order", 1.0), ("first_order", 0.1), ("kl", 1e-3),
                                      ("entropy_diff", 1e-2), ("cosine", 1e-3), ("learned", 0.3), ("oracle", None)])
def test_recording_equals_the_engine_on_one_token_continuations(tiny64, name, tau):
    requests = _one_token_requests(tiny64)
    config = ExitConfig(name, **knobs_for(name)) if tau is None else ExitConfig(name, threshold=tau, **knobs_for(name))
    engine = ExitEngine(tiny64.model, config)
    exact = engine.score(requests, batch_size=4)
    policy = engine.policies[0]
    recorder = Recorder(tiny64.model, 16, [policy], [], 0, engine.readout_steps, oracle=policy.retrospective)
    trajs = recorder.record([Sequence_(t[:-1], n - 1, [t[n:]]) for t, n in requests])
    for res, traj in zip(exact, trajs):
        if policy.retrospective:
            steps = policy.exit_steps(torch.from_numpy(traj.top[0]), torch.from_numpy(traj.picked[0][0]),
                                      torch.ones(1, dtype=torch.bool)).numpy()
        else:
            steps = policy.first_exits(traj.signals[0][variant_key(policy)])
        assert steps.tolist() == [r.exit_steps[0] for r in res.records]
        # The recording reports float32 log-probabilities, as the engine's lm-eval answers are made.
        np.testing.assert_allclose(traj.quality[0][np.arange(len(steps)), steps - 1], res.logprobs, rtol=1e-6)


def test_recording_recomputes_every_fixed_depth_exactly(tiny64):
    requests = _one_token_requests(tiny64)
    recorder = Recorder(tiny64.model, 16, [], [1, 2, 4, 8], 0, [16], oracle=False)
    trajs = recorder.record([Sequence_(t[:-1], n - 1, [t[n:]]) for t, n in requests])
    for depth in (1, 2, 4, 8, 16):
        exact = ExitEngine(tiny64.model, ExitConfig("fixed", threshold=depth)).score(requests, batch_size=4)
        got = [float(t.fixed_picked[depth][0][0]) if depth < 16 else float(t.quality[0][0, -1]) for t in trajs]
        np.testing.assert_allclose(got, [r.logprobs[0] for r in exact], rtol=1e-6, err_msg=f"depth {depth}")


def _by_config(directory):
    out = {}
    for cell in load_cells(directory).values():
        p = cell["policy"]
        out[(cell["task"]["name"], p["policy"], p["threshold"])] = cell
    return out


@pytest.fixture(scope="module")
def replay_and_exact(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    common = ["--tasks", "chains,chains_mc,chains_lambada", "-p", "second_order", "-p", "kl", "-p", "oracle",
              "--thresholds", "0.01", "--baselines", "2,16", "--limit", "6"]
    run_ok(*common, "--out", str(root / "exact"))
    run_ok(*common, "--out", str(root / "replay"), "--replay")
    return _by_config(root / "exact"), _by_config(root / "replay"), root


def test_replay_scoring_cells_equal_exact_cells(replay_and_exact):
    exact, replay, _ = replay_and_exact
    assert set(exact) == set(replay)
    for key, cell in replay.items():
        assert cell["mode"] == "replay" and cell["key"]["mode"] == "replay"
        assert cell["wall_clock"]["estimated"] is True and cell["wall_clock"]["per_token_s"] > 0
        if key[0] == "chains":  # generation: checked below
            continue
        twin = exact[key]
        assert cell["cell_id"] != twin["cell_id"]
        assert cell["iterations"]["mean"] == twin["iterations"]["mean"], key
        assert cell["iterations"]["tokens"] == twin["iterations"]["tokens"], key
        # Quality through lm-eval's own metrics; float32 sums in another order move the last bits.
        for metric, value in twin["task"]["metrics"].items():
            assert cell["task"]["metrics"][metric] == pytest.approx(value, rel=1e-5), (key, metric)
        assert cell["flops"]["per_token"] == pytest.approx(twin["flops"]["per_token"], rel=1e-12)


def test_generation_replay_says_how_many_answers_it_cut(replay_and_exact):
    exact, replay, _ = replay_and_exact
    full = replay[("chains", "fixed", 16)]
    assert full["replay"]["generation"] == {"documents": 6, "diverged": 0}
    assert full["quality"]["value"] == exact[("chains", "fixed", 16)]["quality"]["value"]
    shallow = replay[("chains", "fixed", 2)]["replay"]["generation"]
    assert shallow["documents"] == 6 and shallow["diverged"] >= 1  # depth 2 cannot follow these programs


def test_verify_reruns_the_frontier_exactly_and_pareto_prefers_exact(replay_and_exact):
    _, _, root = replay_and_exact
    out = root / "replay"
    run_ok("--tasks", "chains,chains_mc,chains_lambada", "-p", "second_order", "-p", "kl", "-p", "oracle",
           "--thresholds", "0.01", "--baselines", "2,16", "--limit", "6", "--out", str(out), "--replay", "--verify")
    report = json.loads((out / "verify" / "replay-vs-exact.json").read_text())
    rows = report["rows"]
    assert rows and all(r["exact_cell"] != r["replay_cell"] for r in rows)
    for r in rows:
        if r["task"] != "chains":  # one-token continuations: replay is exact
            assert r["exit_agreement"] == 1.0 and r["quality_within_stderr"] and r["iterations_rel_diff"] == 0.0
    verified, others = cells.scan((out / "verify").glob("*.json"))
    assert [p.name for p in others] == ["replay-vs-exact.json"]
    assert len(verified) == len(rows) and all(c.get("mode", "exact") == "exact" for _, c in verified)
    loaded = loading.load([out])
    ids = {c["cell_id"] for c in loaded}
    assert {r["exact_cell"] for r in rows} <= ids and not ({r["replay_cell"] for r in rows} & ids)


def test_in_process_bootstrap_draws_the_pools_resamples(monkeypatch):
    from lm_eval.api.metrics import bootstrap_stderr, perplexity

    xs = list(np.random.default_rng(1).normal(-2.0, 0.5, 40))
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    pooled = bootstrap_stderr(perplexity, xs, iters=2000)
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    assert bootstrap_stderr(perplexity, xs, iters=2000) == pooled
    assert os.environ["DISABLE_MULTIPROC"] == "1"


def test_replay_on_three_loop_groups_and_rolling_windows(tmp_path):
    """tiny-looped-gpt2's perplexity task: every token scored (rolling windows), three loop groups. Full depth is
    recomputed exactly (each group fed the previous group's full depth); exits are replayed per group."""
    args = ["--checkpoint", "tiny-looped-gpt2", "--tasks", "gsm8k_text", "--data-dir", str(GSM8K_DIR), "-p",
            "second_order", "--thresholds", "1", "--limit", "2"]
    run_ok(*args, "--baselines", "4", "--out", str(tmp_path / "exact"))
    run_ok(*args, "--baselines", "4", "--out", str(tmp_path / "replay"), "--replay")
    exact, replay = _by_config(tmp_path / "exact"), _by_config(tmp_path / "replay")
    assert set(exact) == set(replay)
    full = ("gsm8k_text", "fixed", 4)
    assert replay[full]["replay"]["exact_by_construction"] is True
    for metric, value in exact[full]["task"]["metrics"].items():
        assert replay[full]["task"]["metrics"][metric] == pytest.approx(value, rel=1e-5), metric
    adaptive = replay[("gsm8k_text", "second_order", 1)]
    assert len(adaptive["iterations"]["per_group_mean"]) == 3
    assert adaptive["iterations"]["tokens"] == exact[("gsm8k_text", "second_order", 1)]["iterations"]["tokens"]


def test_replay_samples_carry_token_text_for_exit_maps(tmp_path):
    run_ok("--tasks", "chains,chains_lambada", "-p", "second_order", "--thresholds", "1", "--baselines", "16",
           "--limit", "3", "--out", str(tmp_path), "--replay", "--log-samples")
    samples = [json.loads(line) for f in tmp_path.glob("*.samples.jsonl") for line in f.read_text().splitlines()]
    assert samples
    for s in samples:
        ex = s["exitbench"]
        assert len(ex["token_text"]) == len(ex["exit_steps"]) == len(ex["logprobs"]) == len(ex["greedy"]) > 0


@pytest.mark.parametrize("args,words", [
    (["--verify"], ["--verify", "--replay"]),
    (["--replay", "--shard", "0/2"], ["--replay", "one process"]),
    (["--replay", "--prefill", "exit"], ["--replay", "prefill"]),
    (["--replay", "--verify-cells", "kl"], ["--verify-cells", "policy:threshold"]),
])
def test_replay_refusals_are_one_line(tmp_path, args, words):
    res, _ = run_cli("--tasks", "chains_lambada", "--limit", "2", "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(res, words)
    assert not list((tmp_path / "out").glob("*.json"))  # refused before any cell was computed
