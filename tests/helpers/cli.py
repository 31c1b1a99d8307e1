"""Running `exitbench` the way a user does: in this process (typer's CliRunner, with what reaches file descriptor 2)
or as a subprocess with a quiet, offline, single-threaded environment; and the one check of what it answers to bad
input (one line, exit 2)."""
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


def assert_one_line_error(res, words=(), fd=None) -> str:
    """The CLI's answer to bad input: exit code 2, no traceback, nothing on stdout, and on stderr one line
    `error: …` that contains every string in `words`. Returns the line (without its newline).

    `res` is a click Result (typer's CliRunner) or a subprocess.CompletedProcess. After an in-process run that may
    reach lm-eval or datasets, pass `fd=capfd.readouterr()` (with capfd read just before the run as well): their
    loggers write straight to file descriptors 1 and 2, which the Result does not see.
    """
    code = res.exit_code if hasattr(res, "exit_code") else res.returncode
    stdout, stderr = res.stdout, res.stderr
    if fd is not None:
        stdout, stderr = stdout + fd.out, stderr + fd.err
    what = explain(res) if hasattr(res, "exit_code") else f"exit code {code}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    if fd is not None:
        what += f"\nfile descriptor 1:\n{fd.out}\nfile descriptor 2:\n{fd.err}"
    assert code == 2, what
    exception = getattr(res, "exception", None)
    assert exception is None or isinstance(exception, SystemExit), what
    assert "Traceback" not in stdout + stderr, what
    assert stdout == "", what
    assert stderr.startswith("error: ") and stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    line = stderr[:-1]
    for word in words:
        assert word in line, (word, line)
    return line


def invoke(args: list[str], capfd) -> tuple[int, list[str], str]:
    """(exit code, non-empty stderr lines, stdout) of `exitbench ARGS` in this process, with whatever reaches
    file descriptor 2 directly (lm-eval's loggers write there)."""
    capfd.readouterr()
    res = runner.invoke(app, args)
    fd = capfd.readouterr()
    stderr = res.stderr + fd.err
    assert res.exception is None or isinstance(res.exception, SystemExit), explain(res)
    assert "Traceback" not in stderr + res.stdout + fd.out
    return res.exit_code, [line for line in stderr.splitlines() if line.strip()], res.stdout + fd.out


def one_line(args: list[str], capfd, words=()) -> str:
    """`exitbench ARGS` in this process ends as assert_one_line_error requires; returns the line."""
    capfd.readouterr()
    res = runner.invoke(app, args)
    return assert_one_line_error(res, words, fd=capfd.readouterr())


# Runs ARGV and writes the peak resident memory of that one child (bytes) to PATH: RUSAGE_CHILDREN of a fresh
# process counts only the command, never other children the test process has reaped.
_MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)); "
            "sys.exit(code)")


def run_measured(cmd: list[str], peak_file, **kwargs):
    """subprocess.run(cmd, capture_output=True, text=True, **kwargs) and the command's peak RSS in bytes (Linux
    reports ru_maxrss in KiB)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(peak_file), *cmd], capture_output=True, text=True,
                          **kwargs)
    return proc, int(open(peak_file).read())


def full_size_env(cache_dir) -> dict[str, str]:
    """The subprocess environment of the full-size tests: its own hash cache (a multi-GB fingerprint must not
    land in the user's ~/.cache), and one intra-op thread as every child's. The suite's other worker keeps the
    second core busy, and there two threads' barriers cost more than the second thread gives: Huginn's `trace`
    took 56 s on two threads and 40 s on one beside a busy core, against 30 s on two idle ones (2026-12-07)."""
    return subprocess_env(EXITBENCH_CACHE_DIR=str(cache_dir))


def run_exitbench_measured(args: list[str], env: dict[str, str], tmp_path, timeout: int = 900):
    """`exitbench ARGS` as a subprocess that must succeed: (completed process, its peak resident bytes)."""
    proc, peak = run_measured(exitbench_cmd(*args), tmp_path / "peak", env=env, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, peak


def written_full_size(tmp_path_factory, name: str, script: str, args: list[str], disk_needed: float, timeout: int):
    """A generator for a module fixture: a checkpoint `bench/SCRIPT` writes (it skips when the disk lacks
    `disk_needed` bytes), yielded, then deleted with its folder."""
    import shutil
    import subprocess

    import pytest

    from helpers.paths import REPO

    root = tmp_path_factory.mktemp(name)
    free = shutil.disk_usage(root).free
    if free < disk_needed:
        pytest.skip(f"{name} needs {disk_needed / 1e9:.0f} GB free under {root}; {free / 1e9:.1f} GB are")
    out = root / "ck"
    try:
        subprocess.run([sys.executable, str(REPO / "bench" / script), str(out), *args], check=True, timeout=timeout,
                       env=subprocess_env())
        yield out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def rendered(renderables, width: int = 120) -> str:
    """Rich renderables as plain text at `width` columns, as a terminal of that width shows them."""
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None)
    for r in renderables:
        console.print(r)
    return console.file.getvalue()
