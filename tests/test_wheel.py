"""A plain install works: the wheel carries the shipped tasks and the embedded checkpoints, and an installed
copy runs a shipped task from a directory that has no source tree in it."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers.cli import subprocess_env
from helpers.paths import REPO


def _run(args: list, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{args}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_an_installed_wheel_runs_a_shipped_task(tmp_path):
    """Slow (a wheel build and a sweep in a subprocess, ~1 min); no fast test builds the wheel, but every fast
    test reads the tasks through the same SHIPPED_TASKS the installed copy resolves."""
    wheels = tmp_path / "wheels"
    # No build isolation: the build needs only setuptools, which the test environment has, and no network.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", wheels, REPO],
         timeout=600)
    wheel = next(wheels.glob("exitbench-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"exitbench/tasks/chains/chains.yaml", "exitbench/tasks/chains/test.jsonl",
            "exitbench/checkpoints/tiny-raven/model.safetensors"} <= names
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", site, wheel], timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The installed copy first on the path, from a directory with no checkout: the editable install of this
    # checkout comes after the path entries, so it cannot answer for the installed one.
    env = subprocess_env(PYTHONPATH=str(site))
    where = _run([sys.executable, "-c", "import exitbench.harness.task_set as t; print(t.__file__); "
                  "print(t.SHIPPED_TASKS)"], cwd=elsewhere, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    out = elsewhere / "cells"
    _run([sys.executable, "-m", "exitbench", "run", "--tasks", "chains", "--policy", "fixed", "--baselines", "16",
          "--limit", "4", "--quiet", "--out", out], cwd=elsewhere, env=env, timeout=600)
    assert len(list(out.glob("chains__fixed-16__*.json"))) == 1
