"""Continuous depth batching (fixed places, spare rows, batched outputs), the late horizon, the KV layouts, the
prefix store and the engine's clocks: each gives the answers of batch size 1, and each does what it says."""
from __future__ import annotations

import sys

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.engine import Run
from exitbench.engine.loop import TokenLoop
from exitbench.engine.prefixes import PrefixStore
from exitbench.errors import ExitbenchError
from exitbench.models import cache as cache_module
from exitbench.models.cache import KVCache

from helpers.bench import bench_script
from helpers.engine import engine, exit_steps, logprobs_close, mixed_prompts, mixed_requests, spread_threshold, tiny

K = 12


@pytest.fixture(scope="module")
def model():
    return tiny(init_scale=1.0)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(20)


@pytest.fixture(scope="module")
def tau(model, prompts):
    """A second_order threshold that spreads this workload's exits over many iterations."""
    probe = engine(model, "second_order", threshold=1e-30, max_steps=K).score([(p + [5, 6, 7], len(p)) for p in prompts])
    return spread_threshold(probe, "second_order", K, 1, 2)


def _same(a, b):
    assert exit_steps(a) == exit_steps(b)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and logprobs_close(x.logprobs, y.logprobs)


@pytest.mark.parametrize("rows, coda_batch", [(4, None), (4, 1), (6, 3), (16, None)])
def test_continuous_generation_is_batch_size_one(model, prompts, tau, rows, coda_batch):
    """Fixed places, a stream longer than the rows (spare rows, outputs in batches of coda_batch): batch size 1's
    tokens, exits and log-probabilities, and the exits really spread (else the places never differ)."""
    knobs = dict(threshold=tau, max_steps=K, **({} if coda_batch is None else {"coda_batch": coda_batch}))
    batched = engine(model, "second_order", **knobs).generate(prompts, 5, batch_size=rows)
    single = engine(model, "second_order", threshold=tau, max_steps=K).generate(prompts, 5, batch_size=1)
    assert len({s for r in batched for s in r.iterations}) >= 4
    _same(batched, single)


def test_continuous_keeps_its_shapes_and_spare_rows_fill_the_places(model, prompts, tau, monkeypatch):
    """Every step of a continuous run holds the same places (a step's tensors never change shape as tokens come
    and go), the run holds a batch of spare rows, and a stream keeps the places nearly full: its loop steps
    are within a fifth of the token-iterations over the places. Static batching (wave) compacts instead."""
    shapes, held = [], []
    step = TokenLoop.step

    def spy(self, cache):
        shapes.append(tuple(self.s.shape))
        held.append(len(self))
        return step(self, cache)

    monkeypatch.setattr(TokenLoop, "step", spy)
    eng = engine(model, "second_order", threshold=tau, max_steps=K)
    results = eng.generate(prompts, 5, batch_size=4)
    assert set(shapes) == {(4, 1, shapes[0][2])}
    work = sum(sum(r.iterations) for r in results)
    assert eng.stats["work"] == work and eng.stats["steps"] <= 1.2 * work / 4
    shapes.clear()
    engine(model, "second_order", threshold=tau, max_steps=K, refill="wave").generate(prompts, 5, batch_size=4)
    assert len(set(shapes)) > 1  # static batching drops the rows whose tokens exited

    rows = []
    init = Run.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rows.append((self.B, self.places))

    monkeypatch.setattr(Run, "__init__", kept)
    engine(model, "second_order", threshold=tau, max_steps=K).generate(prompts, 2, batch_size=4)
    engine(model, "fixed", threshold=K).generate(prompts, 2, batch_size=4)
    engine(model, "second_order", threshold=tau, max_steps=K).generate(prompts, 2, batch_size=1)
    assert rows == [(8, 4), (4, None), (1, None)]  # fixed depth and one row: nothing to keep places for


def test_outputs_are_computed_in_batches_of_coda_batch(model, prompts, tau, monkeypatch):
    sizes = []
    finish = Run.finish
    monkeypatch.setattr(Run, "finish", lambda self, batches: (sizes.append(sum(len(b.tokens) for b in batches)),
                                                             finish(self, batches)))
    engine(model, "second_order", threshold=tau, max_steps=K, coda_batch=3).generate(prompts, 5, batch_size=6)
    # a bucket at a time, but never so late that a place waits with no token to take: mostly 3, some fewer
    assert max(sizes) <= 3 + 6 and sum(s >= 3 for s in sizes) > len(sizes) / 2, sizes
    sizes.clear()
    engine(model, "second_order", threshold=tau, max_steps=K, refill="eager").generate(prompts, 5, batch_size=6)
    assert min(sizes) == 1


