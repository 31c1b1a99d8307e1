"""Depth-major scoring (exitbench.engine.waves) gives the token-major schedule's answers.

Every policy of the roster runs through both schedules on three models: a random Raven of Huginn-0125's
layout (prelude, a 4-layer core, coda: tests/helpers/models.py), the embedded tiny-raven (no coda, so even the
decoding rules run depth-major) and the embedded tiny-looped-gpt2 (three loop groups between attention
layers). Exits must be identical and log-probabilities equal within LOGP_TOL + LOGP_RTOL · |log p|: the two
schedules run the same arithmetic on differently shaped batches (a wave's token-mode attention over a masked
block against one token's), so float32 results may differ in the last bits (LOGP_RTOL says how many);
thresholds are placed in wide gaps of the observed signals (helpers.engine.spread_threshold), away from where
rounding decides an exit.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from helpers.engine import (EXITS_ABOVE, LOGP_TOL, exit_steps, knobs_for, mixed_requests, spread_threshold, tiny,
                            varied)

from exitbench.engine import ExitConfig, ExitEngine, waves
from exitbench.errors import ExitbenchError
from exitbench.models import checkpoint
from exitbench.policies import REGISTRY

K = 8
# Relative part of the log-probability tolerance. A log-probability is a logit minus a log-sum-exp, both about
# its own size, each summed over the hidden width in an order the batch shape and the CPU's kernels set, and
# eight loop steps amplify that rounding. Measured worst case over every model and policy here: 1.4e-5 absolute
# at -20 on earlier sessions' CPU (7e-7 relative), 3.0e-5 at -5.1 on an AVX-512 one (AMD EPYC, Zen 4: 5.8e-6 relative,
# about 50 float32 ulps; the random ouro-layout fixture). 2e-5 is 3.5 times that, and 35 times below what one
# iteration more moves a log-probability on these fixtures (7e-4 relative at least, 0.09-0.16 at the median).
LOGP_RTOL = 2e-5


MODELS = ["huginn-layout", "tiny-raven", "tiny-looped-gpt2", "ouro-layout", "retrofit-llama", "nanbeige", "hrm-text"]
FIXTURE_OF = {"ouro-layout": "ouro-tiny", "retrofit-llama": "retrofit-llama-tiny", "nanbeige": "nanbeige-tiny",
              "hrm-text": "hrm-text-tiny"}
# The fast suite runs a rule of each kind on the Ouro layout (norm + head readout and a trained-gate stand-in, so
# every rule runs depth-major there): latent, decoding, fixed and gate; and on every model a decoding-free rule and
# a decoding one (whose readout reads other tokens through the other models' codas or later loop groups). The whole
# matrix (every rule on every model) is slow.
FAST_CASES = ({("ouro-layout", p) for p in ("second_order", "kl", "fixed", "qexit")}
              | {(m, p) for m in MODELS for p in ("second_order", "kl") if m != "hrm-text"})
# (HRM-Text's H cycle is eight stack calls, the priciest step here: tests/test_hrm_text.py runs both schedules on
# it fast, this matrix runs them slow.)


@functools.cache
def _model_case(name: str):
    if name == "huginn-layout":
        model, vocab = tiny(init_scale=1.0), 100
    elif name in FIXTURE_OF:
        model = checkpoint.load_checkpoint(Path(__file__).parent / "fixtures" / FIXTURE_OF[name]).model.eval()
        vocab = model.output_size
    else:
        model = checkpoint.open_checkpoint(name).model.eval()
        vocab = model.output_size
    return name, model, mixed_requests(8, seed=5, vocab=vocab, min_len=3, max_len=14)


def _engine(model, policy: str, schedule: str = "auto", **knobs) -> ExitEngine:
    knobs = {**knobs_for(policy), "record_signals": True, "max_steps": K, **knobs}
    return ExitEngine(model, ExitConfig(policy, **knobs), schedule=schedule)


def _threshold(model, requests, policy: str) -> dict:
    if policy == "fixed":
        return {"threshold": K // 2}
    if REGISTRY[policy].retrospective:
        return {}
    if REGISTRY[policy].integer_threshold:  # iterations of a stable argmax: a count, no rounding at stake
        return {"threshold": 2}
    if REGISTRY[policy].takes_rules:  # a conjunction's τ is its varied rule's
        return _threshold(model, requests, varied(policy))
    # (confidence: a probability, never above 1; margin: a gap of log-probabilities, unbounded)
    never = (1e9 if policy == "margin" else 1.0) if policy in EXITS_ABOVE else 1e-30
    probe = _engine(model, policy, schedule="token_major", threshold=never).score(requests)
    patience = REGISTRY[policy].default_patience
    return {"threshold": spread_threshold(probe, policy, K, 1, patience)}


# Rules whose signal is a gap of log-probabilities (the conjunction's members include margin).
GAP_SIGNALS = ("margin", "all_of")


def _same(a, b, gaps: bool = False, rtol: float = 1e-4) -> None:
    assert exit_steps(a) == exit_steps(b)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.greedy == y.greedy
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=LOGP_RTOL, atol=LOGP_TOL)
        # A signal that is a difference of log-probabilities (margin's gap between the first and second choice)
        # keeps their absolute rounding, not a share of itself: near a tie it is a few hundredths, while each
        # log-probability may differ by LOGP_TOL + LOGP_RTOL · |log p| between the schedules. On an AMD EPYC
        # tiny-raven's margin of 0.0131 came out 1.6e-5 apart with log-probabilities near −13.
        gap = 2 * (LOGP_TOL + LOGP_RTOL * max((abs(v) for v in x.logprobs), default=0.0)) if gaps else 0.0
        for rx, ry in zip(x.records, y.records):
            for sx, sy in zip(rx.signals, ry.signals):
                np.testing.assert_allclose(sx, sy, rtol=rtol, atol=max(1e-5, gap))


@pytest.mark.parametrize("name,policy", [
    pytest.param(m, p, id=f"{m}-{p}", marks=() if (m, p) in FAST_CASES else pytest.mark.slow)
    for m in MODELS for p in REGISTRY])
def test_both_schedules_give_the_same_exits_and_log_probabilities(name, policy):
    _, model, requests = _model_case(name)
    cls = REGISTRY[policy]
    if cls.needs_gate and not model.gated:
        pytest.skip("a gate rule needs a trained exit gate (refused in one line: tests/test_ouro.py)")
    if cls.drafts:  # depth speculation is no per-token exit: no exit engine runs it (tests/test_speculation.py)
        with pytest.raises(ExitbenchError, match="no per-token exit"):
            _engine(model, policy, threshold=1)
        return
    if cls.ranks_positions and model.prefix_lm:  # its prompt is one bidirectional block: no prompt runs with exits
        with pytest.raises(ExitbenchError, match="bidirectional block"):
            _engine(model, policy, threshold=0.25)
        return
    auto = _engine(model, policy, **({"threshold": K // 2} if policy == "fixed" else {}))
    blocker = waves.depth_major_blocker(auto)
    if cls.retrospective:
        assert blocker and "settles" in blocker and auto.scoring_schedule == "token_major"
        return
    if cls.ranks_positions:  # a budget over a sequence's positions needs them together: depth-major only
        assert blocker is None and auto.scoring_schedule == "depth_major"
        with pytest.raises(ExitbenchError, match="only the depth-major schedule"):
            _engine(model, policy, "token_major", threshold=0.25)
        return
    # Every rule but the oracle runs depth-major: a decoding rule reading out through a coda or later loop groups
    # too, in its probe's own world on both schedules (engine/probe_cache.py).
    assert blocker is None and auto.scoring_schedule == "depth_major"
    knobs = _threshold(model, requests, policy)
    token, auto = _engine(model, policy, "token_major", **knobs), _engine(model, policy, **knobs)
    # contraction's signal divides by 1 − r̂, r̂ capped at 0.999: near the cap a rate's last-bit rounding reaches
    # the signal up to 1000-fold (707.5 against 707.7, 1.7e-4 apart, on the retrofitted Llama on an AMD EPYC)
    rtol = 1e-3 if policy == "contraction" else 1e-4
    for rows in (1, 3):
        _same(token.score(requests, batch_size=rows), auto.score(requests, batch_size=rows), policy in GAP_SIGNALS,
              rtol)
    # A wave steps until its deepest token exits, so the saving shrinks as exits spread: 26-37% of the
    # token-major step calls here, 54% for the learned rule's widely spread exits on the retrofitted Llama.
    assert auto.stats["steps"] < 0.6 * token.stats["steps"], (auto.stats["steps"], token.stats["steps"])


@pytest.mark.parametrize("name", [m if m in ("huginn-layout", "tiny-looped-gpt2") else
                                  pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def test_blocks_of_positions_read_earlier_blocks_at_their_exits(name, monkeypatch):
    """A sequence longer than one wave is cut into blocks; a block reads earlier blocks' entries at their exit
    slots, so the answers do not depend on where the cuts fall. Fast on a coda model and on three loop groups."""
    name, model, requests = _model_case(name)
    knobs = _threshold(model, requests, "second_order")
    want = _engine(model, "second_order", "token_major", **knobs).score(requests, batch_size=3)
    for block in (1, 3):
        capacity = max(len(t) for t, _ in requests) - 1
        monkeypatch.setattr(waves, "WAVE_GATHER_BYTES", block * waves.gather_bytes(model, 3, capacity))
        run = _engine(model, "second_order", **knobs)
        assert waves.block_positions(model, 3, capacity) == block
        _same(want, run.score(requests, batch_size=3))


def test_a_short_kv_window_keeps_the_token_major_schedule():
    model = tiny(init_scale=1.0)
    requests = mixed_requests(6, seed=2)
    short = _engine(model, "first_order", kv_window=2)
    assert short.scoring_schedule == "token_major" and "kv_window" in waves.depth_major_blocker(short)
    whole = _engine(model, "first_order", kv_window=K)  # a window as deep as the loop is the full cache
    assert whole.scoring_schedule == "depth_major"
    _same(_engine(model, "first_order", "token_major", kv_window=K).score(requests), whole.score(requests))


def test_warm_start_and_generation_run_token_by_token():
    model = tiny(init_scale=1.0)
    assert _engine(model, "first_order", warm_start=True).scoring_schedule == "token_major"
    run = _engine(model, "first_order", threshold=1e-2)
    prompts = [[1, 5, 9], [2, 7]]
    assert run.generate(prompts, 3)[0].tokens == _engine(model, "first_order", "token_major",
                                                         threshold=1e-2).generate(prompts, 3)[0].tokens


def test_asking_for_depth_major_where_it_is_not_exact_is_refused():
    with pytest.raises(ExitbenchError, match="depth_major is not exact here .*oracle"):
        _engine(tiny(), "oracle", schedule="depth_major")
    with pytest.raises(ExitbenchError, match="schedule must be one of"):
        _engine(tiny(), "fixed", schedule="waves")
