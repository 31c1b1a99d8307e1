"""Threshold grids from data: `--thresholds quantiles:N` places each rule's thresholds at quantiles of its own
signal, read from one recording pass, so that a rule whose scale differs per model (a latent step norm, a KL)
needs no constants guessed for each checkpoint.

As the peer vLLM-Hook calibrates (`analyze_signals.py`): N quantiles evenly spaced from the 2% to the 98% quantile
of the rule's finite, defined signal values (iterations 1 … max_steps, every scored token), rounded to 3
significant digits (a cell's file name and key carry the threshold), deduplicated. A rule that counts iterations
(argmax_stability) gets whole numbers ≥ 1, none at which it could never exit before full depth; thresholds must
be > 0, so other values ≤ 0 are dropped. Rules without a signal (fixed depths, the oracle) keep their own handling.

From a notebook:

    recording = ...  # a RecordingLM, or any list of engine.recorder.Trajectories
    grids = derive_grids(trajectories(recording), configs, model.loop_groups(), n=9)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..engine import ExitConfig
from ..engine.recorder import Trajectories, variant_key
from ..errors import ExitbenchError
from ..policies import REGISTRY, ExitPolicy

SPAN = (0.02, 0.98)
# Documents per task an exact sweep records to place its grid (the peer calibrates on 64–256 examples). The
# smallest of those: the pass reads the readout at every iteration, so it costs more than a cell, and the 2–98%
# quantiles of a few thousand token-iterations are already stable to the 3 digits a threshold keeps.
SAMPLE_DOCS = 64


def trajectories(recording: Any) -> list[Trajectories]:
    """Every recorded pass of a RecordingLM once (the options of a question share theirs)."""
    seen: dict[int, Trajectories] = {}
    for entry in recording.store.values():
        for traj, _ in entry.parts:
            seen.setdefault(id(traj), traj)
    return list(seen.values())


def signal_values(trajs: Iterable[Trajectories], policies: Sequence[ExitPolicy]) -> np.ndarray:
    """One rule's finite, defined signal values over a recording: iterations 1 … max_steps of every scored token,
    loop group g as `policies[g]` reads it (a config's groups share one threshold, so their values are pooled)."""
    parts = []
    for traj in trajs:
        for g, policy in enumerate(policies):
            values = traj.signals[g].get(variant_key(policy))
            if values is None:
                continue
            if values.ndim == 3:  # a conjunction records one column per member; a sweep varies one of them
                values = values[:, :, policy.varied]
            values = values[:, :policy.max_steps].ravel()  # ±inf before the rule's signal is defined
            parts.append(values[np.isfinite(values)])
    return np.concatenate(parts) if parts else np.zeros(0)


def levels(n: int) -> np.ndarray:
    """The quantile levels of `quantiles:N`: N evenly spaced over SPAN; one is the median (the span's middle)."""
    return np.linspace(*SPAN, n) if n > 1 else np.array([0.5])


def quantile_grid(values: np.ndarray, n: int, name: str) -> list[float]:
    """N thresholds at the quantiles of `values` from 2% to 98%, rounded and deduplicated (module docstring);
    ExitbenchError, naming the rule, when none is left."""
    cls = REGISTRY[name]
    qs = np.quantile(values, levels(n)) if len(values) else np.zeros(0)
    if cls.integer_threshold:
        out = sorted({max(1, int(round(q))) for q in qs})
    else:
        out = sorted({float(f"{q:.3g}") for q in qs if float(f"{q:.3g}") > 0})
    if not out:
        what = ("no finite value" if not len(values) else
                f"all {len(values)} of its finite values are ≤ 0 ({qs.min():.3g} … {qs.max():.3g})")
        raise ExitbenchError(f"--thresholds quantiles:{n}: {name}'s recorded signal has {what}, and thresholds "
                             f"must be > 0; give {name} comma-separated thresholds instead")
    return out


def derive_grids(trajs: Sequence[Trajectories], configs: Sequence[ExitConfig], groups: Sequence[Any], n: int
                 ) -> dict[str, list[float]]:
    """Each swept rule's grid from its recorded signal (one config per rule suffices: a recording of the signal
    does not depend on the threshold). Rules without a signal (fixed, the oracle) are left out. A conjunction's
    grid is its varied member's, keyed by that member's name as the sweep's grid looks it up."""
    grids: dict[str, list[float]] = {}
    for config in configs:
        cls = REGISTRY[config.policy]
        if cls.signal_free or cls.retrospective:
            continue
        policies = config.bound_policies(groups)
        members = getattr(policies[0], "members", None)
        name = members[policies[0].varied].name if members else config.policy
        if name not in grids:
            grid = quantile_grid(signal_values(trajs, policies), n, name)
            # A threshold that counts iterations may be one at which the rule never exits before full depth (τ = 15
            # of a 16-step loop): not a point of its grid. The sweep refuses a rule left with none.
            grids[name] = [t for t in grid if not REGISTRY[name].integer_threshold
                           or dataclasses.replace(config, threshold=t).never_exits_early(groups) is None] or grid
    return grids


def derive_for_sweep(ck: Any, tasks: Any, cfg: Any, configs: list[ExitConfig],
                     warn: Callable[[str], None] | None = None) -> Any:
    """Set `cfg.derived` (the grids and how they were made) from one recording pass over the sweep's documents.
    Returns the ReplaySweep that recorded under --replay, whose recording its cells then reuse; else None.
    `configs`: the sweep's configs at any thresholds (the rules' own grids): they say which signals to record."""
    from ..runtime.distributed import init_distributed
    from .replay import ReplaySweep
    from .schedule import SweepPlan

    if init_distributed()[1] > 1:
        # Each rank would record only its share of the documents and derive a grid of its own.
        raise ExitbenchError(f"--thresholds quantiles:{cfg.quantiles} records in one process; run it without "
                             "torchrun, or give comma-separated thresholds")
    if cfg.replay:
        record_cfg, documents, recorded = cfg, "every document of the sweep (the replay recording)", configs
    else:
        # The grid only places the exact cells, so its sample is recorded the default way (the replay recording:
        # prompt at full depth, one KV slot per iteration, no chat template) on the first documents of each task.
        engine = set(ExitConfig.names(role="engine"))
        limit = cfg.limit if isinstance(cfg.limit, float) else min(cfg.limit or SAMPLE_DOCS, SAMPLE_DOCS)
        record_cfg = dataclasses.replace(cfg, replay=True, limit=limit, shard=(0, 1), preset=None,
                                         prompting=type(cfg.prompting)(),
                                         exit={k: v for k, v in cfg.exit.items() if k not in engine})
        documents = f"the first {limit:g} documents of each task" if limit >= 1 else f"{limit:g} of each task"
        # Only the rules with a signal: a baseline depth or the oracle would add readouts no grid needs.
        recorded = [c for c in configs if not (REGISTRY[c.policy].signal_free or REGISTRY[c.policy].retrospective)]
    if not recorded:
        cfg.derived = {"from": f"quantiles:{cfg.quantiles}", "grids": {}}
        return None
    if warn:
        warn(f"thresholds: recording {', '.join(tasks.names)} for quantiles:{cfg.quantiles} of each rule's signal")
    provisional = SweepPlan([(t, c, {}) for t in range(len(tasks.names)) for c in recorded], {}, {})
    replayer = ReplaySweep(ck, tasks, record_cfg, provisional)
    replayer.record(costs=cfg.replay)  # the cost model only replay cells need
    trajs = trajectories(replayer.recording)
    groups = ck.model.loop_groups()
    cfg.derived = {"from": f"quantiles:{cfg.quantiles}", "span": list(SPAN), "recorded": documents,
                   "grids": derive_grids(trajs, recorded, groups, cfg.quantiles)}
    return replayer if cfg.replay else None
