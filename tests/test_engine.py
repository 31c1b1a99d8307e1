"""The exit engine: fixed depth against the plain forward, batching against batch size 1, the KV entries of
exited tokens, prefill and warm-start modes against a reference loop, FLOP accounting and generation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from exitbench.models import checkpoint, embedded
from exitbench.errors import ExitbenchError
from exitbench.engine.flops import FlopModel
from exitbench.models import KVCache

from helpers.engine import (LOGP_TOL, engine, exit_steps, first_order_rule, kl_rule, logprobs_close, mixed_prompts,
                            mixed_requests, reference_run, spread_threshold, tiny)

K = 12


@pytest.fixture(scope="module")
def zero_model():
    """init_scale = 0: s_0 = 0, so the engine and the plain forward start from the same state."""
    return tiny(init_scale=0.0)


@pytest.fixture(scope="module")
def noisy_model():
    return tiny(init_scale=1.0)


@pytest.fixture(scope="module")
def requests_16():
    reqs = mixed_requests(16)
    assert len({len(t) for t, _ in reqs}) >= 4 and len({n for _, n in reqs}) >= 4
    return reqs


# ---- fixed depth is the plain forward ------------------------------------------------------------------

@pytest.mark.parametrize("r", [1, 3, 6, 13])
def test_fixed_equals_plain_forward(zero_model, requests_16, r):
    reqs = requests_16[:6]
    results = engine(zero_model, "fixed", threshold=r, record_signals=False).score(reqs)
    for (tokens, n_ctx), res in zip(reqs, results):
        with torch.no_grad():
            logp = torch.log_softmax(zero_model(torch.tensor([tokens]), r)[0].double(), -1)
        want = [float(logp[p, tokens[p + 1]]) for p in range(n_ctx - 1, len(tokens) - 1)]
        assert res.tokens == tokens[n_ctx:]
        assert logprobs_close(res.logprobs, want), (r, res.logprobs, want)
        assert res.greedy == [int(logp[p].argmax()) == tokens[p + 1] for p in range(n_ctx - 1, len(tokens) - 1)]
        assert [rec.position for rec in res.records] == list(range(n_ctx - 1, len(tokens) - 1))
        assert all(rec.exit_steps == [r] for rec in res.records)
        assert res.iterations == [r] * len(want)


@pytest.mark.parametrize("policy", ["first_order", "kl", "cosine", "second_order"])
@pytest.mark.parametrize("which", ["zero_model", "noisy_model"])
def test_policy_that_never_fires_equals_fixed_at_max_steps(request, requests_16, policy, which):
    model = request.getfixturevalue(which)
    # Eight iterations: every signal is still far above 1e-30 (a KL or 1 − cos can round to ≤ 0 in float32
    # once the distributions stop moving, which would count as a hit at any threshold).
    adaptive = engine(model, policy, threshold=1e-30, max_steps=8).score(requests_16)
    fixed = engine(model, "fixed", threshold=8).score(requests_16)
    assert exit_steps(adaptive) == exit_steps(fixed)
    assert all(s == [8] for r in adaptive for s in (rec.exit_steps for rec in r.records))
    for a, f in zip(adaptive, fixed):
        assert a.tokens == f.tokens and logprobs_close(a.logprobs, f.logprobs, 1e-6)


# ---- batching never changes an answer --------------------------------------------------------------------

BATCH_CASES = [("first_order", dict(relative=True)), ("second_order", {}), ("kl", {}), ("oracle", {}),
               ("minp_kl", dict(patience=2, min_steps=3))]


def _batch_knobs(model, requests, policy, knobs, k=K):
    """Threshold under which this workload's exits spread over many steps (the oracle keeps its ε)."""
    if policy == "oracle":
        return dict(threshold=1e-2, **knobs)
    probe = engine(model, policy, threshold=1e-30, max_steps=k, **knobs).score(requests)
    patience = knobs.get("patience", 2 if policy.startswith("second") else 1)
    tau = spread_threshold(probe, policy, k, knobs.get("min_steps", 1), patience)
    return dict(threshold=tau, **knobs)


