"""What every family's config must hold before a weight is read: numbers that keep the forward finite, and loop
depths a machine can run. A config value outside these is refused in one line at load, never discovered as a
NaN in a trace or a memory error after minutes of compute.
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import CheckpointError

# The deepest loop a config may ask for. Published looped models train at 4 (Ouro) to 32 (Huginn-0125) iterations
# and are run to a few times that; 1,024 leaves room for any extrapolation study, while the KV cache of a lying
# config (100,000 steps: a slot per iteration per loop layer) would ask for hundreds of GB per position batch.
MAX_LOOP_STEPS = 1024


def loop_steps(name: str, value: Any) -> None:
    """A configured depth within MAX_LOOP_STEPS (its type is checked with the config's other integers)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOOP_STEPS:
        raise CheckpointError(f"config {name}={value} asks for more than exitbench's {MAX_LOOP_STEPS} loop "
                              f"iterations (a KV slot per iteration per loop layer); give at most {MAX_LOOP_STEPS}")


def loop_depth(trained_name: str, trained: Any, deepest_name: str, deepest: Any) -> None:
    """A family's trained depth and the deepest a run may ask for (exitbench's own field, by default twice the
    trained): each within MAX_LOOP_STEPS, the deepest not below the trained."""
    if deepest < trained:
        raise CheckpointError(f"config {deepest_name}={deepest} is below the trained {trained_name}={trained}")
    loop_steps(trained_name, trained)
    loop_steps(deepest_name, deepest)


def rope_base(name: str, value: Any) -> None:
    """RoPE's base: its log divides the frequencies, so 0 or a negative base turns every rotation into NaN."""
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value > 0):
        raise CheckpointError(f"config {name} must be a finite number > 0 (RoPE's base), got {value!r}")


def norm_eps(name: str, value: Any) -> None:
    """A norm's epsilon: a negative one can make the root of a near-zero variance NaN."""
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value >= 0):
        raise CheckpointError(f"config {name} must be a finite number ≥ 0, got {value!r}")
