"""The checkpoints shipped inside the package, used when a command gets no --checkpoint."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .models.checkpoint import Checkpoint, load_checkpoint

DEFAULT = "tiny-raven"
EMBEDDED_DIR = Path(__file__).resolve().parent / "checkpoints"


def source_label(path: Path) -> str:
    """How reports name a checkpoint: `embedded:NAME` for one shipped in the package, else its path."""
    try:
        return f"embedded:{Path(path).resolve().relative_to(EMBEDDED_DIR)}"
    except ValueError:
        return str(path)


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
    if isinstance(checkpoint, str) and (checkpoint in embedded_names() or _embedded_subdir(checkpoint)):
        return EMBEDDED_DIR / checkpoint
    if checkpoint == DEFAULT:
        raise CheckpointError(f"the embedded checkpoint {DEFAULT} is missing from {EMBEDDED_DIR}; "
                              "reinstall exitbench or pass --checkpoint DIR")
    return Path(checkpoint)


def open_checkpoint(checkpoint: str | Path | None, dtype: str = "auto", device: str = "cpu",
                    allow_nonfinite: bool = False) -> Checkpoint:
    return load_checkpoint(resolve(checkpoint), dtype=dtype, device=device, allow_nonfinite=allow_nonfinite)


def _embedded_subdir(name: str) -> bool:
    """A checkpoint inside an embedded one, e.g. tiny-raven/training/step-000500 (kept for geometry over training)."""
    path = EMBEDDED_DIR / name
    return ".." not in Path(name).parts and (path / "config.json").exists()


TRAINING_SUFFIX = ":training"


def expand_checkpoints(spec: str) -> list[str]:
    """A comma-separated list; an entry DIR:training stands for DIR's saved training steps in order, then DIR
    (unless DIR is the last saved step itself)."""
    out: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if not entry.endswith(TRAINING_SUFFIX):
            out.append(entry)
            continue
        base = entry[: -len(TRAINING_SUFFIX)]
        root = resolve(base)
        saved = sorted((root / "training").glob("step-*"))
        if not saved:
            raise CheckpointError(f"{entry}: {root} keeps no training checkpoints (training/step-N); train with "
                                  "--save-every to keep them")
        out.extend(str(p) for p in saved)
        if _steps_done(root) != _steps_done(saved[-1]):  # the final model is often also the last saved step
            out.append(str(root))
    if not out:
        raise CheckpointError("--checkpoints names no checkpoint")
    return out


def _steps_done(path: Path) -> int | None:
    """The training step a checkpoint was saved at, from its config (read through the config schema, so a
    mistyped provenance block is the schema's one-line error, not a crash here)."""
    from .models.checkpoint import read_config

    training = (read_config(path).get("exitbench") or {}).get("training") or {}
    steps = training.get("steps_done") if isinstance(training, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None
