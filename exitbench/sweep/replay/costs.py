"""What a replayed token would have cost: per-token and per-iteration times measured on the exact engine.

Replay knows each token's exits but runs no loop, so its wall-clock is an estimate: a token costs its
prelude and coda once, a core iteration per iteration it ran, and its policy's probe per iteration. Those
unit costs are measured here, on a few of the sweep's own requests, with the exact engine at the recording's
depth (one run at fixed depth for the core; one for a decoding rule and one for a latent rule, with min_steps =
max so every iteration probes, each standing for the rules of its kind).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ...engine import ExitConfig, ExitEngine
from ...engine.recorder import variant_key
from ...models import LoopedLM
from ...policies import ExitPolicy


@dataclass
class CostModel:
    prelude_s: float = 0.0           # per token
    coda_s: float = 0.0              # per token
    core_s: float = 0.0              # per token-iteration
    probe_s: dict[str, float] = field(default_factory=dict)  # signal variant → per token-iteration

    def token(self, exit_steps: Sequence[int], policies: Sequence[ExitPolicy]) -> dict[str, float]:
        iterations = sum(exit_steps)
        probe = sum(k * self.probe_s.get(variant_key(p), 0.0) for k, p in zip(exit_steps, policies)
                    if not p.signal_free)
        return {"prelude": self.prelude_s, "core": self.core_s * iterations, "probe": probe, "coda": self.coda_s}

    def to_dict(self) -> dict:
        return {"prelude_s": self.prelude_s, "coda_s": self.coda_s, "core_s_per_iteration": self.core_s,
                "probe_s_per_iteration": dict(self.probe_s)}


def _run(model: LoopedLM, config: ExitConfig, sample, batch_size: int, warm_up: bool = False) -> dict[str, float]:
    engine = ExitEngine(model, config)
    if warm_up:  # the first run in a process pays allocator and dispatch caches
        engine.score(sample, batch_size=batch_size)
        engine.stats = dict.fromkeys(engine.stats, 0.0)
    engine.score(sample, batch_size=batch_size)
    return engine.stats


# Iterations per loop group the unit costs are timed at: a cost per iteration does not depend on how many run,
# and a wide model's full depth would make the cost model a sizeable share of the sweep.
TIMED_DEPTH = 4
SCORED = 16  # scored tokens per sample request (a rolling window may score a thousand)


def measure(model: LoopedLM, depth: int, variants: Sequence[ExitPolicy], sample: list[tuple[list[int], int]],
            batch_size: int, seed: int) -> CostModel:
    """Unit costs on `sample` (scoring requests), each loop group run min(depth, TIMED_DEPTH) iterations."""
    if not sample:
        return CostModel()
    depth = min(depth, TIMED_DEPTH)
    sample = [(tokens[:n_ctx + SCORED], n_ctx) for tokens, n_ctx in sample]
    groups = len(model.loop_groups())
    stats = _run(model, ExitConfig("fixed", threshold=depth, seed=seed), sample, batch_size, warm_up=True)
    tokens = max(stats["tokens"], 1.0)
    costs = CostModel(prelude_s=stats["prelude"] / tokens, coda_s=stats["coda"] / tokens,
                      core_s=stats["core"] / (tokens * depth * groups))
    # A probe's cost is its readout (decoding rules: the rest of the model and the head at every iteration) or a
    # few norms (latent rules): one representative of each kind is timed, and its figure stands for its kind.
    timed: dict[bool, float] = {}
    for policy in variants:
        if policy.signal_free or policy.needs_logits in timed:
            continue
        config = ExitConfig(policy.name, relative=policy.relative, exit_model=policy.exit_model, min_steps=depth,
                            max_steps=depth, rules=policy.rules, vary=policy.vary, seed=seed)
        stats = _run(model, config, sample, batch_size)
        timed[policy.needs_logits] = stats["probe"] / (max(stats["tokens"], 1.0) * depth * groups)
    costs.probe_s = {variant_key(p): timed[p.needs_logits] for p in variants if not p.signal_free}
    return costs