def test_late_horizon_exits_one_iteration_after_the_rule_and_batches(model, prompts, tau):
    same = engine(model, "second_order", threshold=tau, max_steps=K).generate(prompts, 1)
    for rows in (1, 6):
        late = engine(model, "second_order", threshold=tau, max_steps=K, horizon="late").generate(prompts, 1,
                                                                                                 batch_size=rows)
        assert [r.records[0].exit_steps for r in late] == [[min(s.records[0].exit_steps[0] + 1, K)] for s in same]
    _same(engine(model, "second_order", threshold=tau, max_steps=K, horizon="late").generate(prompts, 4, batch_size=5),
          engine(model, "second_order", threshold=tau, max_steps=K, horizon="late").generate(prompts, 4, batch_size=1))
    requests = mixed_requests(8)
    late = engine(model, "second_order", threshold=tau, max_steps=K, horizon="late")
    _same(late.score(requests, batch_size=3), late.score(requests, batch_size=1))


@pytest.mark.parametrize("knobs, words", [
    (dict(policy="oracle", horizon="late"), "oracle decides only after the whole trajectory"),
    (dict(policy="fixed", horizon="late"), "fixed exits by counting"),
    (dict(horizon="sooner"), "horizon must be one of same, late"),
    (dict(policy="second_order", coda_batch=0), "coda_batch must be an integer ≥ 1"),
    (dict(policy="second_order", coda_batch=4, refill="wave"), "with refill wave it means nothing"),
    (dict(kv_layout="rolling"), "kv_layout must be one of latest, single, first_then_shared"),
    (dict(kv_layout="single", kv_window=3), "give one"),
    (dict(policy="oracle", kv_layout="first_then_shared"), "use kv_layout latest or single"),
])
def test_engine_knobs_refuse_what_cannot_run_in_one_line(knobs, words):
    with pytest.raises(ExitbenchError) as err:
        ExitConfig(**knobs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_single_layout_is_a_one_slot_window_and_first_then_shared_its_own(model, prompts, tau):
    single = ExitConfig("second_order", threshold=tau, kv_layout="single")
    assert single.to_dict() == ExitConfig("second_order", threshold=tau, kv_window=1).to_dict()
    shared = ExitConfig("second_order", threshold=tau, max_steps=K, kv_layout="first_then_shared")
    assert shared.cache_layout() == (1, 1) and shared.to_dict()["kv_layout"] == "first_then_shared"
    cache = model.new_cache(2, 8, [K], *shared.cache_layout())
    assert {cache.slot(i) for i in range(K)} == {0, 1} and cache.slot(0) == 0
    assert cache.slot(torch.arange(4)).tolist() == [0, 1, 1, 1]
    runs = {}
    for layout in ("latest", "single", "first_then_shared"):
        knobs = dict(threshold=tau, max_steps=K, kv_layout=layout)
        runs[layout] = engine(model, "second_order", **knobs).generate(prompts, 3, batch_size=6)
        _same(runs[layout], engine(model, "second_order", **knobs).generate(prompts, 3, batch_size=1))
    # three layouts, three models of a token's context: the later tokens' exits tell them apart
    assert len({str(exit_steps(r)) for r in runs.values()}) == 3


@pytest.mark.parametrize("policy, knobs", [("second_order", {}), ("second_order", {"kv_layout": "single"}),
                                           ("second_order", {"kv_window": 3}), ("kl", {})])
def test_places_reading_their_keys_in_place_answer_as_the_gather(model, prompts, tau, policy, knobs, monkeypatch):
    """Keys read where they lie (KVCache.attend_in_place; forced, this model's are far below the switch) give the
    gather's tokens, exits and log-probabilities: free places at the spare slot (second order) or at the unread
    column (a window; kl, whose readout attends through the same places), and the path really ran with free places
    among busy ones."""
    threshold = tau if policy == "second_order" else 1e-3
    runs, calls = {}, []
    attend = KVCache.attend_in_place

    def spy(self, layer, index, *args):
        calls.append(index.busy is not None)
        return attend(self, layer, index, *args)

    monkeypatch.setattr(KVCache, "attend_in_place", spy)
    for read, bytes_from in (("gather", float("inf")), ("in place", 0)):
        monkeypatch.setattr(cache_module, "IN_PLACE_FROM", bytes_from)
        run = engine(model, policy, threshold=threshold, max_steps=K, **knobs)
        runs[read] = run.generate(prompts, 5, batch_size=4)
        assert bool(calls) == (read == "in place")
    assert any(calls) and not all(calls)  # some steps had free places, some none
    assert len({s for r in runs["gather"] for s in r.iterations}) >= 3  # the places sat at different iterations
    _same(runs["in place"], runs["gather"])


def test_keys_are_read_in_place_on_a_cpu_from_the_switchs_bytes(monkeypatch):
    """The switch reads the bytes of keys and values a place would copy per layer (2 · length · H_kv · D · 4 in
    float32), on a CPU only: a GPU wants a paged kernel, not a loop of small attentions."""
    monkeypatch.setattr(cache_module, "IN_PLACE_FROM", 128 * 1024)
    wide, narrow = KVCache(2, 8, 64, {0: 2}), KVCache(2, 2, 32, {0: 2})
    assert wide.reads_in_place(32) and not wide.reads_in_place(31)  # 2 · 32 · 512 · 4 = 128 KiB; 31 keys: 124
    assert not narrow.reads_in_place(255) and narrow.reads_in_place(256)  # 64 keys' width: 4× the length
    assert not KVCache(2, 8, 64, {0: 2}, device="meta").reads_in_place(1 << 20)


def test_the_in_place_bench_times_one_call_read_both_ways(monkeypatch, capsys):
    """bench/in_place.py's call is a real mixed step of places (own rows, positions and slots, some free): both reads
    agree on it (the bench checks before it times), and it prints one row per width and batch."""
    bench = bench_script("in_place")
    (q, k, v, ctx), index, busy, nbytes = bench.call(8, 128, 16, seed=0)
    assert index.busy is not None and len(busy) < 8 and len(set(ctx.index.write.tolist())) == 8
    assert nbytes == 2 * ctx.index.length * 128 * 4
    monkeypatch.setattr(sys, "argv", ["in_place.py", "--widths", "128,256", "--batch-sizes", "8", "--rounds", "1",
                                      "--calls", "1"])
    bench.main()
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["128", "8"], ["256", "8"]]


