"""What the policy and engine tests compare the engine with: tiny models, a direct trajectory through the stage
view, the policies' formulas written out again in numpy, the exit rule as a plain loop, a reference engine, and
mixed workloads with thresholds that spread their exits.

Nothing here imports exitbench.policies: every expected value is computed independently of the classes
under test.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.models import AttnContext, LoopGroup, Stage

from helpers.models import make_tiny_raven

# Policies whose signal must pass *above* the threshold; every other rule exits below it.
EXITS_ABOVE = {"confidence", "margin", "argmax_stability", "fixed", "qexit", "gate"}
INTEGER_THRESHOLD = {"argmax_stability", "fixed"}
DISTRIBUTION = {"kl", "minp_kl", "entropy_diff", "argmax_stability", "confidence", "margin"}
RELATIVE = {"first_order", "second_order", "second_order_magnitude"}
# The policies of the roster that run on every architecture (the gate rules run on Ouro only).
ALL_POLICIES = ["kl", "minp_kl", "entropy_diff", "argmax_stability", "confidence", "margin", "first_order",
                "second_order", "second_order_magnitude", "cosine", "contraction", "learned", "fixed", "oracle"]


# ---- the learned rule's model, for tests: a small MLP with fixed random weights -------------------------------
# Written out here (not fitted) so the restatement below checks the policy's arithmetic, not a fit. The weights
# are small enough that tanh stays off its flat ends and the risk spreads over (0, 1) on any model's states.
LEARNED_FEATURES = ["log_k", "log_step", "log_rel_step", "log_second", "log_magnitude", "cos", "log_contraction",
                    "prev_log_step", "prev_log_rel_step", "prev_log_second", "prev_log_magnitude", "prev_cos",
                    "prev_log_contraction"]


def _test_exit_model() -> dict:
    rng = np.random.default_rng(0)
    n, hidden = len(LEARNED_FEATURES), 4
    first = 0.2 * rng.standard_normal((hidden, n))
    first[0, 1] = 1.0  # hidden unit 0 reads the step size mostly: the risk falls as steps shrink, so thresholds
    out = 0.3 * rng.standard_normal(hidden)  # on it exit at different iterations of one trajectory
    out[0] = -3.0
    return {"schema": "exitbench.exit_model", "schema_version": 1, "kind": "mlp", "features": LEARNED_FEATURES,
            "mean": [1.0] + [-3.0] * (n - 1), "scale": [1.0] + [2.0] * (n - 1),
            "hidden_weights": first.tolist(), "hidden_bias": (0.1 * rng.standard_normal(hidden)).tolist(),
            "weights": out.tolist(), "bias": 0.2,
            "checkpoint": {"fingerprint": "test", "path": "none"}}


TEST_EXIT_MODEL = _test_exit_model()


def exit_model_file() -> str:
    """TEST_EXIT_MODEL as a file (one per test process, removed when it ends: it outlives any one tmp_path)."""
    import atexit
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"exitbench-test-exit-model-{os.getpid()}.json")
    if not os.path.exists(path):
        with open(path, "w") as fh:
            json.dump(TEST_EXIT_MODEL, fh)
        atexit.register(lambda: os.path.exists(path) and os.remove(path))
    return path


# The conjunction the roster-wide tests run: a latent rule (varied) and a decoding one, lenient enough that the
# tests' thresholds for second_order spread its exits too (tests/test_conjunction.py tests conjunctions proper).
CONJUNCTION = {"rules": [{"policy": "second_order"}, {"policy": "margin", "threshold": 0.01}]}


def knobs_for(policy: str) -> dict:
    """The knobs a policy cannot run without: the learned rule's exit model, a conjunction's rules, the budgeted
    prefill exits' prompt run with exits."""
    if policy == "all_of":
        return CONJUNCTION
    if policy in ("prefill_topk", "prefill_random"):
        return {"prefill": "exit"}
    return {"exit_model": exit_model_file()} if policy == "learned" else {}


def varied(policy: str) -> str:
    """The rule whose threshold a policy's τ is: a conjunction's varied member, else the policy itself."""
    return CONJUNCTION["rules"][0]["policy"] if policy == "all_of" else policy