def _check_batched_equals_single(model, requests, policy, knobs, k=K, rows=None, **extra):
    knobs = _batch_knobs(model, requests, policy, knobs, k)
    batched = engine(model, policy, max_steps=k, **knobs, **extra).score(requests, batch_size=rows)
    single = [engine(model, policy, max_steps=k, **knobs, **extra).score([req])[0] for req in requests]
    exits = [s for r in batched for s in r.iterations]
    assert len(set(exits)) >= 3, f"{policy}: the exits should vary for this test to mean something: {exits}"
    assert exit_steps(batched) == exit_steps(single)
    for b, s in zip(batched, single):
        assert b.tokens == s.tokens and b.greedy == s.greedy
        assert logprobs_close(b.logprobs, s.logprobs), (b.logprobs, s.logprobs)
        for rb, rs in zip(b.records, s.records):
            np.testing.assert_allclose(rb.signals[0], rs.signals[0], rtol=1e-4, atol=1e-5)


# minp_kl (patience and min_steps over a decoding rule) with the slow tests; kl's batching and those knobs'
# exits (tests/test_policies.py) stay fast.
@pytest.mark.parametrize("policy,knobs", [c if c[0] != "minp_kl" else pytest.param(*c, marks=pytest.mark.slow)
                                          for c in BATCH_CASES], ids=[p for p, _ in BATCH_CASES])
def test_batched_score_equals_batch_size_one(noisy_model, requests_16, policy, knobs):
    _check_batched_equals_single(noisy_model, requests_16, policy, knobs)


def _check_generate_batched_equals_single(model, prompts, policy, knobs, k=K, rows=None, **extra):
    assert len({len(p) for p in prompts}) >= 4
    if policy == "oracle":
        knobs = dict(threshold=1e-2, **knobs)
    else:
        knobs = _batch_knobs(model, [(p + [5, 6, 7], len(p)) for p in prompts], policy, knobs, k)
    batched = engine(model, policy, max_steps=k, **knobs, **extra).generate(prompts, max_new_tokens=4,
                                                                          batch_size=rows)
    single = [engine(model, policy, max_steps=k, **knobs).generate([p], max_new_tokens=4)[0] for p in prompts]
    exits = [s for r in batched for s in r.iterations]
    assert len(set(exits)) >= 3, exits
    for b, s in zip(batched, single):
        assert len(b.tokens) == 4
        assert b.tokens == s.tokens
        assert exit_steps([b]) == exit_steps([s])
        assert logprobs_close(b.logprobs, s.logprobs)


# Fast: a latent rule and the oracle (whose cache is rewritten after the fact); kl and second_order with the slow
# tests (their scoring batches fast above, and generation runs the same loop).
@pytest.mark.parametrize("policy,knobs", [c if c[0] in ("first_order", "oracle") else pytest.param(*c, marks=pytest.mark.slow)
                                          for c in BATCH_CASES[:4]], ids=[p for p, _ in BATCH_CASES[:4]])
def test_batched_generate_equals_batch_size_one(noisy_model, policy, knobs):
    _check_generate_batched_equals_single(noisy_model, mixed_prompts(8), policy, knobs)


# Fast: three rows under second_order. The oracle (8 s: each request run to full depth, then again to its exit)
# and five rows run with the slow tests; the oracle's batching is checked fast with a row per request above.
@pytest.mark.parametrize("policy,knobs", [BATCH_CASES[1], pytest.param(*BATCH_CASES[3], marks=pytest.mark.slow)],
                         ids=["second_order", "oracle"])
