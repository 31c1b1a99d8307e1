"""What a family's recipe is, for the one training loop (train.py), and what the recipes share.

A recipe declares, for its family: its defaults (the knobs where it differs from TrainSettings'), its checks
of the knobs it reads, its length in optimizer steps, its progress line, and how it trains: the model it
builds, the batch of a step, the learning rate of a step, the loss, what it does after a step, and its stage
hooks (a checkpoint kept at a step, a restart of the loss average, what a checkpoint records of its stage).
The class-level parts take the settings and build nothing, so the command line can ask them before training.

Shared here: Huginn's sampled depth (`SampledDepth`), the learning-rate schedule, and per-step generators.
Everything random is drawn from generators keyed by (seed, step), so a run is deterministic for a seed and a
resumed run continues with exactly the batches it would have seen.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import ExitbenchError
from ..models import LoopedLM
from . import synthetic
from .settings import TrainSettings


@dataclass
class TrainState:
    step: int = 0
    level: int = 2
    level_accuracy: float = 0.0
    elapsed: float = 0.0
    tokens: int = 0
    loss: float = float("nan")
    gate: dict[str, float] = dataclasses.field(default_factory=dict)  # ouro: the stage and its objective's parts
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class Recipe:
    """One family's way to train (see the module's docstring); `__init__(cfg)` sets `cfg` and `tokenizer`."""

    defaults: ClassVar[dict[str, Any]] = {}  # the knobs where this family's defaults differ from TrainSettings'
    cfg: TrainSettings
    tokenizer: Any

    @classmethod
    def validate(cls, cfg: TrainSettings) -> None:
        """Refuse the knobs this family reads that it cannot train with (the shared ones are checked already)."""

    @classmethod
    def total_steps(cls, cfg: TrainSettings) -> int:
        """Optimizer steps of the whole run."""
        return cfg.steps

    @classmethod
    def status(cls, cfg: TrainSettings, state: TrainState) -> str:
        """What a progress line shows beside the loss."""
        raise NotImplementedError

    def build_model(self, generator: torch.Generator) -> LoopedLM:
        raise NotImplementedError

    def batch(self, state: TrainState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, targets, hops: each target's chain length, None where there is none) of step `state.step`."""
        raise NotImplementedError

    def lr_at(self, step: int) -> float:
        return warmup_cosine(self.cfg, step)

    def loss(self, model: LoopedLM, inputs: torch.Tensor, targets: torch.Tensor, state: TrainState
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(the loss, the logits of the last step, the depth run per loop group)."""
        raise NotImplementedError

    def after_step(self, state: TrainState, logits: torch.Tensor, targets: torch.Tensor, hops, steps: list[int]
                   ) -> None:
        """Anything decided from a step's outcome (a curriculum); `state.step` counts the step done."""

    def restarts_loss_average(self, step: int) -> bool:
        """Whether the running loss starts afresh after `step` steps (an objective that changes)."""
        return False

    def kept_checkpoint(self, step: int) -> str | None:
        """A directory under OUT that keeps the model after `step` steps, besides --save-every's."""
        return None

    def record(self, state: TrainState) -> dict[str, Any]:
        """What a checkpoint's training record says of this family's stage, beside the shared entries."""
        return {}


def step_rng(seed: int, step: int, stream: int) -> random.Random:
    return random.Random((seed * 1_000_003 + step) * 7 + stream)


def cosine(peak: float, progress: float) -> float:
    """Cosine decay from `peak` to a tenth of it over progress 0 … 1."""
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_cosine(cfg: TrainSettings, step: int) -> float:
    """Linear warm-up to --lr over `warmup` steps, then cosine decay over the rest of `steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cosine(cfg.lr, min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))


def sample_recurrence(rng: random.Random, mean: int, backprop_depth: int, sigma: float, cap: int
                      ) -> tuple[int, int]:
    """(no-grad steps, grad steps) from Huginn's log-normal Poisson sampler, capped at `cap` in total."""
    tau = rng.gauss(math.log(mean) - sigma ** 2 / 2, sigma)
    total = min(_poisson(rng, math.exp(tau)) + 1, cap)
    grad = min(backprop_depth, total)
    return total - grad, grad


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method is exact and fast for the small means used here, and keeps all randomness in `rng`.
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class SampledDepth(Recipe):
    """Huginn's training (§1.6): one depth per loop group and batch, τ ~ N(log(mean) − σ²/2, σ) and
    r = 1 + Poisson(e^τ), with gradients only through the last `backprop_depth` iterations of each group; the
    next-token loss at the last iterate."""

    @classmethod
    def validate(cls, cfg: TrainSettings) -> None:
        super().validate(cfg)
        if cfg.max_recurrence < cfg.mean_recurrence:
            raise ExitbenchError(f"--max-recurrence {cfg.max_recurrence} is below --mean-recurrence "
                                 f"{cfg.mean_recurrence}")

    def loss(self, model: LoopedLM, inputs: torch.Tensor, targets: torch.Tensor, state: TrainState
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        cfg = self.cfg
        # One depth per loop group; the single-group Raven draws exactly what it always drew (stream 1).
        draws = [sample_recurrence(step_rng(cfg.seed, state.step, 1 + 2 * g), cfg.mean_recurrence,
                                   cfg.backprop_depth, cfg.recurrence_sigma, cfg.max_recurrence)
                 for g in range(len(model.loop_groups()))]
        steps = [a + b for a, b in draws]
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + state.step)
        logits = model(inputs, steps, backprop_depth=[b for _, b in draws], generator=gen)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=synthetic.IGNORE)
        return loss, logits, steps