def learned_risk(states: np.ndarray, model: dict = TEST_EXIT_MODEL) -> np.ndarray:
    """The learned rule's signal after iterations 1 … K, from s_0 … s_K, restated from the feature
    definitions in exitbench/policies/learned.py's docstring (Δ_0 = 0, logs floored at 1e-12, lags at k = 1
    zero), with each norm taken directly in float64."""
    floor = 1e-12
    s = states.astype(np.float32).astype(np.float64)
    K = s.shape[0] - 1
    norm = lambda v: float(np.sqrt(np.sum(v ** 2)))  # noqa: E731
    log = lambda v: math.log(max(v, floor))  # noqa: E731
    prev_delta, prev_step, largest, lag = np.zeros_like(s[0]), 0.0, 0.0, [0.0] * 6
    out = np.empty(K)
    for k in range(1, K + 1):
        delta = s[k] - s[k - 1]
        step = norm(delta)
        largest = max(largest, step)
        both = step * prev_step
        cos = float(delta @ prev_delta) / both if both > 0 else 0.0
        current = [log(step), log(step) - log(norm(s[k])), log(norm(delta - prev_delta)),
                   log(abs(step - prev_step)), max(-1.0, min(1.0, cos)), log(step) - log(largest)]
        f = np.array([math.log(k)] + current + lag)
        lag, prev_delta, prev_step = current, delta, step
        named = dict(zip(LEARNED_FEATURES, f))
        x = np.array([(named[n] - m) / sc for n, m, sc in zip(model["features"], model["mean"], model["scale"])])
        if model["kind"] == "mlp":
            z = np.tanh(np.array(model["hidden_weights"]) @ x + np.array(model["hidden_bias"])) @ \
                np.array(model["weights"]) + model["bias"]
        else:
            z = np.array(model["weights"]) @ x + model["bias"]
        out[k - 1] = 1.0 / (1.0 + math.exp(z))
    return out


def tiny(init_scale: float = 1.0, seed: int = 0, mean: int = 8, max_rec: int = 16):
    return make_tiny_raven(seed, init_scale=init_scale, mean_recurrence=mean, max_recurrence=max_rec)


def engine(model, policy: str, **knobs) -> ExitEngine:
    knobs.setdefault("record_signals", True)
    knobs = {**knobs_for(policy), **knobs}
    return ExitEngine(model, ExitConfig(policy=policy, **knobs))


# ---- a direct trajectory at position 0 -------------------------------------------------------------

@torch.no_grad()
def direct_trajectory(model, t0s: list[int], K: int, noise: torch.Tensor | None):
    """States s_0 … s_K (B, K+1, d) as float32 numpy, and float64 log-probs (B, K, V) of the readout at
    s_1 … s_K, for tokens t0s each alone at position 0, through the stage view (no cache, no engine).

    `noise` is the unit initial-state noise row for position 0 (d,), or None when the model has none.
    """
    stages = model.stages()
    gi = next(i for i, s in enumerate(stages) if isinstance(s, LoopGroup))
    group = stages[gi]
    ctx = AttnContext(start=0, cache=None)
    x = model.embed(torch.tensor(t0s).view(-1, 1), 0)
    for st in stages[:gi]:
        x = st.run(x, ctx)
    nz = None if noise is None else noise.view(1, 1, -1).expand(x.shape[0], 1, -1)
    s = group.init(x, nz)
    states, logps = [s[:, 0].clone()], []
    for i in range(K):
        s = group.step(s, x, ctx.at_iteration(i))
        states.append(s[:, 0].clone())
        y = group.finish(s)
        for st in stages[gi + 1:]:
            assert isinstance(st, Stage), "helper written for one loop group"
            y = st.run(y, ctx)
        logits = model.head(y)[:, 0].double()
        logps.append(torch.log_softmax(logits, -1))
    return torch.stack(states, 1).numpy(), torch.stack(logps, 1).numpy()


# ---- the formulas, restated -------------------------------------------------------------------------

def _kl(lp_prev: np.ndarray, lp: np.ndarray) -> float:
    return float(np.sum(np.exp(lp_prev) * (lp_prev - lp)))


def _minp(lp: np.ndarray, min_p: float = 0.1) -> np.ndarray:
    p = np.exp(lp)
    V = p.shape[-1]
    q = np.where(p >= min_p * p.max(), p, 1.0 / V)
    return np.log(q / q.sum())


