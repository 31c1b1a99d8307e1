"""The checkpoints shipped inside the package, used when a command gets no --checkpoint."""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .hub import fetch, hub_source, parse_hub_id

DEFAULT = "tiny-raven"
EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "checkpoints"


def source_label(path: Path) -> str:
    """How reports name a checkpoint: `embedded:NAME` for one shipped in the package, `hub:ORG/NAME@COMMIT`
    for a hub cache snapshot, else its path."""
    hub = hub_source(path)
    if hub is not None:
        return f"hub:{hub['repo']}@{hub['commit'][:12]}"
    name = embedded_name(path)
    return f"embedded:{name}" if name else str(path)


def embedded_name(path: Path) -> str | None:
    """The name of a checkpoint shipped in the package (`tiny-raven`, `tiny-ouro/stage-1`), None for any other."""
    try:
        return str(Path(path).resolve().relative_to(EMBEDDED_DIR))
    except ValueError:
        return None


def recorded_path(path: Path) -> str:
    """Where a result says its checkpoint came from: an embedded one by its name, the same on every machine (its
    install directory names nobody's checkpoint), any other by the path it was loaded from."""
    return embedded_name(path) or str(path)


def embedded_names() -> list[str]:
    if not EMBEDDED_DIR.exists():
        return []
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").exists())


def resolve(checkpoint: str | Path | None) -> Path:
    """A directory for `checkpoint`: a path, the name of an embedded checkpoint, a hub id `org/name[@revision]`
    (its snapshot in the hub cache, models/hub.py), or None for the default."""
    if checkpoint is None:
        checkpoint = DEFAULT
    elif Path(checkpoint).exists():
        return Path(checkpoint)  # a directory on disk wins over an embedded name
    if isinstance(checkpoint, str) and (checkpoint in embedded_names() or _embedded_subdir(checkpoint)):
        return EMBEDDED_DIR / checkpoint
    if checkpoint == DEFAULT:
        raise CheckpointError(f"the embedded checkpoint {DEFAULT} is missing from {EMBEDDED_DIR}; "
                              "reinstall exitbench or pass --checkpoint DIR")
    hub_id = parse_hub_id(str(checkpoint))
    if hub_id is not None:
        return fetch(*hub_id)
    return Path(checkpoint)


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
    """The training step a checkpoint was saved at, from its config's provenance; None where it says none (a
    mistyped config is refused by the checkpoint's own schema when it is loaded)."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    training = (config.get("exitbench") if isinstance(config, dict) else None) or {}
    training = training.get("training") if isinstance(training, dict) else None
    steps = training.get("steps_done") if isinstance(training, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None
