"""What the engine keeps of a token in flight (`Token`) and returns: per sequence its tokens and log-probabilities,
per token its exits and costs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Token:
    """One token's journey through the loop groups: where it is, what it must predict, what it did."""

    uid: int
    row: int
    position: int
    target: int | None = None  # the next token, when teacher-forced (the oracle scores against it)
    consumed: bool = True  # False for prompt tokens run with exits (prefill="exit"): nobody reads their output
    request: int = 0  # which of the run's requests the token belongs to
    exit_steps: list[int] = field(default_factory=list)
    signals: list[list[float]] = field(default_factory=list)
    nonfinite: bool = False
    # Reached max_steps in some loop group still unsettled by its rule's own measure (`ExitPolicy.stalled`).
    stalled: bool = False
    # Exit mode `select`: the step the rule chose in the current loop group, and its state (1, d) and readout
    # logits (V,), held while the token runs on to max_steps.
    selected: tuple[int, Any, Any] | None = None


@dataclass
class TokenRecord:
    """One scored or generated token: its exit step per loop group, cost, and optionally the signals."""

    position: int
    exit_steps: list[int]
    time_s: dict[str, float]
    flops: dict[str, float]
    signals: list[list[float]] | None = None
    nonfinite: bool = False  # a NaN or infinity in the token's exit states or logits
    stalled: bool | None = None  # see Token.stalled; None where the rule has no such measure
    # Iterations its attention layers ran and its MLPs ran, summed over loop groups (IBM vLLM-Hook's cost axes):
    # both its exit steps under physical exits (None: as exit_steps), both K under select and weighted; under
    # freeze K and its exit steps.
    attention_steps: int | None = None
    mlp_steps: int | None = None

    @property
    def token_steps(self) -> tuple[int, int]:
        """(attention, MLP) iterations this token ran."""
        exits = sum(self.exit_steps)
        return (exits if self.attention_steps is None else self.attention_steps,
                exits if self.mlp_steps is None else self.mlp_steps)


@dataclass
class SequenceResult:
    tokens: list[int]
    logprobs: list[float]
    greedy: list[bool]
    records: list[TokenRecord] = field(default_factory=list)
    stopped_by: str | None = None
    # Full next-token log-probabilities per scored position, when asked for (shared-context scoring).
    distributions: list[torch.Tensor] | None = None
    # Depth speculation's rounds (engine/speculation.py): drafts kept per round, drafted, and the loop iterations
    # drafts and verification ran; None for a sequence an exit engine ran.
    speculation: dict[str, Any] | None = None
    # Prompt positions run with exits (prefill "exit"), which no record holds (nobody reads their outputs), and
    # their iterations summed over positions and loop groups: what the prompt's loops cost.
    prompt_positions: int = 0
    prompt_iterations: int = 0

    @property
    def iterations(self) -> list[int]:
        return [sum(r.exit_steps) for r in self.records]
