"""Architecture names as they appear in `config.json` (`model_type`, or HF `architectures`)."""
from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .looped import LoopedLM
from .raven import Raven

ARCHITECTURES: dict[str, type[LoopedLM]] = {Raven.architecture: Raven}
_HF_CLASS_NAMES = {"RavenForCausalLM": Raven.architecture}


def architecture_of(config: dict[str, Any]) -> type[LoopedLM]:
    name = config.get("model_type")
    if name is None:
        classes = config.get("architectures") or []
        name = next((_HF_CLASS_NAMES[c] for c in classes if c in _HF_CLASS_NAMES), None)
        if name is None:
            raise CheckpointError(f"config.json names no known architecture (model_type missing, architectures="
                                  f"{classes}); known model_type values: {', '.join(sorted(ARCHITECTURES))}")
    if name not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture {name!r} in config.json (model_type); "
                              f"known: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]
