"""The exit-policy interface and its registry.

A policy watches one token's loop: after iteration k it turns the state s_k (and, if it declares
`needs_logits`, the log-probabilities of the readout at s_k) into a signal, and the token exits once the
signal has passed the threshold on `patience` consecutive iterations with k ≥ min_steps, or at max_steps.
Policies work on a batch of active tokens at once; `memory` holds what they carry between iterations, one
row per token, and the engine drops the rows of tokens that exit.

Iterations are counted from 1: s_0 is the initial state, Δ_k = s_k − s_{k−1}. A signal that is not yet
defined (Δ_{k−1} at k = 1, say) is +inf for "exit below" rules and −inf for "exit above" rules, so it never
counts as a hit.
"""
from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ExitbenchError

if TYPE_CHECKING:
    from .host import HostProbe

Memory = dict[str, torch.Tensor]

REGISTRY: dict[str, type["ExitPolicy"]] = {}


def register(cls: type["ExitPolicy"]) -> type["ExitPolicy"]:
    REGISTRY[cls.name] = cls
    return cls


def log_grid(lo: float, hi: float, per_decade: int = 1) -> tuple[float, ...]:
    n = round(math.log10(hi / lo) * per_decade)
    return tuple(float(f"{lo * 10 ** (i / per_decade):.3g}") for i in range(n + 1))


class ExitPolicy:
    name: ClassVar[str]
    source: ClassVar[str]
    needs_logits: ClassVar[bool] = False
    exits_below: ClassVar[bool] = True
    default_threshold: ClassVar[float]
    default_patience: ClassVar[int] = 1
    default_grid: ClassVar[tuple[float, ...]] = ()
    integer_threshold: ClassVar[bool] = False
    uses_relative: ClassVar[bool] = False
    # Decided after running every token to max_steps (the oracle); not a usable policy.
    retrospective: ClassVar[bool] = False
    # Exits by counting alone (fixed depth): the engine needs no signal, only k = max_steps.
    signal_free: ClassVar[bool] = False
    # Has a `host_kernel`: CPU float32 tokens' rule without tensor ops (see policies/host.py).
    has_host_probe: ClassVar[bool] = False

    def __init__(self, threshold: float | None = None, *, min_steps: int = 1, max_steps: int | None = None,
                 patience: int | None = None, relative: bool = False):
        self.threshold = self.default_threshold if threshold is None else threshold
        self.threshold_given = threshold is not None
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.patience = self.default_patience if patience is None else patience
        self.relative = relative
        self._validate()

    def _validate(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t <= 0:
            raise ExitbenchError(f"{self.name}: threshold must be a finite number > 0, got {t!r}")
        if self.integer_threshold and float(t) != int(t):
            raise ExitbenchError(f"{self.name}: threshold counts iterations and must be a whole number, got {t}")
        if not isinstance(self.min_steps, int) or self.min_steps < 1:
            raise ExitbenchError(f"{self.name}: min_steps must be an integer ≥ 1, got {self.min_steps!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ExitbenchError(f"{self.name}: max_steps must be an integer ≥ 1, got {self.max_steps!r}")
        if self.max_steps is not None and self.min_steps > self.max_steps:
            raise ExitbenchError(f"{self.name}: min_steps={self.min_steps} is greater than max_steps={self.max_steps}")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ExitbenchError(f"{self.name}: patience must be an integer ≥ 1, got {self.patience!r}")
        if self.relative and not self.uses_relative:
            raise ExitbenchError(f"{self.name}: relative=True has no meaning for this policy; "
                                 f"it applies to {', '.join(n for n, c in REGISTRY.items() if c.uses_relative)}")

    def bind(self, max_steps: int) -> "ExitPolicy":
        """Fix max_steps from the loop group when the config left it open."""
        if self.max_steps is None:
            self.max_steps = max_steps
            self._validate()
        return self

    def knobs(self) -> dict[str, Any]:
        return {"policy": self.name, "threshold": self.threshold, "min_steps": self.min_steps,
                "max_steps": self.max_steps, "patience": self.patience, "relative": self.relative}

    # ---- what subclasses implement -----------------------------------------------------------------
    def start(self, s0: torch.Tensor) -> Memory:
        """Memory for tokens starting their loop at states s0 (n, d)."""
        return {"prev": s0}

    def signal(self, k: int, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        """The rule's value after iteration k for every token, shape (n,); updates `memory`."""
        raise NotImplementedError

    # ---- the shared exit rule ------------------------------------------------------------------------
    def hits(self, signal: torch.Tensor) -> torch.Tensor:
        return signal < self.threshold if self.exits_below else signal >= self.threshold

    def decide(self, k: int, signal: torch.Tensor, memory: Memory) -> torch.Tensor:
        """Which tokens exit after iteration k: `patience` consecutive hits at k ≥ min_steps, or k = max."""
        streak = memory.get("streak")
        hit = self.hits(signal)
        streak = hit.long() if streak is None else torch.where(hit, streak + 1, 0)
        memory["streak"] = streak
        if k >= self.max_steps:
            return torch.ones_like(hit)
        if k < self.min_steps:
            return torch.zeros_like(hit)
        return streak >= self.patience

    # ---- the host path (`has_host_probe` policies, see policies/host.py) -----------------------------
    host_kernel: ClassVar[str] = ""  # the function of exitbench._probe that computes the signal
    host_history: ClassVar[int] = 1  # earlier states it reads besides s_k

    def host_probe(self, s0: torch.Tensor) -> "HostProbe":
        """The whole exit rule for CPU float32 tokens starting at states s0: (k, s_k) -> (leaving, signals)."""
        from .host import HostProbe

        return HostProbe(self, s0)

    def first_exit(self, signals: list[float]) -> int:
        """The exit step the rule gives for one token's recorded signal trajectory (s_1 … s_max): for tests."""
        streak = 0
        for k, value in enumerate(signals, start=1):
            streak = streak + 1 if self.hits(torch.tensor(value)).item() else 0
            if k >= self.max_steps or (k >= self.min_steps and streak >= self.patience):
                return k
        return len(signals)


def policy_names() -> list[str]:
    return list(REGISTRY)


def make_policy(name: str, **knobs: Any) -> ExitPolicy:
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ExitbenchError(f"unknown policy {name!r}{hint}; valid: {', '.join(REGISTRY)}")
    return REGISTRY[name](**knobs)
