"""A threshold with a statistical guarantee: Learn then Test (Angelopoulos, Bates et al. 2021), as CALM
(Schuster et al. 2022) uses it for early exits.

The risk of a threshold τ is the expected share of a document's scored tokens whose prediction at the exit
differs from the prediction at full depth (the policy's max steps): a label-free consistency loss in [0, 1],
so any text calibrates. For each τ of a grid, ordered from the most conservative, the null hypothesis
"risk(τ) > ε" gets a Hoeffding–Bentkus p-value from the calibration documents' losses; fixed-sequence testing
rejects while p ≤ δ and stops at the first failure. The last rejected τ then has risk ≤ ε with probability at
least 1 − δ over the draw of calibration documents, assuming they are i.i.d. from the distribution the
threshold will serve. Documents, not tokens, are the units: tokens of one document are not independent.
"""
from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from ..engine import ExitConfig, ExitEngine
from ..engine.recorder import check_recordable
from ..errors import ExitbenchError
from ..policies import REGISTRY, ExitPolicy
from ..runtime.files import atomic_write
from ..runtime.provenance import run_metadata
from ..runtime.validation import at_least

SCHEMA, SCHEMA_VERSION = "exitbench.calibration", 1
UNCALIBRATABLE = {"fixed": "it has no threshold to choose", "oracle": "it is a bound that needs the answer"}


# ---- the statistics --------------------------------------------------------------------------------------
def binom_cdf(k: int, n: int, p: float) -> float:
    """P(Bin(n, p) ≤ k), summed in log space so that n in the thousands stays exact to float precision."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _kl_bernoulli(a: float, b: float) -> float:
    """h(a, b) = a log(a/b) + (1 − a) log((1 − a)/(1 − b)), with 0 log 0 = 0."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def hb_pvalue(mean_loss: float, n: int, epsilon: float) -> float:
    """Hoeffding–Bentkus p-value of H0: risk > ε, from n i.i.d. losses in [0, 1] with mean `mean_loss`
    (Bates, Angelopoulos et al. 2021, "Distribution-free, risk-controlling prediction sets", Prop. 3)."""
    if n < 1:
        return 1.0
    hoeffding = math.exp(-n * _kl_bernoulli(min(mean_loss, epsilon), epsilon))
    bentkus = math.e * binom_cdf(math.ceil(n * mean_loss - 1e-9), n, epsilon)
    return min(1.0, hoeffding, bentkus)


def documents_needed(epsilon: float, delta: float) -> int:
    """The fewest documents with which even a threshold that never disagrees can be shown safe:
    the p-value of zero loss is (1 − ε)^n, which must reach δ."""
    return math.ceil(math.log(delta) / math.log1p(-epsilon))


def fixed_sequence(pvalues: Sequence[float], delta: float) -> int:
    """How many hypotheses, in the given order, fixed-sequence testing rejects at level δ."""
    accepted = 0
    for p in pvalues:
        if p > delta:
            break
        accepted += 1
    return accepted


def conservative_order(policy: "str | ExitPolicy", thresholds: Sequence[float]) -> list[float]:
    """The grid from the threshold that exits latest to the one that exits earliest (a built rule: a
    conjunction runs in its varied member's direction)."""
    below = REGISTRY[policy].exits_below if isinstance(policy, str) else policy.exits_below
    return sorted(set(thresholds), reverse=not below)


# ---- the losses ------------------------------------------------------------------------------------------
def predictions(engine: ExitEngine, docs: Sequence[list[int]], batch_size: int,
                on_batch: Callable[[], None] | None = None) -> tuple[list[list[int]], list[float]]:
    """Per document, the argmax prediction at every scored position; and the mean iterations per token."""
    preds, iters = [], []
    for i in range(0, len(docs), batch_size):
        for res in engine.score([(d, 1) for d in docs[i:i + batch_size]], keep_distributions=True):
            preds.append([int(lp.argmax()) for lp in res.distributions])
            iters += [sum(r.exit_steps) for r in res.records]
        if on_batch is not None:
            on_batch()
    return preds, iters


