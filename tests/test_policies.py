"""Every exit policy against its formula, recomputed directly from a trajectory of the model, and the exit
rule (threshold, min_steps, patience) against a plain loop over those direct signals. The knobs' own checks:
tests/test_exit_config.py."""
from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.policies import policy_names

from helpers.engine import (ALL_POLICIES, EXITS_ABOVE, INTEGER_THRESHOLD, RELATIVE, assert_signals_close,
                            direct_signals, direct_trajectory, engine, expected_exit, oracle_exit, tiny)

K = 12
T0 = [5, 23, 42, 77, 91]      # tokens at position 0, one per row
T1 = [7, 11, 13, 17, 19]      # their scored targets
RTOL = 1e-5
# Absolute slack on top of the relative tolerance.
# - Distribution rules: the engine sums in float32, the direct formula in float64, and these signals are small
#   differences of terms of size ~1 (a KL of 1e-6 sums p·(log p − log q) with |log p| ≈ 4.6), so float32
#   rounding alone moves them by ~1e-7 … 1e-6.
# - Latent step rules: the states themselves depend on the batch shape at the ulp level (a matmul over 5
#   rows rounds differently from one over 1 row, and rows leave the batch as they exit): ~1e-6 absolute in
#   a state of norm ~5, which a step ‖Δ_k‖ of 1e-2 inherits.
# - The learned rule reads logs of those step norms: the ~1e-6 state difference is ~1e-4 of the log of a late
#   step of ~1e-2, and the test model moves the risk by at most 0.25 · 1.5 per unit of log step (sigmoid slope
#   times its weight on log_step): a few 1e-5 (measured up to 3.6e-5 here).
# - Contraction divides two step norms that each carry that ~1e-6: ~1e-4 relative in r̂ for steps of ~1e-2,
#   which r̂/(1 − r̂) amplifies a few times; the signal (‖Δ‖/‖s‖ times that, ≤ ~2 here) moves by ~1e-6
#   (measured up to 9e-7).
# - Margin is a difference of two float64 log-probabilities of float32 logits, as confidence reads one.
ATOL = {"kl": 1e-6, "minp_kl": 1e-6, "entropy_diff": 4e-6, "cosine": 5e-7, "confidence": 1e-7,
        "first_order": 1e-5, "second_order": 2e-5, "second_order_magnitude": 2e-5, "learned": 1e-4,
        "contraction": 5e-6, "margin": 1e-6}


def atol(policy, relative=False):
    return ATOL.get(policy, 0.0) / (4.0 if relative else 1.0)


VARIANTS = [(p, False) for p in ALL_POLICIES if p != "oracle"] + [(p, True) for p in sorted(RELATIVE)]


# Rules over a trained exit gate run on Ouro only: tests/test_ouro.py.
GATE_POLICIES = ["qexit", "gate"]


def test_registry_is_what_these_tests_cover():
    # (the conjunction combines the rules above: tests/test_conjunction.py; the budgeted prefill exits rank a
    # sequence's positions, not a token's trajectory: tests/test_prefill_budget.py; depth speculation is no exit
    # rule: tests/test_speculation.py)
    assert sorted(policy_names()) == sorted(ALL_POLICIES + GATE_POLICIES
                                            + ["all_of", "prefill_topk", "prefill_random", "speculate"])


@functools.lru_cache(maxsize=None)
def _trajectories(init_scale):
    """A tiny Raven, and the direct trajectory of each T0 token alone at position 0."""
    model = tiny(init_scale=init_scale)
    eng = ExitEngine(model, ExitConfig(policy="fixed", threshold=K))
    x = model.embed(torch.zeros(1, 1, dtype=torch.long))
    noise = eng.noise.rows(0, 1, x.dtype, x.device)[0] if init_scale > 0 else None
    per_row = [direct_trajectory(model, [t], K, noise) for t in T0]  # each alone: batch size 1
    states = np.concatenate([st for st, _ in per_row])
    logps = np.concatenate([lp for _, lp in per_row])
    if init_scale == 0:
        assert np.all(states[:, 0] == 0)
    else:
        assert np.all(np.linalg.norm(states[:, 0], axis=-1) > 0.1)
    return model, states, logps


@pytest.fixture(scope="module", params=[1.0, 0.0], ids=["noise", "zero_init"])
def both_inits(request):
    return _trajectories(request.param)


@pytest.fixture(scope="module")
def setup():
    """The model with random initial states (init_scale = 1, the engine's position-0 noise)."""
    return _trajectories(1.0)


def run(model, rows, policy, **knobs):
    """Score each chosen row's T1 after its T0 (one request per row) in one call; one record per row."""
    res = engine(model, policy, max_steps=knobs.pop("max_steps", K), **knobs).score(
        [([T0[b], T1[b]], 1) for b in rows])
    for r in res:
        assert len(r.records) == 1 and r.records[0].position == 0
    return res


