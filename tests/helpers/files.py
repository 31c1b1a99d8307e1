"""Directory listings for before/after comparisons (a command must not write where it only reads)."""
from __future__ import annotations

from pathlib import Path


def listing(path: Path) -> list[str]:
    """Every path under `path` (relative), for before/after comparisons."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))
