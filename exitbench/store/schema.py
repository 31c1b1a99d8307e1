"""The typed shape of a result cell and of a samples file's lines, as the readers rely on it.

Only the fields that some reader (pareto, check, report, calibrate, the run summary) uses are typed; the rest
of a cell passes through untouched (`extra="allow"`), so a cell written by a newer exitbench with more fields
still reads. Types are strict: a quality of "0.9" or a relative flag of 1 is a broken cell, not a number or
a boolean by coercion, since a cell is only ever written by exitbench and a coerced value would be a guess.
"""
from __future__ import annotations

import math
import re
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Number = Union[int, float]  # strict float already accepts an int; named for what readers mean by it


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ModelPart(_Part):
    fingerprint: str
    architecture: str
    dtype: str
    path: Optional[str] = None
    source: Optional[str] = None
    # A checkpoint named by hub id: its repo and the commit the revision resolved to (models/hub.py).
    hub: Optional[dict[str, str]] = None


class TaskPart(_Part):
    name: str
    limit: Optional[Number]
    n_shot: Optional[int]
    metrics: dict[str, Optional[float]]
    primary_metric: str
    # lm-eval writes "N/A" for a stderr it could not compute
    stderr: dict[str, Union[float, str, None]] = {}
    higher_is_better: dict[str, bool] = {}


class QualityPart(_Part):
    metric: str
    value: Optional[float]
    higher_is_better: bool
    stderr: Union[float, str, None] = None


# The exit modes a cell may name (engine.config.EXIT_MODES; `physical` is written as no mode at all). Spelled
# out here because the store sits below the engine; tests/test_readers.py holds the two lists equal.
ExitMode = Literal["physical", "select", "weighted", "freeze"]


# The backends a cell's key may name (sweep.backends.BACKENDS; "hf" is written as no backend at all), spelled out
# for the same reason and held equal by the same test.
Backend = Literal["hf", "vllm"]


class KeyPart(_Part):
    backend: Backend = "hf"


class RulePart(_Part):
    """One member rule of an all_of conjunction, as its labels read it."""
    policy: str
    threshold: Optional[Number] = None
    patience: Optional[int] = None
    min_steps: Optional[int] = None
    relative: Optional[bool] = None


class PolicyPart(_Part):
    policy: str
    threshold: float  # the resolved one: every rule has a number here (fixed depth: the depth)
    max_steps: Optional[int] = Field(ge=1)
    relative: bool
    min_steps: int = 1
    patience: Optional[int] = None
    kv_window: Optional[int] = None
    exit_mode: Optional[ExitMode] = None
    exit_model: Optional[str] = None
    exit_model_sha256: Optional[str] = None
    baseline: bool = False
    rules: Optional[list[RulePart]] = Field(default=None, min_length=2)  # all_of: at least two members
    vary: Optional[str] = None
    # How early the rule can exit by its definition (ExitPolicy.exit_reach); absent from fixed depths and from
    # cells written before it. late_exit: only at the last iteration or two before full depth.
    earliest_exit: Optional[int] = None
    late_exit: bool = False


class IterationsPart(_Part):
    mean: Optional[float]
    tokens: int
    median: Optional[float] = None
    p90: Optional[Number] = None
    max: Optional[Number] = None
    histogram: dict[str, int] = {}
    per_group_mean: list[float] = []
    # Cells written before the counters existed have none.
    attention_token_steps: Optional[int] = None
    mlp_token_steps: Optional[int] = None
    # Per request, in the order the run took them, each token's iterations (summed over loop groups), as text
    # ("5,6;16,3"): the exit schedule `serve-sim` replays. Cells written before it have none.
    schedule: Optional[str] = None

    @field_validator("histogram")
    @classmethod
    def _histogram_counts_iterations(cls, counts: dict[str, int]) -> dict[str, int]:
        for key, n in counts.items():
            if not key.isdigit() or n < 0:
                raise ValueError(f"the histogram counts tokens (≥ 0) per iteration count (a whole number), got "
                                 f"{key!r}: {n}")
        return counts

    @field_validator("schedule")
    @classmethod
    def _schedule_grammar(cls, text: Optional[str]) -> Optional[str]:
        if text is not None and not SCHEDULE.fullmatch(text):
            raise ValueError("a schedule is requests separated by ';', each its tokens' iterations as whole numbers "
                             "≥ 1 separated by ',' (e.g. '5,6;16,3')")
        return text

    @model_validator(mode="after")
    def _schedule_is_the_cells(self) -> "IterationsPart":
        """The schedule's tokens are the cell's: their mean is its mean iterations (the writer derives both from
        the same records, so they agree to float rounding)."""
        tokens = schedule_tokens(self.schedule)
        if tokens and self.mean is not None and not math.isclose(sum(tokens) / len(tokens), self.mean,
                                                                 rel_tol=1e-9, abs_tol=1e-9):
            raise ValueError(f"iterations.schedule's {len(tokens)} tokens average {sum(tokens) / len(tokens):.6g} "
                             f"iterations, the cell's mean is {self.mean:.6g}")
        return self


