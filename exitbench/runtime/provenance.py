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


def busy(load: dict[str, Any] | None) -> bool:
    """Whether a timing's recorded load says other work competed for the cores, at its start or its end. A run
    using every core puts the load near the core count by itself, so only a load well above it (a quarter
    more, and half a process) says something else was running."""
    if not load or not load.get("cpus"):
        return False
    limit = 1.25 * load["cpus"] + 0.5
    return any(v is not None and v > limit for v in (load.get("start"), load.get("end")))


def threads_advice(threads: int | None) -> str:
    """What to do about timings taken beside other work: fewer threads helps only a run that used several (or
    whose threads were not recorded, None)."""
    if threads == 1:
        return "rerun on an idle machine"
    return "rerun on an idle machine, or with --threads 1 (one core per run times more steadily)"


def busy_at_start(threads: int | None) -> str | None:
    """A warning line when other work already holds every core as a run starts (its 1-minute load above the
    core count): the run's wall-clock will be unreliable, so say so before it is spent, not only after."""
    load, cpus = machine_load(), os.cpu_count()
    if load is None or not cpus or load <= cpus:
        return None
    return (f"the machine is busy as this run starts (load {load:g} on {cpus} cores): its wall-clock timings "
            f"will be unreliable (quality and iterations are not); {threads_advice(threads)}")


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
