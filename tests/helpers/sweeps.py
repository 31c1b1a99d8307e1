"""The one small real sweep the fast suite shares: built once per test session, whichever worker asks first,
and read by every test that needs real cells rather than hand-made ones (tests/conftest.py: `shared_sweep`).

chains (generate) and chains_lambada (loglikelihood), 24 documents each (hops 1-12 twice), second_order at
τ = 0.01 and 1, fixed depths 1, 4 and 16: ten cells, each retimed beside full depth.

Beside it, SMALL: the options of the smallest sweep a command-line test runs itself.
"""
from __future__ import annotations

import fcntl
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

LIMIT = 24
SWEEP = ["--tasks", "chains,chains_lambada", "--policy", "second_order", "--thresholds", "0.01,1",
         "--baselines", "1,4,16", "--limit", str(LIMIT)]
N_CELLS = 2 * (2 + 3)


# chains_lambada's first 4 documents, second_order at τ = 0.1 beside full depth (16): two cells. SMALL is quiet;
# SMALL_LOUD shows exitbench's progress.
SMALL_LOUD = ["--tasks", "chains_lambada", "--policy", "second_order", "--thresholds", "0.1", "--baselines", "16",
              "--limit", "4"]
SMALL = [*SMALL_LOUD, "--quiet"]


@dataclass(frozen=True)
class SharedSweep:
    out: Path        # the cells: read only (copy() first to change anything)
    seconds: float   # how long the sweep took, in the process that ran it

    def copy(self, to: Path) -> Path:
        """A writable copy of the cells at `to`."""
        shutil.copytree(self.out, to)
        for f in to.rglob("*"):
            f.chmod(0o755 if f.is_dir() else 0o644)
        return to


def build_once(root: Path) -> SharedSweep:
    """The shared sweep under `root` (a folder every worker of the session sees): the first caller runs it while
    holding a lock, the others wait on the lock and read what it wrote."""
    from .cli import run_ok

    root.mkdir(parents=True, exist_ok=True)
    out, done = root / "cells", root / "done.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if out.exists():  # a worker that died mid-sweep: start afresh
                shutil.rmtree(out)
            seconds = run_ok(*SWEEP, "--out", str(out))
            for cell in out.glob("*.json"):
                cell.chmod(0o444)  # a test that writes into the shared cells fails loudly
            done.write_text(json.dumps({"seconds": seconds}))
    return SharedSweep(out, json.loads(done.read_text())["seconds"])
