"""Files on disk: directory listings for before/after comparisons (a command must not write where it only
reads), and a checkpoint shard cut short."""
from __future__ import annotations

from pathlib import Path


def listing(path: Path) -> list[str]:
    """Every path under `path` (relative), for before/after comparisons."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def truncate_shard(checkpoint: Path) -> Path:
    """Cut the second *.safetensors file of a sharded checkpoint to half its length; returns that shard."""
    shard = sorted(checkpoint.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return shard
