"""Where the tests' inputs live: the repository, its shipped task folders, the committed baseline cells and
the local GSM8K copy."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tasks"
BASELINE = REPO / "results" / "baseline"
A_CELL = next(BASELINE.glob("chains_lambada__fixed-16__*.json"))  # one committed cell: full depth
GSM8K_DIR = Path("/work/shared/data/gsm8k")
