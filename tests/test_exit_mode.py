"""Exit mode `select` beside the default `physical`: every token runs every iteration and the rule only picks
which iteration's output is read (what Ouro's own code and paper measure), against an exited token stopping."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.engine import knobs_for, mixed_requests, tiny
from safetensors.torch import load_file

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.models.checkpoint import load_checkpoint
from exitbench.policies import REGISTRY
from exitbench.store.cells import series
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.keys import cell_key

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def ouro():
    return load_checkpoint(FIXTURES / "ouro-tiny").model


@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
def test_select_reproduces_the_reference_qexit_steps_and_logits(ouro, schedule):
    """The reference runs all T steps for every token and reads the step Q-exit picks: `select` exactly."""
    ref = load_file(str(FIXTURES / "ouro-tiny-reference.safetensors"))
    ids = ref["input_ids"]
    logp = torch.log_softmax(ref["step_logits"].double(), -1)
    for q, want in zip(ref["qexit_q"].tolist(), ref["qexit_steps"]):
        engine = ExitEngine(ouro, ExitConfig("qexit", threshold=q, exit_mode="select"), schedule=schedule)
        results = engine.score([(row.tolist(), 1) for row in ids], batch_size=2)
        for b, res in enumerate(results):
            steps = want[b, :-1]
            assert res.iterations == steps.tolist()
            expected = logp[b, torch.arange(len(steps)), steps - 1].gather(-1, ids[b, 1:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)


def test_physical_and_select_agree_where_nothing_exits_early_and_differ_where_it_does(ouro):
    requests = [(r, 1) for r, _ in mixed_requests(4, seed=3, vocab=ouro.output_size, min_len=6, max_len=12)]
    full = {m: ExitEngine(ouro, ExitConfig("fixed", exit_mode=m)).score(requests) for m in ("physical", "select")}
    assert [r.logprobs for r in full["physical"]] == [r.logprobs for r in full["select"]]
    early = {m: ExitEngine(ouro, ExitConfig("qexit", threshold=0.3, exit_mode=m)).score(requests)
             for m in ("physical", "select")}
    first = [(a.logprobs[0], b.logprobs[0]) for a, b in zip(early["physical"], early["select"])]
    assert all(abs(a - b) < 1e-5 for a, b in first)  # the first scored token reads only full-depth prompt entries
    later = np.concatenate([np.abs(np.subtract(a.logprobs, b.logprobs)) for a, b in zip(*early.values())])
    assert later.max() > 1e-4  # a later token reads early exits' entries only under physical
    # Iterations are the chosen ones in both; FLOPs are what ran: all K under select.
    flops = {m: sum(sum(r.flops.values()) for res in runs for r in res.records) for m, runs in early.items()}
    full_flops = sum(sum(r.flops.values()) for res in full["select"] for r in res.records)
    assert flops["physical"] < flops["select"] == pytest.approx(full_flops)


CASES = ["huginn-layout", "ouro"]
# Fast: a latent rule, a decoding one, fixed depth and the trained gate; the rest of the roster with the slow tests.
FAST = {"second_order", "kl", "fixed", "qexit"}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("policy", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in REGISTRY])
def test_select_runs_every_policy_batched_equal_to_one_at_a_time(case, policy, ouro):
    model = tiny(init_scale=1.0) if case == "huginn-layout" else ouro
    if REGISTRY[policy].needs_gate and not model.gated:
        pytest.skip("gate rules need a trained gate")
    requests = mixed_requests(5, seed=11, vocab=model.output_size if case == "ouro" else 100, min_len=3, max_len=10)
    tau = {"fixed": 2, "argmax_stability": 2}.get(policy)
    knobs = {**knobs_for(policy), "max_steps": 4, "exit_mode": "select", **({"threshold": tau} if tau else {})}
    engine = ExitEngine(model, ExitConfig(policy, **knobs))
    solo = [engine.score([r], batch_size=1)[0] for r in requests]
    together = engine.score(requests, batch_size=3)
    for a, b in zip(solo, together):
        assert a.iterations == b.iterations and all(1 <= k <= 4 for k in a.iterations)
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-6, atol=1e-5)
    # Every token ran every iteration: as many loop steps as fixed depth, on the same (token-major) schedule.
    if REGISTRY[policy].signal_free:  # fixed r sets the depth itself
        return
    steps = {}
    for name, cfg in (("rule", ExitConfig(policy, **knobs)), ("fixed", ExitConfig("fixed", threshold=4))):
        run = ExitEngine(model, cfg, schedule="token_major")
        run.score(requests, batch_size=3)
        steps[name] = run.stats["steps"]
    assert steps["rule"] == steps["fixed"]


def test_exit_mode_is_in_a_cell_key_only_when_select_and_names_its_own_series():
    cfg = SweepConfig(tasks=["chains"], policies=["kl"])
    plain = {"fingerprint": "f" * 16, "dtype": "float32"}
    physical = cell_key(plain, "chains", "t", ExitConfig("kl", exit_mode="physical"), cfg, "cpu")
    assert physical == cell_key(plain, "chains", "t", ExitConfig("kl"), cfg, "cpu")  # old cells keep their ids
    select = cell_key(plain, "chains", "t", ExitConfig("kl", exit_mode="select"), cfg, "cpu")
    assert select != physical
    assert series({"policy": "qexit", "exit_mode": "select"}) == "qexit-select"
    assert series({"policy": "qexit"}) == "qexit"


def test_a_bad_exit_mode_is_one_line():
    with pytest.raises(ExitbenchError, match="exit_mode must be 'physical', 'select' or 'weighted', got 'run_all'"):
        ExitConfig("kl", exit_mode="run_all")


@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
def test_weighted_reads_the_logits_averaged_under_the_gate_distribution(ouro, schedule):
    """Ouro's use_weighted_exit: Σ_t p_t · logits_t with p_t = λ_t ∏_{j<t}(1 − λ_j), p_T the rest: the reference's
    own output (recorded with its early_exit_threshold unset, which otherwise silently wins)."""
    ref = load_file(str(FIXTURES / "ouro-tiny-reference.safetensors"))
    ids = ref["input_ids"]
    mixture = torch.log_softmax(ref["weighted_logits"].double(), -1)
    engine = ExitEngine(ouro, ExitConfig("fixed", exit_mode="weighted"), schedule=schedule)
    for b, res in enumerate(engine.score([(row.tolist(), 1) for row in ids], batch_size=2)):
        expected = mixture[b, :-1].gather(-1, ids[b, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4, rtol=0)
        assert res.iterations == [4] * len(res.iterations)


def test_weighted_needs_fixed_depth_and_a_gated_model():
    with pytest.raises(ExitbenchError, match="exit_mode weighted .* use --policy fixed"):
        ExitConfig("qexit", exit_mode="weighted")
    with pytest.raises(ExitbenchError, match="exit_mode weighted averages .* no such group"):
        ExitEngine(tiny(init_scale=1.0), ExitConfig("fixed", exit_mode="weighted"))
