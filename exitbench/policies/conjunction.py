"""Conjunctions: a token exits when every one of several rules would, as the peer's `all` policies combine
readouts (a margin and an argmax run, say: each alone exits tokens the other would keep).

A member is a registered rule with its own knobs (threshold, patience, min_steps, relative); the conjunction
adds its own `patience` and `min_steps` over the members' joint verdict. Member j is *ready* at iteration k when
its own patience-long run of hits ends there (its own exit rule, less the step limits); the conjunction hits at
k when every member is ready, and exits after `patience` consecutive hits at k ≥ min_steps (the largest of its
own and its members'), or at max_steps. So a conjunction never exits before any member alone would.

One member's threshold is the one a sweep varies (`vary`, by rule name; default the first member given without
a threshold, else the first): the conjunction's `threshold` knob is that member's. Its signal is every member's
signal, one column each, so a recording serves every threshold and replay reads the same columns.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import ExitbenchError
from .base import REGISTRY, ExitPolicy, Memory, register, runs_end

# What a member may set for itself; step caps and the exit model file are the conjunction's.
MEMBER_KNOBS = ("policy", "threshold", "patience", "min_steps", "relative")


@register
class AllOf(ExitPolicy):
    """Every member rule would exit (each on its own patience), on `patience` consecutive iterations."""

    name = "all_of"
    source = "IBM vLLM-Hook recurrent-depth exit (PR #30, 2026): conditions combined with `all`, min_steps, patience"
    default_threshold = math.nan  # the varied member's
    takes_rules = True

    def __init__(self, **knobs: Any):
        rules, vary = knobs.get("rules"), knobs.get("vary")
        if not rules:
            raise ExitbenchError("all_of: needs `rules`, a list of member rules (each a mapping with `policy` and "
                                 "its knobs), given in an --exit-config YAML file")
        if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
            raise ExitbenchError(f"all_of: rules must be a list of mappings, each with `policy` and its knobs, "
                                 f"got {rules!r}")
        if len(rules) < 2:
            raise ExitbenchError(f"all_of: a conjunction needs at least two rules, got {len(rules)}")
        names = [self._check_member(i, r) for i, r in enumerate(rules)]
        if len(set(names)) < len(names):
            raise ExitbenchError(f"all_of: each rule may appear once ({', '.join(names)}); a rule twice is that rule "
                                 "at its stricter threshold")
        if vary is None:
            vary = next((r["policy"] for r in rules if r.get("threshold") is None), names[0])
        if vary not in names:
            raise ExitbenchError(f"all_of: vary names {vary!r}, which is not one of its rules ({', '.join(names)})")
        self.varied = names.index(vary)
        threshold = knobs.get("threshold")
        self.members = []
        for i, r in enumerate(rules):
            member = {k: v for k, v in r.items() if k != "policy"}
            if i == self.varied and threshold is not None:
                member["threshold"] = threshold
            member["max_steps"] = knobs.get("max_steps")
            if knobs.get("exit_model") and REGISTRY[r["policy"]].needs_exit_model:
                member["exit_model"] = knobs["exit_model"]
            self.members.append(REGISTRY[r["policy"]](**member))
        varied = self.members[self.varied]
        # What the sweep, the tables and calibration read of a rule, they read of the varied member.
        self.default_threshold = REGISTRY[vary].default_threshold
        self.default_grid = varied.default_grid
        self.exits_below, self.integer_threshold = varied.exits_below, varied.integer_threshold
        self.needs_logits = any(m.needs_logits for m in self.members)
        self.needs_gate = any(m.needs_gate for m in self.members)
        self.needs_exit_model = any(m.needs_exit_model for m in self.members)
        self.defined_from = max(m.defined_from for m in self.members)
        super().__init__(**{**knobs, "threshold": varied.threshold, "vary": vary})
        self.threshold_given = threshold is not None
        if self.model is not None:  # as the learned rule keeps it: the file's path, its model read once (`model`)
            self.exit_model = self.model.path

    def _check_member(self, i: int, rule: dict) -> str:
        name = rule.get("policy")
        where = f"all_of: rule {i + 1}"
        if name not in REGISTRY or name == self.name:
            valid = [n for n, c in REGISTRY.items() if self._can_join(c)]
            raise ExitbenchError(f"{where}: policy {name!r} is not a rule a conjunction takes; valid: "
                                 f"{', '.join(valid)}")
        if not self._can_join(REGISTRY[name]):
            raise ExitbenchError(f"{where}: {name} cannot join a conjunction (fixed depth needs no rule, the "
                                 "oracle decides after the whole trajectory, and the budgeted prefill exits rank a "
                                 "sequence's positions against each other, not a token on its own)")
        unknown = sorted(set(rule) - set(MEMBER_KNOBS))
        if unknown:
            raise ExitbenchError(f"{where} ({name}): unknown knob {unknown[0]!r}; a rule takes "
                                 f"{', '.join(MEMBER_KNOBS)} (max_steps is the conjunction's)")
        if not isinstance(rule.get("relative", False), bool):
            raise ExitbenchError(f"{where} ({name}): relative must be true or false, got {rule['relative']!r}")
        return name

    @staticmethod
    def _can_join(cls: type[ExitPolicy]) -> bool:
        return not (cls.signal_free or cls.retrospective or cls.ranks_positions or getattr(cls, "takes_rules", False))

    def _validate(self) -> None:
        # The threshold is the varied member's, checked there; the rest as any rule's.
        for m in getattr(self, "members", []):
            m.max_steps = self.max_steps
            m._validate()
        saved, self.threshold = self.threshold, 1.0
        try:
            super()._validate()
        finally:
            self.threshold = saved
        if any(m.relative for m in self.members) and self.relative:
            raise ExitbenchError("all_of: set `relative` on the member rules it applies to, not on the conjunction")

    @classmethod
    def takes(cls, knob: str) -> bool:
        return knob != "relative"

    def bind(self, max_steps: int, group: Any = None) -> "AllOf":
        super().bind(max_steps, group)
        for m in self.members:
            m.max_steps = None
            m.bind(self.max_steps, group)
        self.min_steps = max([self.min_steps] + [m.min_steps for m in self.members])
        return self

    @property
    def variant(self) -> str:
        return f"{self.name}[{','.join(m.variant for m in self.members)}]"

    def first_hit(self) -> int:
        # the first iteration at which every member can be ready (its own run of hits ended) and past its min_steps
        return max(max(m.first_hit() + m.patience - 1, m.min_steps) for m in self.members)

    def _varied_rule(self) -> ExitPolicy:
        return self.members[self.varied]

    @property
    def label(self) -> str:
        varied = self.members[self.varied]
        return f"{self.variant} ({varied.label if varied.integer_threshold else varied.name} varied)"

    def _why_late(self) -> str:
        why = f"every rule is ready from iteration {self.first_hit()}"
        return why + (f", then {self.patience} times in a row" if self.patience > 1 else "")

    @property
    def model(self) -> Any:
        """The exit model its learned member reads (None without one): what keys its cells and is checked against
        the checkpoint, as for the learned rule alone."""
        return next((m.model for m in self.members if m.needs_exit_model), None)

    @property
    def counts_stalls(self) -> bool:
        return any(m.counts_stalls for m in self.members)

    # ---- signals: one column per member ------------------------------------------------------------------------
    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {f"{i}:{name}": value for i, m in enumerate(self.members) for name, value in m.start(s0, vocab).items()}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        columns = []
        for i, m in enumerate(self.members):
            prefix = f"{i}:"
            own = {name[len(prefix):]: value for name, value in memory.items() if name.startswith(prefix)}
            columns.append(m.signal(s, own, logp if m.needs_logits else None).double())
            memory.update({prefix + name: value for name, value in own.items()})
        return torch.stack(columns, -1)

    def defined(self, k: int, value: list[float]) -> list[float]:
        return [m.defined(k, v) for m, v in zip(self.members, value)]

    def defined_tensor(self, k: int, value: torch.Tensor) -> torch.Tensor:
        return torch.stack([m.defined_tensor(k, value[:, i]) for i, m in enumerate(self.members)], -1)

    @property
    def padding(self) -> list[float]:
        return [math.nan] * len(self.members)

    def stalled(self, value: list[float]) -> bool:
        return any(m.counts_stalls and m.stalled(v) for m, v in zip(self.members, value))

    # ---- the exit rule ----------------------------------------------------------------------------------------
    def decide(self, k: list[int], values: list[list[float]], streak: list) -> list[bool]:
        """`streak[j]` holds the token's joint streak and each member's own (0 for a token just started)."""
        leave = []
        for j, (kj, v) in enumerate(zip(k, values)):
            joint, *own = streak[j] or [0] * (len(self.members) + 1)
            own = [s + 1 if m.hit(x) else 0 for m, s, x in zip(self.members, own, v)]
            ready = all(s >= m.patience for m, s in zip(self.members, own))
            joint = joint + 1 if ready else 0
            streak[j] = [joint, *own]
            leave.append(kj >= self.max_steps or (kj >= self.min_steps and joint >= self.patience))
        return leave

    def first_exits(self, values: np.ndarray) -> np.ndarray:
        """`decide` over recorded (n, K, members) signals."""
        n, K, _ = values.shape
        K = min(K, self.max_steps)
        ready = np.ones((n, K), dtype=bool)
        for i, m in enumerate(self.members):
            v = values[:, :K, i]
            with np.errstate(invalid="ignore"):
                hits = v < m.threshold if m.exits_below else v >= m.threshold
            ready &= runs_end(hits, m.patience)
        leave = runs_end(ready, self.patience) & (np.arange(1, K + 1) >= self.min_steps)
        leave[:, K - 1] = True
        return leave.argmax(axis=1) + 1
