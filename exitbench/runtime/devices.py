"""Which torch device a run uses. A device that is asked for and missing is an error, never a silent CPU run."""
from __future__ import annotations

import os

import torch

from ..errors import ExitbenchError

KINDS = ("auto", "cpu", "cuda", "cuda:N", "mps")


def resolve_device(name: str | None) -> str:
    """`None`/"auto": CUDA when there is one, else CPU. Under torchrun / accelerate launch each process takes
    the GPU of its local rank."""
    name = (name or "auto").strip()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ExitbenchError(f"--device {name}: this machine has no CUDA device (torch {torch.__version__} "
                                 f"sees none); use --device cpu")
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ExitbenchError(f"--device {name}: CUDA devices here are cuda:0 … cuda:{torch.cuda.device_count() - 1}")
        if not index and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return name
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ExitbenchError("--device mps: this machine has no MPS device; use --device cpu")
        return name
    raise ExitbenchError(f"unknown --device {name!r}; choose one of {', '.join(KINDS)}")


def available_memory(device: str) -> int | None:
    """Bytes free for a run on `device` now: CUDA's free memory, the system's MemAvailable for the CPU (what
    the kernel could hand out without swapping), None where neither can be read (MPS)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    if device == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


# More threads than this per core only queue on each other (and a huge count would make torch start them all).
THREADS_PER_CORE = 4


def use_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads for this process (None: leave torch's default)."""
    if threads is None:
        return
    from .validation import at_least

    most = THREADS_PER_CORE * (os.cpu_count() or 1)
    if at_least("--threads", threads) > most:
        raise ExitbenchError(f"--threads {threads}: at most {most} ({THREADS_PER_CORE} per core of this "
                             f"machine's {os.cpu_count() or 1}); 1 times most steadily")
    torch.set_num_threads(threads)
