"""Rank and world size from torch.distributed, so torchrun / accelerate launch shard a run's documents."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """Join the process group the launcher describes (WORLD_SIZE > 1) and return (rank, world size)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def finish_distributed() -> None:
    """Leave the process group together. A rank that exits while another still holds its connections can
    abort the other ("terminate called without an active exception" under gloo), so every rank waits for
    the last one, then the group is taken down before the interpreter exits."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
