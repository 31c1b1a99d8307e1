"""The families exitbench loads, by the names config.json gives them (`model_type`, or Hugging Face
`architectures`). A family registers with one call, `register(ModelClass)`, and its names come from its config
class: `model_type`, `hf_class` (the class save_checkpoint writes), and `model_type_aliases` / `hf_aliases`
(other releases' names for the same family). That config class is also config.json's schema (models/schema.py).
"""
from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .dory import Dory
from .gpt2 import LoopedGPT2
from .hrm_text import HrmText
from .inkling2 import Inkling2
from .looped import LoopedLM
from .nanbeige import Nanbeige
from .ouro import Ouro
from .raven import Raven

ARCHITECTURES: dict[str, type[LoopedLM]] = {}
_MODEL_TYPES: dict[str, str] = {}  # every model_type a family answers to → its architecture
_HF_CLASS_NAMES: dict[str, str] = {}  # every Hugging Face class name → its architecture
# Source families of the retrofitted-recurrence conversions: a converted checkpoint that kept its source's model_type.
_RETROFIT_SOURCES = ("llama", "olmo", "olmo2", "gemma2", "qwen2", "mistral")


def register(model_class: type[LoopedLM]) -> None:
    """Make a family known by every name its config class gives it: the one call a new family adds
    (docs/adding-a-family.md)."""
    c = model_class.config_class
    ARCHITECTURES[model_class.architecture] = model_class
    for name in (c.model_type, *getattr(c, "model_type_aliases", ())):
        _MODEL_TYPES[name] = model_class.architecture
    for name in (c.hf_class, *getattr(c, "hf_aliases", ())):
        _HF_CLASS_NAMES[name] = model_class.architecture


for _family in (Raven, LoopedGPT2, Ouro, Nanbeige, HrmText, Inkling2, Dory):
    register(_family)


def _name(config: dict[str, Any]) -> str | None:
    name = config.get("model_type")
    if name is None:
        classes = config.get("architectures") or []
        return next((_HF_CLASS_NAMES[c] for c in classes if isinstance(c, str) and c in _HF_CLASS_NAMES), None)
    return _MODEL_TYPES.get(name, name) if isinstance(name, str) else None


def known_architecture(config: dict[str, Any]) -> type[LoopedLM] | None:
    """The family config.json names, or None where it names none exitbench knows (architecture_of says why)."""
    return ARCHITECTURES.get(_name(config))


def architecture_of(config: dict[str, Any]) -> type[LoopedLM]:
    name = _name(config)
    if name is None:
        classes = config.get("architectures") or []
        raise CheckpointError(f"config.json names no known architecture (model_type missing, architectures="
                              f"{classes}); known model_type values: {', '.join(sorted(ARCHITECTURES))}")
    if name not in ARCHITECTURES:
        hint = (f"; a retrofitted-recurrence checkpoint in Huginn's layout (transformer.core_block keys) says "
                f"model_type {Raven.architecture!r}, whatever its source model" if name in _RETROFIT_SOURCES else "")
        raise CheckpointError(f"unknown architecture {name!r} in config.json (model_type); "
                              f"known: {', '.join(sorted(ARCHITECTURES))}{hint}")
    return ARCHITECTURES[name]