def never_fires(policy):
    if policy == "fixed":
        return K
    if policy == "argmax_stability":
        return 10 ** 6
    if policy == "confidence":
        return 1.0
    if policy == "margin":  # a gap of log-probabilities: unbounded
        return 1e9
    return 1e-30


MODES = [pytest.param("single", id="single"), pytest.param("batched", id="batched")]
# Every rule runs batched in the fast suite, each row against its own trajectory computed alone; one row per call
# ("single") only for a latent and a decoding rule there, the others with the slow tests (batching never changes
# an exit: tests/test_engine.py).
SINGLE_FAST = {"first_order", "kl"}
MODE_VARIANTS = [pytest.param(m, p, r, id=f"{p}{'-relative' if r else ''}-{m}",
                              marks=() if m == "batched" or (p in SINGLE_FAST and not r) else pytest.mark.slow)
                 for p, r in VARIANTS for m in ("single", "batched")]


def row_groups(mode, monkeypatch):
    return [list(range(len(T0)))] if mode == "batched" else [[b] for b in range(len(T0))]


@pytest.mark.parametrize("mode,policy,relative", MODE_VARIANTS)
def test_recorded_signals_match_direct_formula(both_inits, policy, relative, mode, monkeypatch):
    model, states, logps = both_inits
    groups = row_groups(mode, monkeypatch)
    for rows in groups:
        res = run(model, rows, policy, threshold=never_fires(policy), relative=relative)
        for b, r in zip(rows, res):
            want = direct_signals(policy, states[b], logps[b], relative)
            rec = r.records[0]
            e = rec.exit_steps[0]
            assert e == expected_exit(want, never_fires(policy), policy in EXITS_ABOVE, 1, 1, K)
            assert len(rec.signals) == 1 and len(rec.signals[0]) == K
            assert_signals_close(rec.signals[0], want, e, RTOL, atol(policy, relative), f"{policy} row {b}")
            # The scored log-prob is the readout at the exit state.
            assert r.logprobs[0] == pytest.approx(logps[b, e - 1, T1[b]], rel=1e-5, abs=1e-5)
            assert r.greedy[0] == (int(np.argmax(logps[b, e - 1])) == T1[b])


# ---- the exit rule --------------------------------------------------------------------------------------

def _candidates(policy, relative, rows_signals):
    """Thresholds well away from every direct signal value (so float32-vs-float64 differences cannot flip a
    comparison), between consecutive observed values."""
    if policy in INTEGER_THRESHOLD:
        top = int(max(np.nanmax(s[np.isfinite(s)]) for s in rows_signals))
        return list(range(1, top + 1))
    vals = np.unique(np.concatenate([s[np.isfinite(s)] for s in rows_signals]))
    slack = atol(policy, relative)
    out = []
    for a, b in zip(vals[:-1], vals[1:]):
        tau = (a + b) / 2
        if tau <= 100 * slack or tau <= 0:
            continue
        if min(abs(vals - tau)) > max(1e-4 * abs(tau), 20 * slack):
            out.append(float(tau))
    return out


def _combos(policy, relative, rows_signals):
    """(threshold, min_steps, patience) cases from the signals of the first row that offers them: two
    thresholds exiting at different steps, the first one delayed by min_steps, and by patience. (The margin
    of row 0 already clears every threshold it ever clears at k = 1.)"""
    above = policy in EXITS_ABOVE
    if policy == "fixed":
        return [(1, 1, 1), (4, 1, 1), (4, 4, 3), (7, 2, 1), (K, 1, 1)]
    for sig in rows_signals:
        by_exit = {}
        for tau in _candidates(policy, relative, rows_signals):
            e = expected_exit(sig, tau, above, 1, 1, K)
            if 2 <= e <= K - 4:
                by_exit.setdefault(e, tau)
        if len(by_exit) >= 2:
            break
    assert len(by_exit) >= 2, f"{policy}: the trajectory offers too few distinct exits: {by_exit}"
    exits = sorted(by_exit)
    ea, eb = exits[0], exits[-1]
    ta, tb = by_exit[ea], by_exit[eb]
    combos = [(ta, 1, 1), (tb, 1, 1), (ta, ea + 2, 1), (ta, 1, 2), (tb, 2, 3)]
    # The cases do what they are meant to: min_steps and patience each delay the exit of (ta, 1, 1).
    assert expected_exit(sig, ta, above, ea + 2, 1, K) > ea
    assert expected_exit(sig, ta, above, 1, 2, K) > ea
    return combos