@pytest.mark.parametrize("rows", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_fewer_rows_than_requests_equals_batch_size_one(noisy_model, requests_16, policy, knobs, rows):
    """Rows that finish a request take the next one (continuous batching): still the answers of one at a time."""
    _check_batched_equals_single(noisy_model, requests_16, policy, knobs, rows=rows)
    _check_generate_batched_equals_single(noisy_model, mixed_prompts(8), policy, knobs, rows=rows)


@pytest.mark.parametrize("refill", ["eager", "balanced"])
def test_every_refill_generates_what_batch_size_one_does(noisy_model, refill):
    """The default (wave) is checked above; the others finish exited tokens at other steps, with rows reused."""
    _check_generate_batched_equals_single(noisy_model, mixed_prompts(8), *BATCH_CASES[1], rows=3, refill=refill)


def test_refill_decides_how_often_exited_tokens_are_finished(noisy_model, monkeypatch):
    """wave finishes once per token wave, eager at every step where a token exited: the knob is no name only."""
    from exitbench.engine.engine import Run

    calls = []
    finish = Run.finish
    monkeypatch.setattr(Run, "finish", lambda self, batches: (calls.append(len(batches)), finish(self, batches)))
    prompts = mixed_prompts(8)
    knobs = _batch_knobs(noisy_model, [(p + [5, 6, 7], len(p)) for p in prompts], *BATCH_CASES[1], K)
    counts = {}
    for refill in ("wave", "balanced", "eager"):
        calls.clear()
        engine(noisy_model, "second_order", max_steps=K, refill=refill, **knobs).generate(prompts, max_new_tokens=4)
        counts[refill] = len(calls)
    assert counts["wave"] == 4 and counts["wave"] < counts["balanced"] < counts["eager"], counts


@pytest.mark.parametrize("refill, window", [("wave", None), ("eager", None), ("balanced", 8)])
def test_carries_deferred_to_the_refill_give_what_carries_at_each_exit_give(noisy_model, monkeypatch, refill,
                                                                               window):
    """Generation carries an exited token's deepest entry forward when its row's next token is due (once per
    wave under `wave`), not at each step with exits: bit for bit what carrying at once gives, with rows taking
    next requests (their prefills overwrite the old keys) and under a KV window. The check can fail: without
    the carries the answers move."""
    from exitbench.engine.loop import TokenLoop

    prompts = mixed_prompts(8)
    knobs = _batch_knobs(noisy_model, [(p + [5, 6, 7], len(p)) for p in prompts], *BATCH_CASES[1], K)
    knobs.update(refill=refill, **({} if window is None else {"kv_window": window}))

    def run(defer: bool | None):  # None: no carries at all
        carries = []
        with monkeypatch.context() as m:
            init = TokenLoop.__init__
            m.setattr(TokenLoop, "__init__",
                      lambda self, *a, **kw: init(self, *a, **{**kw, "defer_carry": bool(defer)}))
            carry = TokenLoop.carry
            m.setattr(TokenLoop, "carry", lambda self, cache: (carries.append(len(self.carries)),
                                                               carry(self, cache) if defer is not None
                                                               else self.carries.clear()))
            out = engine(noisy_model, "second_order", max_steps=K, **knobs).generate(prompts, max_new_tokens=4,
                                                                                   batch_size=3)
        return out, [n for n in carries if n]

    (deferred, batched), (at_once, single), (none, _) = run(True), run(False), run(None)
    assert exit_steps(deferred) == exit_steps(at_once)
    for d, a in zip(deferred, at_once):
        assert d.tokens == a.tokens and d.logprobs == a.logprobs
    assert max(batched) > 1 and sum(batched) == sum(single)  # carried together, the same entries
    assert exit_steps(none) != exit_steps(at_once) or any(n.logprobs != a.logprobs for n, a in zip(none, at_once))


def test_prefill_exit_and_warm_start_with_rows_reused(noisy_model, requests_16):
    for prefill, warm in (("exit", False), ("full", True)):
        _check_batched_equals_single(noisy_model, requests_16, "first_order", dict(relative=True), rows=4,
                                     prefill=prefill, warm_start=warm)


@pytest.fixture(scope="module")
def embedded_case():
    """The trained checkpoint shipped with the package, where exits vary by themselves, and its inputs."""
    if not embedded.embedded_names():
        pytest.skip("no embedded checkpoint in this install")
    model = checkpoint.open_checkpoint(None).model.eval()
    vocab = model.config.vocab_size
    return (model, min(K, model.loop_groups()[0].max_steps), mixed_requests(16, seed=3, vocab=vocab),
            mixed_prompts(8, seed=3, vocab=vocab))


@pytest.mark.slow  # 3 s; the embedded model's batching stays checked fast at the minp_kl grid thresholds
def test_embedded_checkpoint_batched_equals_batch_size_one(embedded_case):
    model, k, requests, prompts = embedded_case
    for policy, knobs in BATCH_CASES[:4]:
        _check_batched_equals_single(model, requests, policy, knobs, k)
        _check_generate_batched_equals_single(model, prompts, policy, knobs, k)


def test_embedded_batching_is_exact_at_minp_kl_grid_thresholds(embedded_case):
    model, k, requests, prompts = embedded_case
    differing = []
    for tau in (1e-7, 1e-6, 1e-5):  # 1e-5 is minp_kl's default threshold
        run = lambda: engine(model, "minp_kl", threshold=tau, max_steps=k)  # noqa: E731
        batched, single = run().score(requests), [run().score([r])[0] for r in requests]
        differing += [("score", tau, i) for i, (b, s) in enumerate(zip(batched, single))
                      if exit_steps([b]) != exit_steps([s])]
        batched, single = run().generate(prompts, 4), [run().generate([p], 4)[0] for p in prompts]
        differing += [("generate", tau, i) for i, (b, s) in enumerate(zip(batched, single))
                      if exit_steps([b]) != exit_steps([s]) or b.tokens != s.tokens]
    assert not differing, f"batched and batch-size-1 runs disagree: {differing}"


# ---- the KV entries of exited tokens --------------------------------------------------------------------

def _filled_cache(batch=3, slots=None, capacity=5):
    slots = slots or {0: 1, 3: 4, 4: 4}
    cache = KVCache(batch, 2, 3, slots, capacity)
    g = torch.Generator().manual_seed(0)
    for store in (cache.k, cache.v):
        for layer in store:
            store[layer].copy_(torch.randn(store[layer].shape, generator=g))
    return cache


def _snapshot(cache):
    """(k or v, layer) → {(slot, row, position): the entry a reader there finds}, copied."""
    return {(name, layer): {(slot, row, p): cache.entry(layer, slot, row, p)[i].clone()
                            for slot in range(cache.slots[layer]) for row in range(cache.batch)
                            for p in range(cache.capacity)}
            for i, name in enumerate(("k", "v")) for layer in cache.slots}


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 2]), torch.tensor([2, 1]), torch.tensor([1])],
                         ids=["all", "rows02", "rows21", "row1"])
