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
        for cls_name in config.get("architectures") or []:
            name = _HF_CLASS_NAMES.get(cls_name, name)
    if name not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture {name!r} in config.json (model_type); "
                              f"known: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]