@pytest.mark.parametrize("mode,policy,relative", MODE_VARIANTS)
def test_exit_step_is_first_step_where_rule_holds(setup, policy, relative, mode, monkeypatch):
    model, states, logps = setup
    rows_signals = [direct_signals(policy, states[b], logps[b], relative) for b in range(len(T0))]
    above = policy in EXITS_ABOVE
    groups = row_groups(mode, monkeypatch)
    seen = set()
    for tau, min_steps, patience in _combos(policy, relative, rows_signals):
        depth = int(tau) if policy == "fixed" else K
        for rows in groups:
            res = run(model, rows, policy, threshold=tau, min_steps=min_steps, patience=patience,
                      relative=relative)
            for b, r in zip(rows, res):
                want = expected_exit(rows_signals[b], tau, above, min_steps, patience, depth)
                rec = r.records[0]
                assert rec.exit_steps == [want], (policy, tau, min_steps, patience, b)
                seen.add(want)
                if policy != "fixed":
                    assert_signals_close(rec.signals[0], rows_signals[b], want, RTOL, atol(policy, relative),
                                         f"{policy} τ={tau} row {b}")
                assert r.logprobs[0] == pytest.approx(logps[b, want - 1, T1[b]], rel=1e-5, abs=1e-5)
    assert len(seen) >= 3, f"{policy}: exits should land at different steps, got {sorted(seen)}"


def test_fixed_ignores_max_steps_and_runs_r(setup):
    model, states, logps = setup
    for r, max_steps in [(3, K), (5, 2)]:
        res = run(model, [0], "fixed", threshold=r, max_steps=max_steps)
        assert res[0].records[0].exit_steps == [r]
        assert res[0].logprobs[0] == pytest.approx(logps[0, r - 1, T1[0]], rel=1e-5, abs=1e-5)


# ---- the oracle -------------------------------------------------------------------------------------------