def test_prefixes_prefilled_alone_are_reused_bit_for_bit(model, prompts):
    """With a store, a prefix is prefilled alone, stored or not, so a stored one restores exactly what a fresh
    prefill gives: an engine whose store holds nothing gives the numbers of one whose store holds everything,
    the second time from the store; and a prompt prefilled alone is what batch size 1 prefills."""
    config = ExitConfig("second_order", threshold=1e-2, max_steps=K)
    store = PrefixStore(2**30)
    plain = ExitEngine(model, config, prefixes=PrefixStore(0)).generate(prompts, 3, batch_size=4)
    for run in range(2):
        with_store = ExitEngine(model, config, prefixes=store).generate(prompts, 3, batch_size=4)
        assert exit_steps(with_store) == exit_steps(plain)
        assert [r.logprobs for r in with_store] == [r.logprobs for r in plain]  # bit for bit
    distinct = len({tuple(p[:-1]) for p in prompts if len(p) > 1})
    assert store.misses == distinct and store.hits == distinct
    alone = [ExitEngine(model, config).generate([p], 1)[0] for p in prompts]
    stored = [ExitEngine(model, config, prefixes=store).generate([p], 1)[0] for p in prompts]
    assert [r.logprobs for r in alone] == [r.logprobs for r in stored]
    small = PrefixStore(1)  # holds nothing: each prefix larger than its budget
    ExitEngine(model, ExitConfig("fixed", threshold=K), prefixes=small).generate(prompts, 1)
    assert not small.held and small.bytes == 0


def test_full_depth_and_a_continuous_rule_share_their_prefilled_prompts(model, prompts):
    """Full depth runs no spare slot, a continuous rule one past max_steps that no prefix fills: both prefill the
    same slots at the same depth, so the rule restores what full depth stored, and gets what its own prefill gives."""
    rule = ExitConfig("second_order", threshold=1e-2, max_steps=K)
    store = PrefixStore(2**30)
    ExitEngine(model, ExitConfig("fixed", threshold=K), prefixes=store).generate(prompts, 1, batch_size=4)
    stored = store.misses
    restored = ExitEngine(model, rule, prefixes=store).generate(prompts, 3, batch_size=4)
    assert store.misses == stored and store.hits == stored > 0
    own = ExitEngine(model, rule, prefixes=PrefixStore(2**30)).generate(prompts, 3, batch_size=4)
    assert [r.logprobs for r in restored] == [r.logprobs for r in own]  # bit for bit


def test_the_engine_times_its_steady_state_until_the_queue_runs_dry(model, prompts, tau):
    eng = engine(model, "second_order", threshold=tau, max_steps=K)
    results = eng.generate(prompts, 5, batch_size=4)
    s = eng.stats
    assert 0 < s["steady_s"] < s["decode_s"] <= s["wall"]
    assert 0 < s["steady_work"] < s["work"] and 0 < s["steady_tokens"] < sum(len(r.records) for r in results)
    assert s["steady_token_iterations"] >= s["steady_tokens"]
    eng.stats = dict.fromkeys(eng.stats, 0.0)
    eng.generate(prompts[:4], 5, batch_size=4)  # no request ever waits: no steady state
    assert eng.stats["steady_s"] == 0 and eng.stats["decode_s"] > 0
