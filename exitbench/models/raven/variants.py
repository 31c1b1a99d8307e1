"""Which Raven a checkpoint is, told from the checkpoint itself: the keys its safetensors headers list, and
config fields a block's keys cannot show. Never from `block_class_name`: every retrofitted checkpoint says
"SandwichBlock" there (a stale copy of Huginn-0125's config) and holds no sandwich.

A variant fixes what the config leaves unsaid: the block (blocks.py), the RoPE pairing, whether `ln_f` runs
between the recurrence and the coda, which config field is RoPE's base, and whether the files carry Huginn's
`freqs_cis` table. Adding one (the Gemma-2 retrofit: (1 + w) RMSNorm, GeGLU, soft-capped attention and logits)
is a block class and an entry here whose rule tells it from the others.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...errors import CheckpointError
from .blocks import PostNormBlock, PreNormBlock, SandwichBlock
from .config import SOFTCAP_FIELDS  # a soft-capped (Gemma-2) sandwich is not Huginn's

_BLOCK_KEY = re.compile(r"transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Evidence:
    """What a checkpoint shows about its blocks: the key names inside its blocks, and the config fields the
    rules read."""

    block_keys: frozenset[str]
    config: dict[str, Any]

    def has(self, *modules: str) -> bool:
        return all(f"{m}.weight" in self.block_keys for m in modules)

    def lacks(self, *modules: str) -> bool:
        return not any(f"{m}.weight" in self.block_keys for m in modules)

    def describe(self) -> str:
        norms = sorted(k.removesuffix(".weight") for k in self.block_keys if "norm" in k)
        fields = [f"{f}={self.config[f]!r}" for f in SOFTCAP_FIELDS if self.config.get(f) is not None]
        return f"blocks with {', '.join(norms) or 'no norms'}" + (f", config {', '.join(fields)}" if fields else "")


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    block: type[nn.Module]
    rotate_half: bool  # RoPE pairs (i, i + D/2), Hugging Face's; else adjacent pairs (2i, 2i + 1), Huginn's
    norm_before_coda: bool  # ln_f between the last core state and the coda (and again before the head)
    rope_fields: tuple[str, ...]  # config fields RoPE's base is read from, the first present wins
    stores_rope_table: bool  # the files carry `freqs_cis`
    rule: Callable[[Evidence], bool]
    decided_by: str  # the rule in words, for info and errors


VARIANTS: tuple[Variant, ...] = (
    Variant("huginn", "Huginn-0125's four-norm sandwich", SandwichBlock, rotate_half=False, norm_before_coda=True,
            rope_fields=("rope_base",), stores_rope_table=True,
            rule=lambda e: e.has("norm_3", "norm_4") and e.lacks("attn.q_norm", "attn.k_norm")
            and not any(e.config.get(f) is not None for f in SOFTCAP_FIELDS),
            decided_by="norm_1, norm_2, norm_3 and norm_4 in every block, no q/k norm, no soft-capping"),
    Variant("llama", "Llama pre-norm (retrofitted Llama-3.2 / TinyLlama)", PreNormBlock, rotate_half=True,
            norm_before_coda=False, rope_fields=("rope_theta", "rope_base"), stores_rope_table=False,
            rule=lambda e: e.has("norm_1", "norm_2") and e.lacks("norm_3", "norm_4", "attn.q_norm", "attn.k_norm"),
            decided_by="norm_1 and norm_2, no norm_3/norm_4, no q/k norm"),
    Variant("olmo", "OLMo-2 post-norm with q/k norm (retrofitted OLMo-2)", PostNormBlock, rotate_half=True,
            norm_before_coda=False, rope_fields=("rope_theta", "rope_base"), stores_rope_table=False,
            rule=lambda e: e.has("norm_1", "norm_2", "attn.q_norm", "attn.k_norm") and e.lacks("norm_3", "norm_4"),
            decided_by="norm_1, norm_2, attn.q_norm and attn.k_norm, no norm_3/norm_4"),
)
BY_NAME = {v.name: v for v in VARIANTS}


def variant(name: str) -> Variant:
    if name not in BY_NAME:
        raise CheckpointError(f"unknown Raven variant {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def evidence(config: dict[str, Any], keys: Iterable[str], where: str) -> Evidence:
    """The key names found inside any block. Their union decides: a block that lacks one of them is then
    named by the loader's key check ("lacks key transformer.coda.1.attn.q_norm.weight"), which says more than
    a disagreement would."""
    inside = set()
    for key in keys:
        m = _BLOCK_KEY.match(key)
        if m:
            inside.add(m[3])
    if not inside:
        raise CheckpointError(f"{where}: no transformer.prelude / core_block / coda block keys, so this is no Raven "
                              "layout (model_type huginn_raven needs Huginn's key names)")
    return Evidence(frozenset(inside), config)


def detect(config: dict[str, Any], keys: Iterable[str], where: str) -> Variant:
    """The variant whose rule the checkpoint matches; none or several is a one-line error saying what decided."""
    seen = evidence(config, keys, where)
    matched = [v for v in VARIANTS if v.rule(seen)]
    if len(matched) == 1:
        return matched[0]
    known = "; ".join(f"{v.name}: {v.decided_by}" for v in VARIANTS)
    if not matched:
        raise CheckpointError(f"{where}: {seen.describe()} match no Raven variant exitbench knows ({known})")
    raise CheckpointError(f"{where}: {seen.describe()} match {' and '.join(v.name for v in matched)}; "
                          "the variants' rules must tell them apart")
