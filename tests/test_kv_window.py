"""The KV window (`--kv-window C`, Huginn's compress-s): each loop layer keeps the entries of its last C iterations
in a rolling buffer. Against the full cache when C covers every iteration, against the rule written out again
on a full cache, batched against batch size 1, in the memory plan, on the command line and in cell keys."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.engine import ExitConfig
from exitbench.errors import ExitbenchError
from exitbench.engine.memory import plan
from exitbench.models import AttnContext, LoopGroup, Raven, RavenConfig
from exitbench.sweep.config import SweepConfig, grid
from exitbench.sweep.keys import cell_key

from helpers.cli import assert_one_line_error
from helpers.engine import (engine, exit_steps, logprobs_close, mixed_prompts, mixed_requests, spread_threshold,
                            tiny)
from helpers.models import HUGINN_CONFIG, make_gpt2, make_tiny_raven, random_ids

runner = CliRunner()
K = 12
REQUESTS = mixed_requests(8)  # 5 … 9 tokens, 3 … 6 of them context


@pytest.fixture(scope="module")
def noisy_model():
    return tiny(init_scale=1.0)


# ---- a window as deep as the loop is the full cache ----------------------------------------------------

# kl and the oracle with the slow tests: the window is the cache's, not the rule's
@pytest.mark.parametrize("policy,knobs", [("fixed", dict(threshold=8)), ("first_order", dict(threshold=0.3)),
                                          pytest.param("kl", dict(threshold=3e-3), marks=pytest.mark.slow),
                                          pytest.param("oracle", dict(threshold=1e-2), marks=pytest.mark.slow)])
def test_window_covering_every_iteration_is_the_full_cache(noisy_model, policy, knobs):
    if policy != "fixed":
        knobs = dict(knobs, max_steps=K)
    full = engine(noisy_model, policy, **knobs).score(REQUESTS)
    depth = knobs.get("max_steps", knobs["threshold"])
    for window in (depth, depth + 5):
        windowed = engine(noisy_model, policy, kv_window=window, **knobs).score(REQUESTS)
        assert exit_steps(windowed) == exit_steps(full)
        assert [r.logprobs for r in windowed] == [r.logprobs for r in full]  # bit for bit
    prompts = mixed_prompts(4)
    assert [r.logprobs for r in engine(noisy_model, policy, kv_window=depth, **knobs).generate(prompts, 3)] == \
        [r.logprobs for r in engine(noisy_model, policy, **knobs).generate(prompts, 3)]


# ---- the rule, restated on a full cache -----------------------------------------------------------------

def rule(j: int, e: int, c: int) -> int:
    """The iteration of a token that ran e iterations whose entry a reader at iteration j finds under a window
    of c: its latest iteration ≤ e in j's residue class mod c, or, having none, its deepest."""
    same = [i for i in range(1, e + 1) if i % c == j % c]
    return max(same) if same else e


@torch.no_grad()
def windowed_reference(model, tokens: list[int], prefix: int, exits: dict[int, int], depth: int, c: int,
                       noise: torch.Tensor) -> dict[int, torch.Tensor]:
    """Log-probs (float64) of positions prefix … len − 2, computed on a full cache (one slot per iteration)
    whose slot j − 1 is refilled, before each iteration j of a token, with every earlier token's entry of
    iteration rule(j, its exit, c), from a record of every entry each token ever wrote.

    Positions before `prefix` run together at `depth` (the engine's prefill: they read each other at the same
    iteration); each later position p alone, for exits[p] iterations.
    """
    stages = model.stages()
    gi = next(i for i, s in enumerate(stages) if isinstance(s, LoopGroup))
    group, before, after = stages[gi], stages[:gi], stages[gi + 1:]
    last = len(tokens) - 2
    cache = model.new_cache(1, last + 1, [depth])
    core = group.attn_layers
    written: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, position, iteration)

    def keep(positions, j):
        for layer in core:
            for p in positions:
                written[layer, p, j] = (cache.k[layer][j - 1, 0, p].clone(), cache.v[layer][j - 1, 0, p].clone())

    def through(x, ctx, stages_):
        for st in stages_:
            x = st.run(x, ctx)
        return x

    ran = {p: depth for p in range(prefix)}
    if prefix:
        ctx = AttnContext(start=0, cache=cache)
        x = through(model.embed(torch.tensor([tokens[:prefix]]), 0), ctx, before)
        s = group.init(x, noise[:prefix].unsqueeze(0) if model.config.init_scale > 0 else None)
        for j in range(1, depth + 1):
            s = group.step(s, x, ctx.at_iteration(j - 1))
            keep(range(prefix), j)
        through(group.finish(s), ctx, after)
    out = {}
    for p in range(prefix, last + 1):
        ctx = AttnContext(start=p, cache=cache)
        x = through(model.embed(torch.tensor([[tokens[p]]]), p), ctx, before)
        s = group.init(x, noise[p].view(1, 1, -1) if model.config.init_scale > 0 else None)
        for j in range(1, exits[p] + 1):
            for layer in core:
                for q in range(p):
                    k, v = written[layer, q, rule(j, ran[q], c)]
                    cache.k[layer][j - 1, 0, q] = k
                    cache.v[layer][j - 1, 0, q] = v
            s = group.step(s, x, ctx.at_iteration(j - 1))
            keep([p], j)
        ran[p] = exits[p]
        logits = model.head(through(group.finish(s), ctx, after))[0, 0]
        out[p] = torch.log_softmax(logits.double(), -1)
    return out