@pytest.mark.parametrize("last_slot", [0, 1, 2])
def test_carry_forward_copies_exit_slot_upward(rows, last_slot):
    cache = _filled_cache()
    before = _snapshot(cache)
    pos = 2
    cache.carry_forward([3, 4], rows, pos, last_slot)
    chosen = set(range(3)) if rows is None else set(rows.tolist())
    for (name, layer), old in before.items():
        for slot in range(cache.slots[layer]):
            for row in range(3):
                for p in range(cache.capacity):
                    moved = layer in (3, 4) and row in chosen and p == pos and slot > last_slot
                    want = old[(last_slot if moved else slot, row, p)]
                    got = cache.entry(layer, slot, row, p)[0 if name == "k" else 1]
                    assert torch.equal(got, want), (name, layer, slot, row, p)


def test_carry_forward_from_the_last_slot_changes_nothing():
    cache = _filled_cache()
    before = _snapshot(cache)
    cache.carry_forward([0, 3, 4], torch.tensor([0, 1]), 1, 3)
    cache.carry_forward([0], None, 1, 0)  # a one-slot plain layer
    assert _snapshot(cache).keys() == before.keys()
    assert all(torch.equal(t, _snapshot(cache)[key][where]) for key, entries in before.items()
               for where, t in entries.items())


