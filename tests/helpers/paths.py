"""Where the tests' inputs live: the repository, its shipped task folders and the local GSM8K copy."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tasks"
GSM8K_DIR = Path("/work/shared/data/gsm8k")