def direct_signals(name: str, states: np.ndarray, logps: np.ndarray, relative: bool = False) -> np.ndarray:
    """The signal after iterations 1 … K of one token, from s_0 … s_K (K+1, d) and log p_1 … p_K (K, V)."""
    K = logps.shape[0]
    V = logps.shape[1]
    s = states.astype(np.float32)
    delta = [None] + [(s[k] - s[k - 1]).astype(np.float64) for k in range(1, K + 1)]  # Δ_k, float32 diff
    s64 = s.astype(np.float64)
    norm = lambda v: float(np.sqrt(np.sum(v * v)))  # noqa: E731
    out = np.empty(K)
    for k in range(1, K + 1):
        lp = logps[k - 1]
        lp_prev = logps[k - 2] if k >= 2 else None
        if name == "first_order":
            v = norm(delta[k])
        elif name == "second_order":
            v = math.inf if k == 1 else norm(delta[k] - delta[k - 1])
        elif name == "second_order_magnitude":
            v = math.inf if k == 1 else abs(norm(delta[k]) - norm(delta[k - 1]))
        elif name == "contraction":
            if k == 1:
                v = math.inf
            else:
                step, before = norm(delta[k]), norm(delta[k - 1])
                rate = 0.0 if step == 0 else (math.inf if before == 0 else step / before)
                capped = min(rate, 0.999)
                v = step * capped / (1 - capped) / norm(s64[k]) if rate < 1 else math.inf
        elif name == "cosine":
            a, b = s64[k], s64[k - 1]
            v = 1.0 - float(a @ b) / max(norm(a) * norm(b), 1e-8)
        elif name == "kl":
            v = _kl(np.full(V, -math.log(V)) if lp_prev is None else lp_prev, lp)
        elif name == "minp_kl":
            v = _kl(np.full(V, -math.log(V)) if lp_prev is None else _minp(lp_prev), _minp(lp))
        elif name == "entropy_diff":
            ent = lambda x: -float(np.sum(np.exp(x) * x))  # noqa: E731
            v = math.inf if k == 1 else abs(ent(lp) - ent(lp_prev))
        elif name == "confidence":
            v = float(np.exp(lp.max()))
        elif name == "margin":
            top2 = np.sort(lp)[-2:]
            v = float(top2[1] - top2[0])
        elif name == "argmax_stability":
            run = 0
            for j in range(2, k + 1):
                run = run + 1 if logps[j - 1].argmax() == logps[j - 2].argmax() else 0
            v = float(run)
        elif name == "fixed":
            v = float(k)
        elif name == "learned":
            v = learned_risk(states)[k - 1]
        else:
            raise KeyError(name)
        if relative and not math.isinf(v):
            v = v / norm(s64[k])
        out[k - 1] = v
    return out


def expected_exit(signals, threshold: float, above: bool, min_steps: int, patience: int, K: int) -> int:
    """The exit rule as a plain loop: `patience` consecutive hits with k ≥ min_steps, or k = K."""
    streak = 0
    for k in range(1, K + 1):
        v = float(signals[k - 1])
        hit = (v >= threshold) if above else (v < threshold)  # NaN and ±inf never hit the right way
        streak = streak + 1 if hit else 0
        if k >= K or (k >= min_steps and streak >= patience):
            return k
    raise AssertionError("unreachable")


def oracle_exit(logps: np.ndarray, target: int | None, eps: float, min_steps: int = 1) -> int:
    """Earliest k with agreement at every j ≥ k (argmax for generation, target log-prob within ε)."""
    K = logps.shape[0]
    if target is None:
        agree = [logps[j].argmax() == logps[K - 1].argmax() for j in range(K)]
    else:
        agree = [logps[j, target] >= logps[K - 1, target] - eps for j in range(K)]
    k = K
    while k > 1 and agree[k - 2]:
        k -= 1
    return max(k, min_steps)