@pytest.mark.parametrize("policy,tau", [("first_order", 0.5), ("kl", 3e-3), ("oracle", 1e-2)])
def test_exited_tokens_leave_their_exit_entry_in_higher_slots(noisy_model, requests_16, monkeypatch, policy, tau):
    made = []
    original = noisy_model.new_cache

    def capture(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(noisy_model, "new_cache", capture)
    eng = engine(noisy_model, policy, threshold=tau, max_steps=K)
    results = eng.score(requests_16)
    cache, = made
    core = eng.groups[0].attn_layers
    assert all(cache.slots[layer] == K for layer in core)
    exits = set()
    for row, res in enumerate(results):
        for rec in res.records:
            e, p = rec.exit_steps[0], rec.position
            exits.add(e)
            for i in (0, 1):  # keys, then values
                for layer in core:
                    at = [cache.entry(layer, slot, row, p)[i] for slot in range(K)]
                    for slot in range(e, K):
                        assert torch.equal(at[slot], at[e - 1]), (row, p, e, slot)
                    if e >= 2:  # the entries it did compute are its own, iteration by iteration
                        assert not torch.equal(at[e - 1], at[e - 2])
    assert len(exits) >= 3 and min(exits) < K


# ---- the engine against a reference loop (exits, KV carry, prefill and warm start) ------------------------

RULES = {"first_order": (first_order_rule, 0.3), "kl": (kl_rule, 3e-3)}


def _reference(model, eng, tokens, n_ctx, policy, prefill, warm_start):
    x = model.embed(torch.zeros(1, 1, dtype=torch.long))
    table = eng.noise.rows(0, len(tokens), x.dtype, x.device) if model.config.init_scale > 0 else None
    make, tau = RULES[policy]
    return reference_run(model, tokens, n_ctx - 1, len(tokens) - 2, make(tau), K, prefill=prefill,
                         warm_start=warm_start, noise_table=table, need_logits=policy == "kl")


MODES_ALL = [("full", False), ("exit", False), ("full", True), ("exit", True)]
MODES_TWO = [("full", False), ("exit", True)]


@pytest.mark.parametrize("which,policy,prefill,warm_start",
                         [("noisy_model", "first_order", *m) for m in MODES_ALL] +
                         # a zero initial state changes where the loop starts, not the modes: with the slow tests
                         [pytest.param("zero_model", "first_order", *m, marks=pytest.mark.slow) for m in MODES_TWO] +
                         [("noisy_model", "kl", *m) for m in MODES_TWO])
def test_engine_matches_reference_loop(request, requests_16, prefill, warm_start, which, policy):
    model = request.getfixturevalue(which)
    reqs = requests_16[:5]
    eng = engine(model, policy, threshold=RULES[policy][1], max_steps=K, prefill=prefill, warm_start=warm_start)
    results = eng.score(reqs)
    exits = set()
    for (tokens, n_ctx), res in zip(reqs, results):
        ref = _reference(model, eng, tokens, n_ctx, policy, prefill, warm_start)
        scored = list(range(n_ctx - 1, len(tokens) - 1))
        assert [rec.position for rec in res.records] == scored
        assert [rec.exit_steps[0] for rec in res.records] == [ref[p][0] for p in scored]
        want = [float(ref[p][1][tokens[p + 1]]) for p in scored]
        assert logprobs_close(res.logprobs, want), (res.logprobs, want)
        exits.update(ref[p][0] for p in range(len(tokens) - 1))
    assert len(exits) >= 3 and min(exits) < K


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_oracle_cache_is_as_if_the_token_exited(noisy_model, requests_16, mode):
    """The oracle runs every token to max_steps, then settles on an exit: later tokens must see the cache of
    a token that stopped there (core slots carried forward, coda entry from the exit state). Replaying the
    oracle's exits in the reference loop must give the same log-probabilities."""
    eng = engine(noisy_model, "oracle", threshold=1e-2, max_steps=K)
    if mode == "score":
        reqs = requests_16[:8]
        results = eng.score(reqs)
    else:
        prompts = mixed_prompts(6, seed=4)
        results = eng.generate(prompts, max_new_tokens=5)
        reqs = [(p + r.tokens, len(p)) for p, r in zip(prompts, results)]
    exits = set()
    for (tokens, n_ctx), res in zip(reqs, results):
        forced = {rec.position: rec.exit_steps[0] for rec in res.records}
        exits.update(forced.values())
        x = noisy_model.embed(torch.zeros(1, 1, dtype=torch.long))
        ref = reference_run(noisy_model, tokens, n_ctx - 1, len(tokens) - 2, lambda pos, k, st, lp: k == forced[pos], K,
                            noise_table=eng.noise.rows(0, len(tokens), x.dtype, x.device))
        assert [ref[p][0] for p in forced] == list(forced.values())
        want = [float(ref[p][1][tokens[p + 1]]) for p in forced]
        assert logprobs_close(res.logprobs, want), (res.logprobs, want)
    assert len(exits) >= 3 and min(exits) < K


def test_prefill_exit(noisy_model, requests_16):
    reqs = requests_16
    # Records only for the scored positions, in both modes.
    full = engine(noisy_model, "first_order", threshold=0.3, max_steps=K, prefill="full").score(reqs)
    exit_ = engine(noisy_model, "first_order", threshold=0.3, max_steps=K, prefill="exit").score(reqs)
    for (tokens, n_ctx), a, b in zip(reqs, full, exit_):
        assert [r.position for r in a.records] == [r.position for r in b.records] == \
            list(range(n_ctx - 1, len(tokens) - 1))
    # The prompt tokens' exits reach the scored ones through the KV cache: answers differ …
    diff = max(abs(x - y) for a, b in zip(full, exit_) for x, y in zip(a.logprobs, b.logprobs))
    assert diff > 1e-3
    # … except at fixed depth, where exiting and prefilling are the same computation.
    f_full = engine(noisy_model, "fixed", threshold=7, prefill="full").score(reqs)
    f_exit = engine(noisy_model, "fixed", threshold=7, prefill="exit").score(reqs)
    assert exit_steps(f_full) == exit_steps(f_exit)
    for a, b in zip(f_full, f_exit):
        assert logprobs_close(a.logprobs, b.logprobs)


def test_warm_start_changes_the_start_and_batches(noisy_model, requests_16):
    cold = engine(noisy_model, "first_order", threshold=0.3, max_steps=K).score(requests_16)
    warm = engine(noisy_model, "first_order", threshold=0.3, max_steps=K, warm_start=True).score(requests_16)
    assert exit_steps(cold) != exit_steps(warm)
    assert max(abs(x - y) for a, b in zip(cold, warm) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
    # The first position of a sequence has no predecessor: it starts cold in both runs.
    for (tokens, n_ctx), c, w in zip(requests_16, cold, warm):
        if n_ctx == 1:
            assert c.records[0].exit_steps == w.records[0].exit_steps
            assert abs(c.logprobs[0] - w.logprobs[0]) <= LOGP_TOL
    # batched ≡ one at a time with a warm start: here under prefill="exit"; under "full" with rows reused in
    # test_prefill_exit_and_warm_start_with_rows_reused
    _check_batched_equals_single(noisy_model, requests_16, "first_order", dict(relative=True), warm_start=True,
                                 prefill="exit")


# ---- FLOPs ----------------------------------------------------------------------------------------------

def _iteration_flops(c, context):
    """One core iteration, from the config: adapter + 4 blocks of matmuls, attention over `context` tokens."""
    d, inter, n = c.n_embd, c.intermediate_size, c.n_layers_in_recurrent_block
    block = 2 * (3 * d * d + d * d + 2 * inter * d + inter * d)
    return 2 * (2 * d * d) + n * block + 4.0 * context * d * n


def _readout_flops(c, context):
    d, inter, n = c.n_embd, c.intermediate_size, c.n_layers_in_coda
    return n * (2 * (4 * d * d + 3 * inter * d) + 4.0 * context * d) + 2 * c.padded_vocab_size * d


def test_flops_follow_exit_steps(noisy_model, requests_16):
    c = noisy_model.config
    lat = engine(noisy_model, "first_order", threshold=0.3, max_steps=K).score(requests_16)
    dist = engine(noisy_model, "kl", threshold=3e-3, max_steps=K).score(requests_16)
    by_pos = {}
    for results, probing in ((lat, False), (dist, True)):
        for res in results:
            for rec in res.records:
                e, ctx = rec.exit_steps[0], rec.position + 1
                assert rec.flops["core"] == pytest.approx(e * _iteration_flops(c, ctx), rel=1e-12)
                if probing:
                    assert rec.flops["probe"] > 0
                    assert rec.flops["probe"] == pytest.approx(e * _readout_flops(c, ctx), rel=1e-12)
                else:
                    assert rec.flops["probe"] == 0
                    by_pos.setdefault(rec.position, []).append((e, rec.flops["core"]))
                parts = sum(v for k, v in rec.flops.items() if k != "total")
                assert rec.flops["total"] == pytest.approx(parts)
    # Proportionality at one position between tokens with different exits.
    pairs = [(a, b) for recs in by_pos.values() for a in recs for b in recs if a[0] != b[0]]
    assert pairs
    for (ea, fa), (eb, fb) in pairs:
        assert fa / fb == pytest.approx(ea / eb, rel=1e-12)


def test_flop_model_counts_linear_weights():
    model = tiny(init_scale=1.0)
    fm = FlopModel(model)
    c = model.config
    one = fm.token(10, [1], [0])
    three = fm.token(10, [3], [2])
    assert three["core"] == pytest.approx(3 * one["core"]) and one["core"] == pytest.approx(_iteration_flops(c, 10))
    assert three["probe"] == pytest.approx(2 * _readout_flops(c, 10))
    assert one["prelude"] == three["prelude"] > 0


# ---- generation -----------------------------------------------------------------------------------------

def _greedy(model, prompt, r, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), r)[0, -1].argmax()))
    return ids[len(prompt):]


