"""Running `exitbench` the way a user does: in this process (typer's CliRunner) or as a subprocess with a quiet,
offline, single-threaded environment."""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from typer.testing import CliRunner

from exitbench.cli import app

runner = CliRunner()  # click ≥ 8.2 keeps result.stdout and result.stderr apart


def run_cli(*args: str):
    """`exitbench run ARGS --quiet` in this process; returns (click Result, seconds)."""
    t0 = time.perf_counter()
    res = runner.invoke(app, ["run", *args, "--quiet"])
    return res, time.perf_counter() - t0


def explain(res) -> str:
    text = f"exit code {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    if res.exc_info and res.exception and not isinstance(res.exception, SystemExit):
        text += "\n" + "".join(traceback.format_exception(*res.exc_info))
    return text


def run_ok(*args: str) -> float:
    res, seconds = run_cli(*args)
    assert res.exit_code == 0, explain(res)
    return seconds


def subprocess_env(**extra: str) -> dict[str, str]:
    """A child's environment: offline hub, one intra-op thread (the machine's cores may be busy: a tiny
    model gains nothing from threads and its barriers make a busy core cost seconds)."""
    env = dict(os.environ)
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def exitbench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "exitbench", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
