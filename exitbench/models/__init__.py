"""Looped language models: the generic stage view, the architectures, and checkpoint I/O."""
from .attention import AttnContext
from .cache import KVCache
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .gpt2 import LoopedGPT2, LoopedGPT2Config
from .hrm_text import HrmText, HrmTextConfig
from .looped import LoopedLM, LoopGroup, Stage
from .nanbeige import Nanbeige, NanbeigeConfig
from .ouro import Ouro, OuroConfig
from .raven import Raven, RavenConfig
from .registry import ARCHITECTURES

__all__ = ["ARCHITECTURES", "AttnContext", "Checkpoint", "HrmText", "HrmTextConfig", "KVCache", "LoopGroup",
           "LoopedGPT2", "LoopedGPT2Config", "LoopedLM", "Nanbeige", "NanbeigeConfig", "Ouro", "OuroConfig", "Raven",
           "RavenConfig", "Stage", "load_checkpoint", "save_checkpoint"]
