"""Exit mode `select` beside the default `physical`: every token runs every iteration and the rule only picks
which iteration's output is read (what Ouro's own code and paper measure), against an exited token stopping.
Exit mode `freeze` (IBM vLLM-Hook's vLLM executor): an exited token stays, pinned, writing keys and values from
its pinned state while its MLPs are skipped. And the cost counters every mode records."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.engine import LOGP_TOL, exit_steps, knobs_for, mixed_requests, spread_threshold, tiny
from safetensors.torch import load_file

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.recorder import check_recordable
from exitbench.errors import ExitbenchError
from exitbench.models import AttnContext, LoopedGPT2, Ouro, Raven
from exitbench.models.checkpoint import load_checkpoint, open_checkpoint
from exitbench.policies import REGISTRY
from exitbench.store import cells
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
    if REGISTRY[policy].drafts:
        pytest.skip("depth speculation is no per-token exit, so it has no exit mode (tests/test_speculation.py)")
    if REGISTRY[policy].ranks_positions:
        pytest.skip("a budget over positions stops the ones it does not keep: exit modes refused "
                    "(tests/test_prefill_budget.py)")
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
    with pytest.raises(ExitbenchError, match="exit_mode must be 'physical', 'select', 'weighted' or 'freeze', "
                                             "got 'run_all'"):
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


# ---- freeze ---------------------------------------------------------------------------------------------------
# A family each: Huginn's sandwich block (with its adapter), the Llama and OLMo retrofits, Ouro, the looped GPT-2.
FAMILIES = ["huginn-layout", "retrofit-llama-tiny", "retrofit-olmo-tiny", "ouro-tiny", "tiny-looped-gpt2"]


@functools.cache
def _family(name: str):
    if name == "huginn-layout":
        return tiny(init_scale=1.0)
    if name == "tiny-looped-gpt2":
        return open_checkpoint(name).model.eval()
    return load_checkpoint(FIXTURES / name).model.eval()


def _core_layers(model, group) -> list:
    if isinstance(model, Raven):
        return list(model.transformer.core_block)
    if isinstance(model, Ouro):
        return list(model.model.layers)
    assert isinstance(model, LoopedGPT2)
    return list(group.modules)


def _plain_layer(model, layer, x, ctx):
    """One whole layer as the model runs it: what a layer writes when `x` is its input."""
    return layer(x, ctx) if isinstance(model, LoopedGPT2) else layer(x, model.rope, ctx)


def _inputs(model, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = model.embed(torch.zeros(1, 1, dtype=torch.long)).shape[-1]
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, d, generator=g).to(model.dtype) for _ in range(2))


@pytest.mark.parametrize("name", FAMILIES)
def test_freeze_with_every_row_active_is_the_plain_step_bit_for_bit(name):
    model = _family(name)
    group = model.loop_groups()[0]
    contexts = {  # a depth-major block (3 rows of 2 positions) and token mode (3 rows, each at its own position)
        (3, 2): lambda cache: AttnContext(start=1, cache=cache, iteration=1),
        (3, 1): lambda cache: AttnContext.tokens(cache, [0, 1, 2], [0, 2, 1], iteration=1)}
    for shape, context in contexts.items():
        s, x = _inputs(model, *shape)
        every = torch.arange(shape[0] * shape[1])
        runs = []
        for frozen in (False, True):
            cache = model.new_cache(3, 4)
            ctx = context(cache)
            out = group.frozen_step(s, x, ctx, every) if frozen else group.step(s, x, ctx)
            runs.append((out, cache))
        (plain, a), (masked, b) = runs
        assert torch.equal(plain, masked), shape
        for layer in group.attn_layers:
            assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer]), (shape, layer)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_frozen_row_writes_the_entries_of_its_pinned_state_and_runs_no_mlp(name):
    """Row 1 frozen, row 0 active, at position 1 and iteration 2: row 1's keys and values at every layer are those
    the layer writes with the pinned state as its input (no adapter, no earlier layer's output), its state stays
    the pinned one, its MLPs never run; row 0 steps as it would alone."""
    model = _family(name)
    group = model.loop_groups()[0]
    layers = _core_layers(model, group)
    s, x = _inputs(model, 2, 1)
    pinned = s[1:2]
    cache = model.new_cache(2, 3)
    rows_seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
             for layer in layers]
    try:
        out = group.frozen_step(s, x, AttnContext(start=1, cache=cache, iteration=2), torch.tensor([0]))
    finally:
        for hook in hooks:
            hook.remove()
    assert rows_seen == [1] * len(layers)
    assert torch.equal(out[1:2], pinned)
    slot = cache.slot(2)
    for layer, layer_id in zip(layers, group.attn_layers):
        alone = model.new_cache(1, 3)
        _plain_layer(model, layer, pinned, AttnContext(start=1, cache=alone, iteration=2))
        for got, want in zip(cache.entry(layer_id, slot, 1, 1), alone.entry(layer_id, slot, 0, 1)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    alone = group.step(s[:1], x[:1], AttnContext(start=1, cache=model.new_cache(1, 3), iteration=2))
    torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-5)


K = 8
# Fast: a latent rule on Huginn's layout and on Ouro's; a decoding rule and three loop groups with the slow tests
# (the masked step itself is checked on every family, fast, above).
FREEZE_CASES = [("huginn-layout", "second_order"), ("ouro-tiny", "second_order"),
                pytest.param("huginn-layout", "kl", marks=pytest.mark.slow),
                pytest.param("ouro-tiny", "kl", marks=pytest.mark.slow),
                pytest.param("tiny-looped-gpt2", "second_order", marks=pytest.mark.slow),  # three loop groups
                pytest.param("retrofit-llama-tiny", "first_order", marks=pytest.mark.slow)]


def _spread(model, requests, policy: str) -> float:
    probe = ExitEngine(model, ExitConfig(policy, threshold=1e-30, max_steps=K, record_signals=True),
                       schedule="token_major").score(requests)
    return spread_threshold(probe, policy, K)


def _token_steps(results) -> tuple[int, int]:
    records = [r for res in results for r in res.records]
    return sum(r.token_steps[0] for r in records), sum(r.token_steps[1] for r in records)


@pytest.mark.parametrize("name,policy", FREEZE_CASES)
def test_freeze_batched_equals_one_at_a_time_and_depth_major_equals_token_major(name, policy):
    model = _family(name)
    vocab = 100 if name == "huginn-layout" else model.output_size
    requests = mixed_requests(6, seed=5, vocab=vocab, min_len=3, max_len=12)
    config = ExitConfig(policy, threshold=_spread(model, requests, policy), max_steps=K, exit_mode="freeze")
    token, auto = ExitEngine(model, config, schedule="token_major"), ExitEngine(model, config)
    if not REGISTRY[policy].needs_logits:
        assert auto.scoring_schedule == "depth_major"
    want = token.score(requests, batch_size=1)
    for got in (token.score(requests, batch_size=3), auto.score(requests, batch_size=3)):
        assert exit_steps(got) == exit_steps(want)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=2e-5, atol=LOGP_TOL)
    attention, mlp = _token_steps(want)
    assert mlp < attention == K * len(model.loop_groups()) * sum(len(r.records) for r in want)  # some froze


def test_fixed_depth_under_freeze_is_physical():
    model = _family("huginn-layout")
    requests = mixed_requests(4, seed=3, min_len=3, max_len=9)
    runs = {m: ExitEngine(model, ExitConfig("fixed", threshold=4, exit_mode=m)).score(requests, batch_size=2)
            for m in ("physical", "freeze")}
    assert [r.logprobs for r in runs["physical"]] == [r.logprobs for r in runs["freeze"]]
    assert _token_steps(runs["physical"]) == _token_steps(runs["freeze"])


def test_each_mode_counts_attention_and_mlp_steps_and_freeze_flops_follow_them():
    """physical: both counters are the exit steps; select: both K; freeze: attention K, MLP the exit steps, and
    its loop FLOPs are the attention sublayers' at K and the rest (MLP, adapter) at the exit step."""
    model = _family("huginn-layout")
    requests = mixed_requests(5, seed=2, min_len=3, max_len=10)
    tau = _spread(model, requests, "second_order")
    runs = {m: ExitEngine(model, ExitConfig("second_order", threshold=tau, max_steps=K, exit_mode=m))
            .score(requests, batch_size=2) for m in ("physical", "select", "freeze")}
    for mode, results in runs.items():
        records = [r for res in results for r in res.records]
        exits, n = sum(sum(r.exit_steps) for r in records), len(records)
        assert exits < K * n, mode  # some token exited early
        want = {"physical": (exits, exits), "select": (K * n, K * n), "freeze": (K * n, exits)}[mode]
        assert _token_steps(results) == want, mode
        summary = cells.summarize([cells.request_stats(records, 0.0)])["iterations"]
        assert (summary["attention_token_steps"], summary["mlp_token_steps"]) == want
    # The core's FLOPs by hand from the weights: 2 per weight per token, 4 · width · context per attention layer.
    t, c = model.transformer, model.config
    attention = sum(2 * (b.attn.Wqkv.weight.numel() + b.attn.proj.weight.numel()) for b in t.core_block)
    rest = sum(2 * (b.mlp.fc.weight.numel() + b.mlp.proj.weight.numel()) for b in t.core_block) \
        + 2 * t.adapter.weight.numel()
    width = 4 * c.n_heads * c.head_dim * len(t.core_block)
    for mode in ("physical", "freeze"):
        for r in (r for res in runs[mode] for r in res.records):
            (e,), ctx = r.exit_steps, r.position + 1
            attended = K if mode == "freeze" else e
            assert r.flops["core"] == attended * (attention + width * ctx) + e * rest, (mode, r.exit_steps)


def test_freeze_refuses_the_oracle_and_a_replay_and_names_its_own_series():
    with pytest.raises(ExitbenchError, match="exit_mode freeze pins .* oracle decides only after"):
        ExitConfig("oracle", exit_mode="freeze")
    with pytest.raises(ExitbenchError, match="cannot replay --exit-mode"):
        check_recordable({"exit_mode": "freeze"}, "run")
    assert series({"policy": "kl", "exit_mode": "freeze"}) == "kl-freeze"
    cfg = SweepConfig(tasks=["chains"], policies=["kl"])
    plain = {"fingerprint": "f" * 16, "dtype": "float32"}
    keys = {m: cell_key(plain, "chains", "t", ExitConfig("kl", exit_mode=m), cfg, "cpu")
            for m in ("physical", "select", "freeze")}
    assert len({str(k) for k in keys.values()}) == 3