CASES = [  # policy, knobs, window, whole-sequence scoring (no prefill: every position runs alone)
    ("fixed", dict(threshold=6, prefill="exit"), 1, True),
    ("fixed", dict(threshold=6), 4, False),
    ("first_order", dict(threshold=0.3, max_steps=K), 1, False),
    ("first_order", dict(threshold=0.3, max_steps=K), 8, True),
    ("oracle", dict(threshold=1e-2, max_steps=K), 3, False),
]


@pytest.mark.parametrize("policy,knobs,window,whole", CASES,
                         ids=[f"{p}-c{c}{'-whole' if w else ''}" for p, _, c, w in CASES])
def test_window_follows_the_rule(noisy_model, policy, knobs, window, whole):
    reqs = [(t, 1) for t, _ in REQUESTS[:5]] if whole else REQUESTS[:5]
    eng = engine(noisy_model, policy, kv_window=window, **knobs)
    results = eng.score(reqs)
    full = engine(noisy_model, policy, **knobs).score(reqs)
    depth = eng.policies[0].max_steps
    x = noisy_model.embed(torch.zeros(1, 1, dtype=torch.long))
    exits, moved = [], 0.0
    for (tokens, n_ctx), res, ref_full in zip(reqs, results, full):
        forced = {rec.position: rec.exit_steps[0] for rec in res.records}
        exits += forced.values()
        ref = windowed_reference(noisy_model, tokens, n_ctx - 1, forced, depth, window,
                                 eng.noise.rows(0, len(tokens), x.dtype, x.device))
        want = [float(ref[p][tokens[p + 1]]) for p in forced]
        assert logprobs_close(res.logprobs, want), (res.logprobs, want)
        moved = max(moved, max(abs(a - b) for a, b in zip(res.logprobs, ref_full.logprobs)))
    assert moved > 1e-3, "the window should change this workload's answers for the test to mean something"
    if policy != "fixed":  # exits both inside the window (carried forward) and past it (nothing to carry)
        assert min(exits) < window <= max(exits) or window == 1 and len(set(exits)) >= 3, exits


# ---- batching never changes an answer, with the window on -----------------------------------------------

# first_order and the oracle under a window (4 and 7 s) with the slow tests; second_order's stays fast, and the
# oracle's batching without a window (test_engine)
@pytest.mark.parametrize("policy", [pytest.param("first_order", marks=pytest.mark.slow), "second_order",
                                    pytest.param("oracle", marks=pytest.mark.slow)])
def test_batched_equals_batch_size_one(noisy_model, policy):
    if policy == "oracle":
        knobs = dict(threshold=1e-2)
    else:
        probe = engine(noisy_model, policy, threshold=1e-30, max_steps=K).score(REQUESTS)
        knobs = dict(threshold=spread_threshold(probe, policy, K, 1, 2 if policy == "second_order" else 1))
    knobs.update(max_steps=K, kv_window=3)
    for rows in (None, 3):
        batched = engine(noisy_model, policy, **knobs).score(REQUESTS, batch_size=rows)
        single = [engine(noisy_model, policy, **knobs).score([req])[0] for req in REQUESTS]
        assert len({s for r in batched for s in r.iterations}) >= 3
        assert exit_steps(batched) == exit_steps(single)
        assert all(logprobs_close(b.logprobs, s.logprobs) for b, s in zip(batched, single))
    prompts = mixed_prompts(6)
    batched = engine(noisy_model, policy, **knobs).generate(prompts, 4, batch_size=4)
    single = [engine(noisy_model, policy, **knobs).generate([p], 4)[0] for p in prompts]
    assert [b.tokens for b in batched] == [s.tokens for s in single] and exit_steps(batched) == exit_steps(single)
    assert all(logprobs_close(b.logprobs, s.logprobs) for b, s in zip(batched, single))


def test_looped_gpt2_batched_equals_batch_size_one():
    """Three loop groups, each with its own rolling buffer; a probe reads out through the later groups."""
    model = make_gpt2()
    reqs = [(random_ids(1, n, 64, seed=n)[0].tolist(), 2) for n in (5, 9, 7, 11)]
    knobs = dict(threshold=0.5, kv_window=2)
    batched = engine(model, "second_order", **knobs).score(reqs)
    single = [engine(model, "second_order", **knobs).score([r])[0] for r in reqs]
    assert exit_steps(batched) == exit_steps(single)
    assert all(logprobs_close(b.logprobs, s.logprobs) for b, s in zip(batched, single))
    full = engine(model, "second_order", threshold=0.5).score(reqs)
    assert [r.logprobs for r in batched] != [r.logprobs for r in full]