def assert_signals_close(got, want, upto: int, rtol: float, atol: float, what: str = "") -> None:
    """got (engine record, NaN after the exit) vs want (direct) on iterations 1 … upto."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    for k in range(1, upto + 1):
        g, w = got[k - 1], want[k - 1]
        if math.isinf(w):
            assert g == w, f"{what} k={k}: engine {g}, direct {w}"
        else:
            assert abs(g - w) <= rtol * abs(w) + atol, f"{what} k={k}: engine {g!r}, direct {w!r}"
    assert np.all(np.isnan(got[upto:])), f"{what}: signals after the exit at {upto} must be NaN: {got[upto:]}"


# ---- a reference engine, one sequence, written directly on the stage view ---------------------------

@torch.no_grad()
def reference_run(model, tokens: list[int], first_scored: int, last: int, rule, K: int, *,
                  prefill: str = "full", warm_start: bool = False, noise_table=None, need_logits: bool = False):
    """Run positions 0 … last of one sequence token by token, the way the engine is documented to:

    positions before `first_scored` run at depth K (prefill="full") or with exits (prefill="exit"); the
    others run until rule(pos, k, states, logps) says exit (or k = K), where logps holds the readout's
    log-probs after each iteration so far when `need_logits` (each readout writes the coda's KV entry, so the
    last one, at the exit, is what later tokens read); a token exiting at e < K has its core KV entries
    at slot e−1 copied into slots e … K−1 (done here by direct indexing, not KVCache.carry_forward).
    Initial states: the position's noise row, or with warm_start the previous position's final state for
    positions run with exits. Returns per-position (exit step, log-probs (V,) float64).
    """
    stages = model.stages()
    gi = next(i for i, s in enumerate(stages) if isinstance(s, LoopGroup))
    group = stages[gi]
    cache = model.new_cache(1, last + 1, [K])
    out = []
    prev_final = None
    def readout(s, ctx):
        y = group.finish(s)
        for st in stages[gi + 1:]:
            y = st.run(y, ctx)
        return torch.log_softmax(model.head(y)[0, 0].double(), -1).numpy()

    for pos in range(last + 1):
        adaptive = pos >= first_scored or prefill == "exit"
        ctx = AttnContext(start=pos, cache=cache)
        x = model.embed(torch.tensor([[tokens[pos]]]), pos)
        for st in stages[:gi]:
            x = st.run(x, ctx)
        nz = None if noise_table is None else noise_table[pos].view(1, 1, -1)
        s = group.init(x, nz)
        if warm_start and adaptive and prev_final is not None:
            s = prev_final
        states, logps = [s[0, 0]], []
        e = K
        for i in range(K):
            s = group.step(s, x, ctx.at_iteration(i))
            states.append(s[0, 0])
            if adaptive and need_logits:
                logps.append(readout(s, ctx))
            if adaptive and i + 1 < K and rule(pos, i + 1, states, logps):
                e = i + 1
                break
        if e < K:
            for layer in group.attn_layers:
                for store in (cache.k, cache.v):
                    store[layer][e:, 0, pos] = store[layer][e - 1, 0, pos].clone()  # (slots, batch, positions, H, D)
        prev_final = s
        out.append((e, logps[-1] if logps else readout(s, ctx)))
    return out


def first_order_rule(tau: float):
    def rule(pos, k, states, logps):
        return float(torch.linalg.vector_norm((states[k] - states[k - 1]).double())) < tau
    return rule


def kl_rule(tau: float):
    """KL(p_{k−1} ‖ p_k) < τ with p_0 uniform."""
    def rule(pos, k, states, logps):
        lp = logps[k - 1]
        prev = logps[k - 2] if k >= 2 else np.full_like(lp, -math.log(lp.shape[-1]))
        return _kl(prev, lp) < tau
    return rule


# ---- comparing engine results -----------------------------------------------------------------------

LOGP_TOL = 1e-5  # batching and the reference loops agree on log-probabilities within this


def logprobs_close(a, b, tol=LOGP_TOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def exit_steps(results) -> list[list[list[int]]]:
    """Each request's tokens' exit steps per loop group."""
    return [[rec.exit_steps for rec in r.records] for r in results]


# ---- workloads and threshold choice for the batching tests ------------------------------------------

def mixed_requests(n: int = 16, seed: int = 0, vocab: int = 100, min_len: int = 2, max_len: int = 9):
    """n scoring requests of mixed lengths and context sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(min_len, max_len + 1))
        out.append(([int(t) for t in rng.integers(3, vocab, L)], int(rng.integers(1, L))))
    return out


def mixed_prompts(n: int = 8, seed: int = 1, vocab: int = 100, max_len: int = 7):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(1, max_len + 1)))] for _ in range(n)]


def spread_threshold(results, policy: str, K: int, min_steps: int = 1, patience: int = 1,
                     floor: float = 1e-4) -> float:
    """From a recorded run that (almost) never exits, a threshold under which the recorded trajectories would
    exit at as many different steps as possible, placed in a wide gap between observed signal values.

    Thresholds stay above `floor` and far above the float32 noise floor of the signal (a KL or 1 − cos of two
    nearly equal vectors comes out as ±1e-7 noise, negative values included): down there an exit is decided
    by rounding, which differs with the batch shape.
    """
    above = policy in EXITS_ABOVE
    sigs = [np.asarray(rec.signals[0], dtype=np.float64) for r in results for rec in r.records]
    vals = np.unique(np.concatenate([s[np.isfinite(s)] for s in sigs]))
    noise = float(-vals.min()) if vals.size and vals.min() < 0 else 0.0
    vals = vals[vals > max(floor, 1000 * noise)]
    best, best_score = None, (-1, 0.0)
    for q in np.linspace(0.05, 0.95, 19):
        i = min(int(q * (len(vals) - 1)), len(vals) - 2)
        lo, hi = vals[i], vals[i + 1]
        tau = float(math.sqrt(lo * hi))
        exits = {expected_exit(s, tau, above, min_steps, patience, K) for s in sigs}
        score = (len(exits), (hi - lo) / hi)
        if score > best_score:
            best, best_score = tau, score
    return best