def test_fixed_generation_is_greedy_decoding(zero_model):
    prompts = mixed_prompts(4, seed=5)
    out = engine(zero_model, "fixed", threshold=5).generate(prompts, max_new_tokens=5)
    for p, res in zip(prompts, out):
        assert res.tokens == _greedy(zero_model, p, 5, 5)
        assert res.greedy == [True] * 5 and res.stopped_by == "max_new_tokens"
        assert [rec.position for rec in res.records] == list(range(len(p) - 1, len(p) + 4))


def test_generation_stops(noisy_model):
    prompts = mixed_prompts(6, seed=2)
    eng = lambda: engine(noisy_model, "first_order", threshold=0.3, max_steps=K)  # noqa: E731
    free = eng().generate(prompts, max_new_tokens=8)
    assert all(len(r.tokens) == 8 and r.stopped_by == "max_new_tokens" for r in free)
    # max_new_tokens: a prefix of the same continuation.
    short = eng().generate(prompts, max_new_tokens=3)
    assert [r.tokens for r in short] == [r.tokens[:3] for r in free]
    # stop_ids: each row stops right after the first stop id it produces, the others run on.
    stop_id = free[0].tokens[2]
    cut = eng().generate(prompts, max_new_tokens=8, stop_ids=[stop_id, 99999])
    for f, c in zip(free, cut):
        if stop_id in f.tokens:
            j = f.tokens.index(stop_id)
            assert c.tokens == f.tokens[:j + 1] and c.stopped_by == "stop_id"
        else:
            assert c.tokens == f.tokens and c.stopped_by == "max_new_tokens"
        assert logprobs_close(c.logprobs, f.logprobs[:len(c.tokens)]) and len(c.records) == len(c.tokens)
    assert len(cut[0].tokens) == 3
    # stop callback: row-specific lengths; rows it never stops are unaffected.
    limits = {0: 1, 2: 4, 3: 6}
    calls = []

    def stop(row, generated):
        calls.append((row, list(generated)))
        return row in limits and len(generated) >= limits[row]

    cb = eng().generate(prompts, max_new_tokens=8, stop=stop)
    for row, (f, c) in enumerate(zip(free, cb)):
        n = limits.get(row, 8)
        assert c.tokens == f.tokens[:n]
        assert c.stopped_by == ("stop" if row in limits else "max_new_tokens")
    assert (0, free[0].tokens[:1]) in calls and all(len(g) <= 8 for _, g in calls)


def test_bad_requests(noisy_model):
    eng = engine(noisy_model, "first_order", threshold=0.3)
    for bad in ([([1, 2, 3], 0)], [([1, 2, 3], 3)], [([1], 1)]):
        with pytest.raises(ExitbenchError, match="n_context"):
            eng.score(bad)
    with pytest.raises(ExitbenchError, match="max_new_tokens"):
        eng.generate([[1, 2]], max_new_tokens=0)
    with pytest.raises(ExitbenchError, match="non-empty prompt"):
        eng.generate([[1, 2], []], max_new_tokens=2)
    with pytest.raises(ExitbenchError, match="context"):
        eng.generate([[1] * 100], max_new_tokens=40)  # block_size 128