# A schedule: requests by ";", tokens by ",", each a whole number ≥ 1 (a request that generated nothing has none).
SCHEDULE = re.compile(r"(?:[1-9]\d*(?:,[1-9]\d*)*)?(?:;(?:[1-9]\d*(?:,[1-9]\d*)*)?)*")


def schedule_requests(text: Optional[str]) -> list[list[int]]:
    """A schedule that passed SCHEDULE as its requests, each its tokens' iterations ("5,6;16,3" → [[5, 6], [16, 3]])."""
    return [[int(k) for k in r.split(",") if k] for r in text.split(";")] if text else []


def schedule_tokens(text: Optional[str]) -> list[int]:
    """Every token's iterations in a schedule that passed SCHEDULE, in order."""
    return [k for request in schedule_requests(text) for k in request]


def _positive_finite(value, what: str):
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0 (a time ratio), got {value}")
    return value


class RepeatsPart(_Part):
    """A cell's paired retiming beside full depth on one clock (timing/retime.py); cells written before the draw
    across the task have no `documents` (they timed the task's first requests) and no fields after it; cells
    written before the two clocks have no `clock`, `batch_size` or `measured` (their one clock: a batch of
    documents at the run's batch size, the scored tokens' loop phases only)."""
    repeats: int
    ratio: Number
    spread: Number
    full_depth: Number
    ratios: list[Number] = []
    requests: Optional[int] = None
    flops_ratio: Optional[Number] = None
    overhead: Optional[Number] = None
    documents: Optional[list[Union[int, str]]] = None
    of_documents: Optional[int] = None
    whole_flops_ratio: Optional[Number] = None
    representative: Optional[bool] = None
    corrected_ratio: Optional[Number] = None
    steps_ratio: Optional[Number] = None
    schedule: Optional[Number] = None
    clock: Optional[Literal["throughput", "latency"]] = None
    batch_size: Optional[int] = None
    measured: Optional[str] = None

    @field_validator("ratio", "full_depth", "flops_ratio", "overhead", "whole_flops_ratio", "corrected_ratio",
                     "steps_ratio", "schedule")
    @classmethod
    def _ratios_are_positive(cls, value, info):
        return _positive_finite(value, info.field_name)

    @field_validator("ratios")
    @classmethod
    def _each_ratio_is_positive(cls, values):
        for value in values:
            _positive_finite(value, "each of ratios")
        return values

    @field_validator("spread")
    @classmethod
    def _spread_is_a_share(cls, value):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"spread must be a finite number ≥ 0, got {value}")
        return value


class WallClockPart(_Part):
    per_token_s: Optional[float]
    probe_share: Optional[float]
    total_s: Optional[float] = None
    estimated: bool = False
    overhead: Optional[float] = None  # cells written before it, or timed once, have none
    repeats: Optional[RepeatsPart] = None  # the throughput clock (or, before the two clocks, the one clock)
    latency: Optional[RepeatsPart] = None  # the latency clock: batch size 1 (absent before the two clocks)
    untimed: Optional[str] = None  # why a task too small was not retimed


class FlopsPart(_Part):
    per_token: Optional[float]
    probe_per_token: Optional[float] = None


class NumericsPart(_Part):
    nonfinite_tokens: int = 0
    nonconverging_tokens: Optional[int] = None  # only cells of a rule that can tell (contraction)


class EnginePart(_Part):
    schedule: Optional[str] = None  # cells written before depth-major scoring existed say nothing


class RunPart(_Part):
    started: str


class Cell(_Part):
    cell_id: str
    key: KeyPart
    model: ModelPart
    task: TaskPart
    quality: QualityPart
    policy: PolicyPart
    iterations: IterationsPart
    wall_clock: WallClockPart
    flops: FlopsPart
    run: RunPart
    numerics: NumericsPart = NumericsPart()
    engine: EnginePart = EnginePart()
    samples: bool = False
    mode: Literal["exact", "replay"] = "exact"
    replay: dict = {}

    @model_validator(mode="after")
    def _schedule_within_depth(self) -> "Cell":
        """No token of the schedule ran deeper than the cell can: max_steps in each of its loop groups."""
        tokens = schedule_tokens(self.iterations.schedule)
        if tokens and self.policy.max_steps is not None:
            depth = self.policy.max_steps * max(1, len(self.iterations.per_group_mean))
            if max(tokens) > depth:
                raise ValueError(f"iterations.schedule has a token at {max(tokens)} iterations, deeper than the "
                                 f"cell's full depth {depth}")
        return self


class SampleExits(_Part):
    """What `--log-samples` joins into each lm-eval sample: per token, its exit step in each loop group."""
    exit_steps: list[list[int]] = []
    token_text: Optional[list[str]] = None
    logprobs: Optional[list[Optional[float]]] = None
    greedy: Optional[list[Optional[bool]]] = None
    mean: Optional[float] = None


class Sample(_Part):
    doc_id: Union[int, str]
    exitbench: SampleExits = SampleExits()
