"""The grids a rule runs at, as a command line types them: thresholds (`--thresholds 1e-4,1e-3`), a grid of the
rule's own signal quantiles (`quantiles:N`), fixed depths (`--baselines 1,4,16`). Each refusal is one line that
names the option and what would be right; `run`, `calibrate` and the benches read them alike."""
from __future__ import annotations

import math

from ..errors import ExitbenchError


def parse_thresholds(text: str | None) -> list[float] | None:
    """None when the option was not given (each policy's own grid); an empty value is an error, not the grid."""
    if text is None:
        return None
    if not text.strip():
        raise ExitbenchError("--thresholds is empty; give comma-separated numbers, e.g. 1e-4,1e-3, or leave the "
                             "option out for each policy's own grid")
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ExitbenchError(f"--thresholds must be comma-separated numbers, e.g. 1e-4,1e-3, or quantiles:N; "
                                 f"{part.strip()!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise ExitbenchError(f"--thresholds: every threshold must be a finite number > 0, got {part.strip()}")
        out.append(value)
    return out


# quantiles:N takes at most this many: past it the grid is finer than a sweep can afford to run.
MAX_QUANTILES = 100


def parse_quantiles(text: str | None) -> int | None:
    """N of `quantiles:N`; None for any other --thresholds value (numbers, or the option not given)."""
    if text is None or not text.strip().lower().startswith("quantiles"):
        return None
    head, sep, n = text.strip().partition(":")
    try:
        value = int(n.strip()) if head.lower() == "quantiles" and sep else None
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_QUANTILES:
        raise ExitbenchError(f"--thresholds {text.strip()}: give quantiles:N with N a whole number from 1 to "
                             f"{MAX_QUANTILES} (e.g. quantiles:9), or comma-separated thresholds")
    return value


def parse_depths(text: str | None, flag: str) -> list[int] | None:
    """None when the option was not given (the default depths); an empty value is an error, as for --thresholds."""
    if text is None:
        return None
    if not text.strip():
        raise ExitbenchError(f"{flag} is empty; give comma-separated whole numbers, e.g. 1,4,16, or leave the "
                             "option out for the default depths (1,2,4,…,max)")
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ExitbenchError(f"{flag} must be comma-separated whole numbers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ExitbenchError(f"{flag}: every depth must be ≥ 1, got {text}")
    return values
