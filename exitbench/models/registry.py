"""Architecture names as they appear in `config.json` (`model_type`, or HF `architectures`)."""
from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .gpt2 import LoopedGPT2
from .hrm_text import HrmText
from .inkling2 import Inkling2
from .looped import LoopedLM
from .nanbeige import Nanbeige
from .ouro import Ouro
from .raven import Raven

ARCHITECTURES: dict[str, type[LoopedLM]] = {Raven.architecture: Raven, LoopedGPT2.architecture: LoopedGPT2,
                                             Ouro.architecture: Ouro, Nanbeige.architecture: Nanbeige,
                                             HrmText.architecture: HrmText, Inkling2.architecture: Inkling2}
# A plain GPT-2 checkpoint becomes a looped one once its config.json names loop_groups.
_MODEL_TYPE_ALIASES = {"gpt2": LoopedGPT2.architecture,
                       # Inkling 2 Mini's multimodal release: its text model (Inkling2Config reads text_config)
                       "inkling2_loop": Inkling2.architecture}
# Source families of the retrofitted-recurrence conversions: a converted checkpoint that kept its source's model_type.
_RETROFIT_SOURCES = ("llama", "olmo", "olmo2", "gemma2", "qwen2", "mistral")
_HF_CLASS_NAMES = {"RavenForCausalLM": Raven.architecture, "LoopedGPT2LMHeadModel": LoopedGPT2.architecture,
                   "GPT2LMHeadModel": LoopedGPT2.architecture, "OuroForCausalLM": Ouro.architecture,
                   "NanbeigeForCausalLM": Nanbeige.architecture, "HrmTextForCausalLM": HrmText.architecture,
                   "Inkling2LoopForCausalLM": Inkling2.architecture,
                   "Inkling2LoopForConditionalGeneration": Inkling2.architecture}


def register(model_class: type[LoopedLM]) -> None:
    """Make a family known by its config's model_type and Hugging Face class name: the one line a new family's
    module adds here (docs/adding-a-family.md)."""
    ARCHITECTURES[model_class.architecture] = model_class
    _HF_CLASS_NAMES[model_class.config_class.hf_class] = model_class.architecture


def architecture_of(config: dict[str, Any]) -> type[LoopedLM]:
    name = config.get("model_type")
    if name is None:
        classes = config.get("architectures") or []
        name = next((_HF_CLASS_NAMES[c] for c in classes if c in _HF_CLASS_NAMES), None)
        if name is None:
            raise CheckpointError(f"config.json names no known architecture (model_type missing, architectures="
                                  f"{classes}); known model_type values: {', '.join(sorted(ARCHITECTURES))}")
    name = _MODEL_TYPE_ALIASES.get(name, name)
    if name not in ARCHITECTURES:
        hint = (f"; a retrofitted-recurrence checkpoint in Huginn's layout (transformer.core_block keys) says "
                f"model_type {Raven.architecture!r}, whatever its source model" if name in _RETROFIT_SOURCES else "")
        raise CheckpointError(f"unknown architecture {name!r} in config.json (model_type); "
                              f"known: {', '.join(sorted(ARCHITECTURES))}{hint}")
    return ARCHITECTURES[name]
