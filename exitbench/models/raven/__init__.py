"""Raven: Huginn-0125's recurrent-depth architecture and the checkpoints that reuse its layout. config.py reads
config.json, variants.py tells a checkpoint's block from its keys, blocks.py holds one class per block,
model.py the pipeline prelude → loop → coda."""
from .blocks import CausalSelfAttention, GatedMLP, PostNormBlock, PreNormBlock, RMSNorm, SandwichBlock
from .config import STATE_STD, RavenConfig
from .model import Raven, takase_init_
from .variants import VARIANTS, Variant, detect

__all__ = ["STATE_STD", "VARIANTS", "CausalSelfAttention", "GatedMLP", "PostNormBlock", "PreNormBlock", "RMSNorm",
           "Raven", "RavenConfig", "SandwichBlock", "Variant", "detect", "takase_init_"]
