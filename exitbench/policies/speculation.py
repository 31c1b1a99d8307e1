"""Lossless depth speculation as a sweep names it: not an exit rule, the baseline an exit rule has to beat.

`--policy speculate` drafts `draft_tokens` (k) tokens at a shallow depth, τ iterations of every loop group, or by
an exit rule (`draft`, given in an --exit-config file; then τ is that rule's threshold), and verifies them at full
depth in one pass (exitbench/engine/speculation.py). Its output is full depth's greedy output, so its cells differ
from full depth's only in what they cost. It generates: a scoring task has no tokens to draft.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ExitbenchError
from .base import REGISTRY, ExitPolicy, Memory, register

DEFAULT_DRAFT_TOKENS = 4
# What a draft rule's mapping may set beside its name (its threshold is the cell's τ).
DRAFT_KNOBS = ("policy", "patience", "min_steps", "relative")


@register
class Speculate(ExitPolicy):
    """Draft k tokens at τ iterations (or by the `draft` rule at threshold τ), verify them at full depth together,
    keep the longest agreeing prefix: full depth's greedy output at fewer full-depth passes."""

    name = "speculate"
    source = ("self-speculation across depth: LoopSpec (arXiv 2609.17184), WaveFront (2609.23033), "
              "DAS (2609.34538)")
    drafts = True
    output_types = ("generate_until",)
    exits_below = False
    integer_threshold = True
    default_threshold = 2
    default_grid = (1, 2, 4, 8)  # a sweep takes the depths below its full depth instead (sweep/config.py)

    def __init__(self, **knobs: Any):
        # A draft rule's τ is its own threshold, a real number; a depth counts iterations.
        self.integer_threshold = knobs.get("draft") is None
        super().__init__(**knobs)

    def _validate(self) -> None:
        super()._validate()
        k = self.draft_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ExitbenchError(f"speculate: --draft-tokens must be a whole number ≥ 1 (the tokens each round drafts "
                                 f"before one full-depth pass verifies them), got {k!r}")
        if self.draft is not None:
            self.draft_rule()  # refused now, not at the first token

    @property
    def k(self) -> int:
        return self.draft_tokens if self.draft_tokens is not None else DEFAULT_DRAFT_TOKENS

    @property
    def draft_name(self) -> str:
        """The draft as a table names it: `depth τ`, or the rule's name."""
        return f"depth {int(self.threshold)}" if self.draft is None else self.draft["policy"]

    def draft_rule(self) -> ExitPolicy | None:
        """The exit rule that drafts (unbound), at threshold τ; None for a fixed draft depth."""
        if self.draft is None:
            return None
        spec = self.draft
        name = spec.get("policy") if isinstance(spec, dict) else None
        if not isinstance(name, str):
            raise ExitbenchError(f"speculate: draft must be a mapping that names its rule (`policy: second_order`), "
                                 f"got {spec!r}")
        unknown = sorted(set(spec) - set(DRAFT_KNOBS))
        if unknown:
            why = " (its threshold is the cell's τ: give it with --thresholds)" if "threshold" in unknown else ""
            raise ExitbenchError(f"speculate: draft knob {unknown[0]!r} is not one a draft rule takes{why}; it takes "
                                 f"{', '.join(DRAFT_KNOBS)}")
        if name not in REGISTRY:
            raise ExitbenchError(f"speculate: draft rule {name!r} is not a policy; valid: "
                                 f"{', '.join(n for n, c in REGISTRY.items() if _drafts_well(c))}")
        cls = REGISTRY[name]
        if not _drafts_well(cls):
            why = ("give a draft depth as τ instead" if cls.signal_free
                   else "it decides only after running to full depth" if cls.retrospective
                   else "it is no per-token rule")
            raise ExitbenchError(f"speculate: {name} cannot draft ({why}); a draft rule decides each token as it "
                                 f"runs: {', '.join(n for n, c in REGISTRY.items() if _drafts_well(c))}")
        return cls(threshold=self.threshold, **{k: v for k, v in spec.items() if k != "policy"})

    def never_exits_early(self, capped: bool, limit: int) -> str | None:
        depth = self.max_steps
        if self.draft is None and self.threshold >= depth:
            return (f"speculate drafts at depth {int(self.threshold)}, and full depth is {depth}: a draft that deep "
                    f"saves nothing; give draft depths below {depth} (--thresholds)")
        if self.draft is not None:
            reason = self.draft_rule().bind(depth).never_exits_early(capped, limit)
            return None if reason is None else f"speculate's draft: {reason}"
        return None

    def exit_reach(self) -> dict[str, Any]:
        return {}

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "draft_tokens": self.k}

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        raise TypeError("speculate drafts and verifies whole tokens; no exit engine asks it for a signal")


def _drafts_well(cls: type[ExitPolicy]) -> bool:
    return cls.decides_as_it_runs() and not cls.takes_rules and not cls.needs_exit_model