# ---- memory: the plan and the engine's allocation -------------------------------------------------------

def test_plan_shrinks_by_the_window():
    with torch.device("meta"):
        huginn = Raven(RavenConfig(**HUGINN_CONFIG))
    full = plan(huginn, torch.bfloat16, 16, 1000)
    one = plan(huginn, torch.bfloat16, 16, 1000, kv_window=1)
    # 4 core layers × 32 slots + 4 plain layers against 4 × 1 + 4: 16.5× less
    assert one["kv_cache"] == 2 * (4 * 1 + 4) * 16 * 1000 * 55 * 96 * 2
    assert full["kv_cache"] * 8 == one["kv_cache"] * 132
    assert one["kv_layout"]["slots_per_loop_layer"] == [1] and one["kv_window"] == 1
    assert plan(huginn, torch.bfloat16, 16, 1000, kv_window=8)["kv_cache"] == 2 * (4 * 8 + 4) * 16 * 1000 * 5280 * 2
    assert plan(huginn, torch.bfloat16, 16, 1000, kv_window=32)["kv_cache"] == full["kv_cache"]


@pytest.mark.parametrize("window", [1, 3])
def test_engine_allocates_what_the_plan_says(window, monkeypatch):
    model = make_tiny_raven(mean_recurrence=4, max_recurrence=8, block_size=128)
    made = []
    original = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **k: made.append(original(*a, **k)) or made[-1])
    eng = engine(model, "second_order", kv_window=window, max_steps=8)
    eng.score([(random_ids(1, n, seed=n)[0].tolist(), 3) for n in (9, 17)], batch_size=2)
    (cache,) = made
    assert all(cache.slots[layer] == window for layer in eng.groups[0].attn_layers)
    assert cache.nbytes() == plan(model, torch.float32, 2, cache.capacity, 8, window)["kv_cache"]


def test_info_plan_shows_the_window(tiny_checkpoint):
    res = runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--batch-size", "4", "--context", "50",
                              "--max-steps", "6", "--kv-window", "2", "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)["plan"]
    assert p["kv_cache"] == 2 * (4 * 2 + 4) * 4 * 50 * 32 * 4 and p["kv_window"] == 2
    res = runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--kv-window", "1"])
    assert res.exit_code == 0, res.output
    assert "KV window 1" in res.stdout and "4 loop layers × 1 slots + 4 plain layers" in res.stdout


# ---- the knob: bad values, replay, cell keys ------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_window_values(bad):
    with pytest.raises(ExitbenchError, match=r"kv_window must be an integer ≥ 1.*got"):
        ExitConfig(kv_window=bad)


def test_bad_window_on_the_command_line_is_one_line(tiny_checkpoint, tmp_path):
    ck = str(tiny_checkpoint)
    for args in (["run", "-c", ck, "--kv-window", "-1", "--out", str(tmp_path / "a")],
                 ["trace", "the cat sat", "-c", ck, "--kv-window", "-2"],
                 ["info", "-c", ck, "--plan", "--kv-window", "-1"]):
        assert_one_line_error(runner.invoke(app, args), ["kv_window", "≥ 1"])
    res = runner.invoke(app, ["run", "-c", ck, "--replay", "--kv-window", "2", "--tasks", "chains", "--limit", "2",
                              "--out", str(tmp_path / "r")])
    assert_one_line_error(res, ["--replay", "--kv-window"])
    assert not list((tmp_path / "r").glob("*.json"))


def test_cell_keys_without_a_window_are_unchanged():
    """Committed baselines (results/baseline*) stay reusable: no window, or 0, reads as it did before the knob."""
    assert "kv_window" not in ExitConfig().to_dict()
    assert ExitConfig(kv_window=0).to_dict() == ExitConfig().to_dict()
    assert ExitConfig(kv_window=2).to_dict()["kv_window"] == 2
    model = {"fingerprint": "f", "dtype": "float32"}
    cfg = SweepConfig(tasks=["chains"], policies=["kl"])
    key = lambda c: cell_key(model, "chains", "t", c, cfg, "cpu")  # noqa: E731
    assert key(ExitConfig("kl", kv_window=0)) == key(ExitConfig("kl")) != key(ExitConfig("kl", kv_window=1))
    windowed = grid(SweepConfig(tasks=["chains"], policies=["kl"], exit={"kv_window": 2}), 4)
    assert {c.kv_window for c in windowed} == {2} and any(c.policy == "fixed" for c in windowed)


def test_a_window_is_its_own_series():
    """pareto, the report and cell file names keep a windowed rule apart from the same rule on the full cache."""
    from exitbench.store.cells import series

    assert series({"policy": "kl", "relative": False}) == "kl"
    assert series({"policy": "second_order", "relative": True, "kv_window": 2}) == "second_order-rel-kv2"