def _oracle_eps(logps):
    """ε values between the observed gaps log p_K(target) − log p_j(target), so exits land at different k."""
    gaps = sorted({float(logps[b, K - 1, T1[b]] - logps[b, j, T1[b]]) for b in range(len(T0)) for j in range(K)})
    gaps = [g for g in gaps if g > 0]
    mids = [(a + b) / 2 for a, b in zip(gaps[:-1], gaps[1:]) if b - a > 1e-4 * b]
    return [mids[0], mids[len(mids) // 3], mids[2 * len(mids) // 3], mids[-1]]


@pytest.mark.parametrize("mode", [pytest.param("single", marks=pytest.mark.slow), "batched"])
def test_oracle_scoring_exit(both_inits, mode):
    model, states, logps = both_inits
    groups = [[b] for b in range(len(T0))] if mode == "single" else [list(range(len(T0)))]
    seen = set()
    for eps in _oracle_eps(logps):
        for min_steps in (1, 6):
            for rows in groups:
                res = run(model, rows, "oracle", threshold=eps, min_steps=min_steps)
                for b, r in zip(rows, res):
                    want = oracle_exit(logps[b], T1[b], eps, min_steps)
                    assert r.records[0].exit_steps == [want], (eps, min_steps, b)
                    assert r.logprobs[0] == pytest.approx(logps[b, want - 1, T1[b]], rel=1e-5, abs=1e-5)
                    seen.add((min_steps, want))
    assert len({e for m, e in seen if m == 1}) >= 3, f"oracle exits should vary: {sorted(seen)}"
    # min_steps raised at least one exit.
    assert any(e == 6 for m, e in seen if m == 6) and any(e < 6 for m, e in seen if m == 1)


@pytest.mark.parametrize("mode", MODES)
def test_oracle_generation_exit(setup, mode):
    model, states, logps = setup
    groups = [[b] for b in range(len(T0))] if mode == "single" else [list(range(len(T0)))]
    exits = []
    for rows in groups:
        eng = engine(model, "oracle", threshold=1e-2, max_steps=K)
        res = eng.generate([[T0[b]] for b in rows], max_new_tokens=1)
        for b, r in zip(rows, res):
            want = oracle_exit(logps[b], None, 1e-2)
            assert r.records[0].exit_steps == [want]
            assert r.tokens == [int(np.argmax(logps[b, K - 1]))]
            exits.append(want)
    # The direct computation itself: an argmax that changes late gives a late exit.
    for b in range(len(T0)):
        top = logps[b].argmax(-1)
        e = oracle_exit(logps[b], None, 1e-2)
        assert all(top[j] == top[-1] for j in range(e - 1, K))
        assert e == 1 or top[e - 2] != top[-1]


def test_contraction_counts_the_tokens_still_not_contracting_at_the_cap():
    """A token that reaches max_steps with r̂ ≥ 1 is flagged (its last signal is +inf); the cell counts them, and a
    recording of the same tokens flags the same ones."""
    from exitbench.engine.recorder import Recorder, Sequence_
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.store.cells import request_stats
    from exitbench.sweep.replay.lm import ReplayLM

    from helpers.paths import REPO

    ck = open_checkpoint(None)
    docs = [json.loads(line) for line in (REPO / "tasks/chains/test.jsonl").read_text().splitlines()[:20]]
    requests = []
    for d in docs:
        ctx = ck.tokenizer.encode(d["prompt"], add_bos=True)
        requests.append((ctx + ck.tokenizer.encode(" " + d["answer"])[:1], len(ctx)))
    config = ExitConfig("contraction", threshold=1e-12, max_steps=6, record_signals=True)  # no token exits early
    eng = ExitEngine(ck.model, config)
    records = [r for res in eng.score(requests, batch_size=4) for r in res.records]
    stalled = [r.stalled for r in records]
    assert stalled == [r.signals[0][-1] == math.inf for r in records]
    assert 0 < sum(stalled) < len(stalled)  # the tiny model leaves some tokens still expanding at 6 steps
    assert request_stats(records, 1.0)["nonconverging"] == sum(stalled)
    assert "nonconverging" not in request_stats(engine(tiny(), "first_order", max_steps=4).score([([1, 2], 1)])[0]
                                                .records, 1.0)  # a rule without the measure says nothing
    policy = eng.policies[0]
    trajs = Recorder(ck.model, 6, [policy], [], 0, eng.readout_steps, oracle=False).record(
        [Sequence_(t[:-1], n - 1, [t[n:]]) for t, n in requests])
    replay = ReplayLM.__new__(ReplayLM)
    replay.policies = [policy]
    assert [replay._stalled(t, 0, [6]) for t in trajs] == stalled


# ---- how early a rule can exit, by its definition: what refuses a rule that cannot and marks one that barely can --

def _most_favourable(policy, K: int) -> np.ndarray:
    """The signal that hits at every iteration the rule lets it (an argmax that never changes, a zero step, a
    certain readout), as `defined` reads it: (1, K), or (1, K, members) for a conjunction."""
    def column(rule):
        raw = [float(k - 1) if rule.name == "argmax_stability" else (0.0 if rule.exits_below else 1e9)
               for k in range(1, K + 1)]
        return [rule.defined(k, v) for k, v in zip(range(1, K + 1), raw)]
    members = getattr(policy, "members", None)
    if members:
        return np.array([list(zip(*(column(m) for m in members)))], dtype=float)
    return np.array([column(policy)], dtype=float)


RULES = [p for p in ALL_POLICIES if p not in ("fixed", "oracle")]


REACH_CASES = [(p, k) for p in RULES for k in ({}, {"patience": 3}, {"min_steps": 5})] + [
    ("argmax_stability", {"threshold": 4}), ("argmax_stability", {"threshold": 2, "patience": 2}),
    ("all_of", {"rules": [{"policy": "argmax_stability", "patience": 2}, {"policy": "second_order"}], "threshold": 3,
                "patience": 2}),
    ("all_of", {"rules": [{"policy": "kl", "min_steps": 6}, {"policy": "margin"}]})]


@pytest.mark.parametrize("policy,knobs", REACH_CASES)
def test_earliest_exit_is_where_the_rule_first_exits_on_its_most_favourable_signal(policy, knobs):
    from helpers.engine import knobs_for

    K = 20
    rule = ExitConfig(policy, **{**knobs_for(policy), **knobs}).build_policy().bind(K)
    assert rule.first_exits(_most_favourable(rule, K))[0] == rule.earliest_exit
    assert rule.first_exit(list(_most_favourable(rule, K)[0])) == rule.earliest_exit  # the streaming form too


@pytest.mark.parametrize("policy,knobs,depth,earliest,late", [
    ("second_order", {}, 2, 3, True), ("contraction", {}, 2, 2, True),      # a two-loop model: neither can exit
    ("contraction", {}, 3, 2, True), ("second_order", {}, 3, 3, True),      # three passes (Inkling)
    ("kl", {}, 2, 1, False), ("first_order", {}, 3, 1, False),               # as early as any rule can
    ("second_order", {}, 16, 3, False), ("second_order", {"patience": 17}, 16, 18, True),
    ("argmax_stability", {"threshold": 14}, 16, 15, True), ("argmax_stability", {"threshold": 15}, 16, 16, True),
    ("argmax_stability", {"threshold": 12}, 16, 13, False), ("kl", {}, 1, 1, False)])
def test_a_rule_that_can_exit_only_late_is_marked_and_one_that_never_can_is_named(policy, knobs, depth, earliest,
                                                                                   late):
    rule = ExitConfig(policy, **knobs).build_policy().bind(depth)
    assert rule.exit_reach() == {"earliest_exit": earliest, **({"late_exit": True} if late else {})}
    why = rule.never_exits_early(capped=False, limit=32)
    assert (why is None) == (earliest < depth)
    if why is not None:
        assert "\n" not in why and (f"iteration {earliest}" in why or "nothing to save" in why), why