def replayed_predictions(model, docs: Sequence[list[int]], configs: Sequence[ExitConfig], reference_steps: int,
                         seed: int, batch_size: int, on_batch: Callable[[], None] | None = None
                         ) -> tuple[list[list[int]], list[float], list[tuple[list[list[int]], list[float]]]]:
    """`predictions` for the reference and every config from one recording pass (exitbench.replay): the
    reference's, then each config's (predictions, iterations)."""
    import numpy as np

    from ..engine.recorder import Recorder, Sequence_

    groups = model.loop_groups()
    policies = [c.bound_policies(groups) for c in configs]
    depth = max([reference_steps] + [p.max_steps for ps in policies for p in ps])
    recorder = Recorder(model, depth, [ps[0] for ps in policies], [reference_steps], seed,
                        [min(g.default_steps, depth) for g in groups], oracle=False)
    trajs = []
    for i in range(0, len(docs), batch_size):
        trajs += recorder.record([Sequence_(list(d[:-1]), 0, [list(d[1:])]) for d in docs[i:i + batch_size]])
        if on_batch is not None:
            on_batch()
    at_depth = lambda t, r: t.fixed_top[r] if r in t.fixed_top else t.top[-1][:, r - 1]  # noqa: E731
    reference = [at_depth(t, reference_steps).tolist() for t in trajs]
    per_config = []
    for ps in policies:
        preds, iters = [], []
        for t in trajs:
            steps = t.exits(ps)
            preds.append(t.top[-1][np.arange(len(steps)), steps[:, -1] - 1].tolist())
            iters += steps.sum(1).tolist()
        per_config.append((preds, iters))
    return reference, [float(reference_steps * len(groups))] * sum(map(len, reference)), per_config


def disagreement(preds: Sequence[list[int]], reference: Sequence[list[int]]) -> list[float]:
    """Per document, the share of positions whose prediction differs from the reference's."""
    return [sum(a != b for a, b in zip(p, r)) / len(r) for p, r in zip(preds, reference)]


