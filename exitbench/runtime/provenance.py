"""What every result and checkpoint records about the run that made it: seed, versions, git revision, host."""
from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .. import __version__

_REPO = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# What a run executes or reads of the source tree. Docs, tests and results edited beside a run change none of its
# numbers, so they leave its revision clean (a shipped result names the commit whose code made it).
RUN_SOURCES = ("exitbench", "tasks", "bench", "pyproject.toml")


@functools.lru_cache(maxsize=4)
def git_revision(repo: Path = _REPO) -> str | None:
    """The source tree's commit, with "-dirty" when the code a run executes differs from it (changed or new files
    under RUN_SOURCES); None outside a checkout. Read once per process: the code a process runs is the code it
    imported, whatever the tree does afterwards."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *RUN_SOURCES], cwd=repo,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def machine_load() -> float | None:
    """The 1-minute load average (runnable processes), None where the OS has none (Windows)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def cpu_model() -> str | None:
    """The CPU's model name ("AMD EPYC …"), where the OS says it. Float32 results differ in their last bits
    between CPUs (each picks its own BLAS and vector kernels), and so, through a long loop, can an exit or a
    retrained checkpoint: platform.machine()'s "x86_64" does not tell two machines apart."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")) and ":" in line:
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def cpu_capability() -> str | None:
    """The vector instruction set torch's CPU kernels dispatch to here (AVX2, AVX512, …)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def run_metadata(seed: int | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "seed": seed,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "cpu": cpu_model(),
                    "cpu_capability": cpu_capability(), "cores": os.cpu_count(),
                    "cpu_threads": torch.get_num_threads(), "python": platform.python_version()},
        "versions": {"exitbench": __version__, "torch": torch.__version__,
                     "lm_eval": package_version("lm_eval") or package_version("lm-eval"),
                     "tokenizers": package_version("tokenizers"), "safetensors": package_version("safetensors")},
        "git_revision": git_revision(),
        **extra,
    }
