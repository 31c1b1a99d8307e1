"""Looped language models: the generic stage view, the architectures, and checkpoint I/O."""
from .attention import AttnContext
from .cache import KVCache
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .gpt2 import LoopedGPT2, LoopedGPT2Config
from .looped import LoopedLM, LoopGroup, Stage
from .ouro import Ouro, OuroConfig
from .raven import Raven, RavenConfig
from .registry import ARCHITECTURES

# The embedded models' families, which training builds; every other family is reached through the registry.
__all__ = ["ARCHITECTURES", "AttnContext", "Checkpoint", "KVCache", "LoopGroup", "LoopedGPT2", "LoopedGPT2Config",
           "LoopedLM", "Ouro", "OuroConfig", "Raven", "RavenConfig", "Stage", "load_checkpoint", "save_checkpoint"]