def split(docs: Sequence[list[int]], test_fraction: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    order = list(range(len(docs)))
    random.Random(f"calibrate-{seed}").shuffle(order)
    n_test = int(round(test_fraction * len(docs)))
    test = sorted(order[:n_test])
    cal = sorted(order[n_test:])
    return [docs[i] for i in cal], [docs[i] for i in test]


# ---- the procedure ---------------------------------------------------------------------------------------
def check_calibratable(policy: str, threshold: float | None = None, grid: str | None = None) -> None:
    """Refused before the checkpoint loads: a rule with no threshold to choose, a threshold already chosen, or a
    grid of quantiles (`grid`, calibrate's --thresholds)."""
    from ..policies.grids import parse_quantiles

    if grid is not None and parse_quantiles(grid):
        # Learn-then-test holds only for hypotheses fixed before the calibration documents are read.
        raise ExitbenchError(f"calibrate --thresholds {grid.strip()}: the guarantee needs a grid chosen "
                             "before the documents are read; take the values a run derived (`exitbench run "
                             "--thresholds quantiles:N` records them in each cell's run.thresholds)")
    if policy in UNCALIBRATABLE:
        raise ExitbenchError(f"calibrate: policy {policy!r} cannot be calibrated: {UNCALIBRATABLE[policy]}; "
                             f"pick a threshold rule such as second_order or kl")
    if threshold is not None:  # only an exit-config file gives one: calibrate has no --threshold
        raise ExitbenchError(f"calibrate chooses the threshold, and the exit config sets threshold {threshold:g}; "
                             "drop it from the file (calibrate --thresholds takes a grid to choose from)")


def calibrate(model, docs: Sequence[list[int]], config: ExitConfig, thresholds: Sequence[float], *,
              epsilon: float, delta: float, test_fraction: float = 0.5, seed: int = 0, batch_size: int = 16,
              on_progress: Callable[[int, int], None] | None = None, replay: bool = False) -> dict[str, Any]:
    """Choose the most aggressive threshold of `thresholds` whose consistency risk is ≤ ε with probability
    ≥ 1 − δ; report every threshold's calibration risk, p-value and mean iterations, and the chosen one's
    risk on held-out documents. With `replay`, every threshold's predictions come from one recording pass
    per split (exitbench.replay: every position's context at full depth, where the exact run reads an exited
    token's own depth), instead of one exact run per threshold. Under a KV window (`kv_window`) the reference is
    full depth under the same window: the risk is what the exits cost in the cache regime that will serve."""
    _check_request(config, thresholds, epsilon, delta, test_fraction, batch_size, replay, model.loop_groups())
    engines = {tau: ExitEngine(model, _at_threshold(config, tau))
               for tau in conservative_order(config.build_policy(), thresholds)}  # validates every threshold first
    cal, test = split([list(d) for d in docs], test_fraction, seed)
    if not cal:
        raise ExitbenchError("calibrate: no calibration documents left after the held-out split")
    reference = ExitEngine(model, ExitConfig.fixed_depth(config.max_steps, config.to_dict()))
    batches = -(-len(cal) // batch_size)
    progress = _Progress(on_progress, 2 * batches if replay else batches * (len(engines) + 1))
    run = functools.partial(_per_threshold, model, config, reference, engines, replay, batch_size, progress.tick)
    taus = list(engines)
    ref_preds, ref_iters, runs = run(cal, taus)
    full_depth = sum(ref_iters) / len(ref_iters)
    rows = [{"threshold": tau, **_measured(preds, ref_preds, iters, epsilon)}
            for tau, (preds, iters) in zip(taus, runs)]
    accepted = fixed_sequence([r["p_value"] for r in rows], delta)
    for i, r in enumerate(rows):
        r["accepted"] = i < accepted
    chosen = rows[accepted - 1] if accepted else None
    held_out = None
    if chosen is not None and test:
        progress.total += 2 * -(-len(test) // batch_size)
        test_ref, _, ((test_preds, test_iters),) = run(test, [chosen["threshold"]])
        held_out = {"documents": len(test), **_measured(test_preds, test_ref, test_iters)}
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "config": config.to_dict(),
            "reference": reference.config.to_dict(),
            "mode": "replay" if replay else "exact",
            "epsilon": epsilon, "delta": delta, "loss": "share of a document's scored tokens whose exit prediction "
            "differs from full depth", "documents": {"calibration": len(cal), "held_out": len(test)},
            "tokens": {"calibration": sum(len(d) - 1 for d in cal)}, "full_depth_iterations": full_depth,
            "documents_needed": documents_needed(epsilon, delta),
            "thresholds": rows, "chosen": chosen, "held_out": held_out, "run": run_metadata(seed=seed)}


def _check_request(config: ExitConfig, thresholds: Sequence[float], epsilon: float, delta: float,
                   test_fraction: float, batch_size: int, replay: bool, groups: Sequence[Any]) -> None:
    """Refuse what calibrate cannot do before anything runs."""
    check_calibratable(config.policy)
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ExitbenchError(f"calibrate: --{name} must lie strictly between 0 and 1, got {value!r}")
    if not 0 <= test_fraction < 1:
        raise ExitbenchError(f"calibrate: --test-fraction must be in [0, 1), got {test_fraction!r}")
    at_least("calibrate: --batch-size", batch_size)
    if not thresholds:
        raise ExitbenchError(f"calibrate: policy {config.policy!r} has no threshold grid; pass --thresholds")
    if replay:
        check_recordable(config.to_dict(), "calibrate")
    for tau in thresholds:
        why = _at_threshold(config, tau).never_exits_early(groups)
        if why is not None:
            raise ExitbenchError(f"calibrate: {why}")


def chosen_grid(ck, config: ExitConfig, grid: str | None) -> list[float]:
    """The thresholds to choose from: `grid` (calibrate's --thresholds) or the model's (`grid_for`), once the
    checkpoint is loaded and a learned rule's file is known to be fitted to it."""
    from ..policies.learned import check_fitted_for
    from ..policies.grids import parse_thresholds

    check_fitted_for(ck, config.fitted_exit_model)
    return parse_thresholds(grid) or grid_for(ck.model, config)


def grid_for(model, config: ExitConfig) -> list[float]:
    """The thresholds calibrate chooses from by default: the model's grid for the rule (a conjunction's varied
    member's), less those at which it could never exit before full depth (a τ that counts iterations)."""
    rule = config.build_policy()
    grid = list(model.exit_grids().get(rule.vary or config.policy, rule.default_grid))
    groups = model.loop_groups()
    return [tau for tau in grid if _at_threshold(config, tau).never_exits_early(groups) is None] or grid


def _at_threshold(config: ExitConfig, tau: float) -> ExitConfig:
    return ExitConfig.from_dict({**config.to_dict(), "threshold": tau})


class _Progress:
    """Batches done out of those planned (`total`, which grows when the held-out split is planned), told to
    `on_progress` after each batch."""

    def __init__(self, on_progress: Callable[[int, int], None] | None, total: int):
        self.on_progress, self.total, self.done = on_progress, total, 0

    def tick(self) -> None:
        self.done += 1
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)


def _per_threshold(model, config: ExitConfig, reference: ExitEngine, engines: dict[float, ExitEngine],
                   replay: bool, batch_size: int, tick: Callable[[], None], docs: list[list[int]],
                   taus: list[float]) -> tuple[list[list[int]], list[float], list[tuple[list[list[int]], list[float]]]]:
    """On `docs`: the reference's predictions and iterations, and each threshold's (predictions, iterations),
    from one recording pass (`replay`) or one exact run each."""
    if replay:
        configs = [_at_threshold(config, tau) for tau in taus]
        return replayed_predictions(model, docs, configs, reference.policies[0].max_steps, config.seed, batch_size,
                                    tick)
    ref_preds, ref_iters = predictions(reference, docs, batch_size, tick)
    return ref_preds, ref_iters, [predictions(engines[tau], docs, batch_size, tick) for tau in taus]


def _measured(preds: Sequence[list[int]], reference: Sequence[list[int]], iters: Sequence[float],
              epsilon: float | None = None) -> dict[str, float]:
    """The risk of `preds` against the reference, its p-value under ε where ε is given, and the mean
    iterations."""
    losses = disagreement(preds, reference)
    risk = sum(losses) / len(losses)
    pvalue = {} if epsilon is None else {"p_value": hb_pvalue(risk, len(losses), epsilon)}
    return {"risk": risk, **pvalue, "mean_iterations": sum(iters) / len(iters)}


def write_report(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda fh: json.dump(report, fh, indent=2))
