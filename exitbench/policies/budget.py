"""The budgeted prefill exit for scoring tasks, and its random control (FlashLoop, arXiv 2609.29812).

A scored sequence's positions all loop together (depth-major, the prompt's positions too: prefill "exit") to the
chosen iteration c, the rule's `min_steps` (no exit before it; by default half the loop's depth, rounded up). At
c, of the sequence's n positions, the ceil(ρ · n) whose latent state moved most at that iteration, by the relative
change ‖s_c − s_{c−1}‖ / ‖s_c‖ (first_order's relative signal), keep looping to full depth; the others exit there,
keeping their state, and their KV entries of iteration c are carried into the slots above it (the `latest`
layout's carry, as for any exited token), so a position still looping reads them there. ρ is the threshold:
ρ = 1 keeps every position, which is full depth exactly.

`prefill_random` keeps as many positions, drawn uniformly at random by a generator seeded from the run's seed and
the sequence's own inputs: what the signal buys over chance at the same budget. Neither ever looks at another
sequence, so a request's exits are the same alone or batched with others.

Only one stage: FlashLoop's second, smaller fraction later on is not built.
"""
from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..errors import ExitbenchError
from .base import ExitPolicy, Memory, register
from .latent import _dist, _norm


class _PrefillBudget(ExitPolicy):
    ranks_positions = True
    output_types = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")
    # (a larger ρ keeps more positions looping: the grid's latest-exiting point is its largest, as `calibrate`
    # orders it)
    exits_below = False
    default_threshold = 0.25
    default_grid = (0.1, 0.25, 0.5, 0.75)

    def _validate(self) -> None:
        t = self.threshold
        if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 < t <= 1:
            raise ExitbenchError(f"{self.name}: threshold ρ is the fraction of a sequence's positions that keep "
                                 f"looping, so it must be in (0, 1]; got {t!r}")
        super()._validate()
        if self.patience != 1:
            raise ExitbenchError(f"{self.name}: patience has no meaning for a budget over positions (it ranks them "
                                 f"once, at iteration min_steps); drop --patience {self.patience}")

    @classmethod
    def decides_as_it_runs(cls) -> bool:
        # (a sequence's positions leave together at the chosen iteration: no late horizon, no continuous batching)
        return False

    def bind(self, max_steps: int, group: Any = None) -> "_PrefillBudget":
        super().bind(max_steps, group)
        if self.min_steps == 1:
            # min_steps 1 (the knob's default) reads as unset: at iteration 1 the relative change measures the
            # distance from the initial state, not how far a position is from settling.
            self.min_steps = max(1, (self.max_steps + 1) // 2)
        return self

    def kept(self, n: int) -> int:
        """How many of a sequence's n positions keep looping: ceil(ρ · n), ρ read as the decimal it was given
        (0.1 · 30 is 3, not float's 3.0000000000000004 rounded up to 4)."""
        return math.ceil(Fraction(repr(float(self.threshold))) * n)

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        value = _dist(s, memory["prev"])
        memory["prev"] = s
        return value / _norm(s)

    def decide(self, k: list[int], values: list[float], streak: list[int]) -> list[bool]:
        raise TypeError(f"{self.name} ranks a sequence's positions together; the engine calls decide_wave")

    def recorded_exits(self, n: int, signals, top, picked, by_target: bool) -> np.ndarray:
        raise TypeError(f"{self.name} ranks a sequence's positions together; a per-token recording cannot replay it")

    def decide_wave(self, tokens: list[Any], k: list[int], values: list[float], streak: list[int]) -> list[bool]:
        """Tokens leave at max_steps; at the chosen iteration each sequence's positions not kept leave."""
        cut = self.min_steps
        leave = [kj >= self.max_steps for kj in k]
        at_cut: dict[int, list[int]] = defaultdict(list)
        for j, (token, kj) in enumerate(zip(tokens, k)):
            if kj == cut and kj < self.max_steps:
                at_cut[token.request].append(j)
        for places in at_cut.values():
            places.sort(key=lambda j: tokens[j].position)
            if [tokens[j].position for j in places] != list(range(len(places))):
                raise AssertionError(f"{self.name}: a sequence reached iteration {cut} without all of its positions "
                                     "(the budget needs the whole sequence in one depth-major block)")
            keep = set(self.choose([tokens[j] for j in places], [values[j] for j in places], self.kept(len(places))))
            for i, j in enumerate(places):
                leave[j] = i not in keep
        return leave

    def choose(self, tokens: list[Any], values: list[float], m: int) -> list[int]:
        """Which m of a sequence's positions (0 … n−1, `tokens` in position order) keep looping."""
        raise NotImplementedError


@register
class PrefillTopK(_PrefillBudget):
    """From iteration min_steps on, only the fraction ρ = τ of a sequence's positions with the largest relative
    latent change ‖s_k − s_{k−1}‖ / ‖s_k‖ keeps looping; the rest keep their state and KV entries (a scoring rule:
    every position of the sequence runs under the budget)."""

    name = "prefill_topk"
    source = "FlashLoop (arXiv 2609.29812), one stage"

    def choose(self, tokens: list[Any], values: list[float], m: int) -> list[int]:
        # Largest change first; a NaN (a broken state) last; ties by position, so the choice is a function of the
        # values alone.
        return sorted(range(len(values)), key=lambda i: (math.isnan(values[i]),
                                                         0.0 if math.isnan(values[i]) else -values[i], i))[:m]


@register
class PrefillRandom(_PrefillBudget):
    """prefill_topk's control: as many positions, ceil(ρ · n), kept looping, drawn uniformly at random from a
    generator seeded by the run's seed and the sequence's inputs, never by what else the batch holds."""

    name = "prefill_random"
    source = "FlashLoop (arXiv 2609.29812), its random-selection control"

    def choose(self, tokens: list[Any], values: list[float], m: int) -> list[int]:
        # The inputs after the first (each position's target but the last's): the last target is no input, so the
        # options of a multiple-choice question, which share one pass led by any of them, draw alike.
        key = repr((self.seed, len(tokens), [t.target for t in tokens[:-1]])).encode()
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        return [int(i) for i in rng.choice(len(tokens), size=m, replace=False)]
