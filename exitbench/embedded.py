"""The checkpoints shipped inside the package, used when a command gets no --checkpoint."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .models.checkpoint import EMBEDDED_DIR, Checkpoint, load_checkpoint

DEFAULT = "tiny-raven"


def embedded_names() -> list[str]:
    if not EMBEDDED_DIR.exists():
        return []
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").exists())


def resolve(checkpoint: str | Path | None) -> Path:
    """A directory for `checkpoint`: a path, the name of an embedded checkpoint, or None for the default."""
    if checkpoint is None:
        checkpoint = DEFAULT
    elif Path(checkpoint).exists():
        return Path(checkpoint)  # a directory on disk wins over an embedded name
    if isinstance(checkpoint, str) and checkpoint in embedded_names():
        return EMBEDDED_DIR / checkpoint
    if checkpoint == DEFAULT:
        raise CheckpointError(f"the embedded checkpoint {DEFAULT} is missing from {EMBEDDED_DIR}; "
                              "reinstall exitbench or pass --checkpoint DIR")
    return Path(checkpoint)


def open_checkpoint(checkpoint: str | Path | None, dtype: str = "float32", device: str = "cpu") -> Checkpoint:
    return load_checkpoint(resolve(checkpoint), dtype=dtype, device=device)
