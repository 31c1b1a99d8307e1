"""Raven, the architecture of Huginn-0125 (Geiping et al. 2025), written from the paper (arXiv 2502.05171)
and its released checkpoint's layout (tomg-group-umd/huginn-0125), and the checkpoints that reuse its layout:
the retrofitted Llama / TinyLlama / OLMo-2 models (McLeish et al. 2025, arXiv 2511.07384).

    e  = prelude(embed_scale · wte(x))                 embed_scale sqrt(h) (Huginn), 1 (retrofitted)
    s0 ~ TruncNormal(0, (state_std · init_scale)²)     0.632 (Huginn); zeros when init_scale = 0
    s_k = core(adapter([s_{k-1}; e]))                  k = 1 … r
    logits = lm_head(ln_f(coda(ln_f(s_r))))            Huginn; the retrofitted models skip the inner ln_f

The blocks and the RoPE pairing come from the checkpoint's variant (variants.py), told from its keys. The
module tree mirrors Huginn's, so `state_dict()` has exactly its key names.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import CheckpointError
from ..attention import AttnContext, rope_table
from ..linear import FlatLinear
from ..looped import LoopedLM, LoopGroup, Stage, frozen_layers, on_rows, trunc_normal_
from .blocks import RMSNorm
from .config import RavenConfig
from .variants import Variant, detect, variant


def takase_init_(model: nn.Module, n_embd: int, effective_depth: int,
                 generator: torch.Generator | None = None) -> None:
    """Huginn's "takase" init: σ = sqrt(2/(5h)) everywhere, σ/sqrt(2·depth) on output projections."""
    std = math.sqrt(2 / (5 * n_embd))
    out_std = std / math.sqrt(2 * effective_depth)
    for name, p in model.named_parameters():
        if ".norm_" in name or name.endswith("ln_f.weight"):
            nn.init.ones_(p)
        elif name.endswith("qk_bias"):
            nn.init.zeros_(p)
        elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
            trunc_normal_(p.data, out_std, generator)
        elif name.endswith("mlp.fc.weight"):
            half = p.shape[0] // 2
            trunc_normal_(p.data[:half], std, generator)
            trunc_normal_(p.data[half:], out_std, generator)
        elif p.dim() >= 2:
            trunc_normal_(p.data, std, generator)


class Raven(LoopedLM):
    config_class = RavenConfig

    def __init__(self, config: RavenConfig):
        super().__init__(config)
        c = config
        self.variant: Variant = variant(c.variant)
        v = self.variant
        n_pre, n_core = c.n_layers_in_prelude, c.n_layers_in_recurrent_block

        def blocks(first: int, n: int) -> nn.ModuleList:
            return nn.ModuleList(v.block(c, first + j, v.rotate_half) for j in range(n))

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.padded_vocab_size, c.n_embd),
            prelude=blocks(0, n_pre),
            adapter=FlatLinear(2 * c.n_embd, c.n_embd, bias=False),
            core_block=blocks(n_pre, n_core),
            coda=blocks(n_pre + n_core, c.n_layers_in_coda),
            ln_f=RMSNorm(c.n_embd, c.norm_eps),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.padded_vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # Huginn stores this (1, block_size, 1, head_dim/2, 2) table in checkpoints; we recompute it.
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        self.emb_scale = c.embed_scale
        self._stages = self._build_stages()

    @classmethod
    def read_config(cls, raw: dict, keys: set[str], where: str) -> RavenConfig:
        """The config, with the variant the checkpoint's keys show (variants.detect). A retrofitted checkpoint
        that stores its own lm_head.weight but says tie_embeddings true is refused: the head would silently be
        the embedding. (Huginn-0125's files hold a duplicate of the tied embedding there, by an upload slip.)"""
        config = RavenConfig.from_dict(raw, variant=detect(raw, keys, where).name)
        if config.variant != "huginn" and config.tie_embeddings and "lm_head.weight" in keys:
            raise CheckpointError(f"{where}: config tie_embeddings is true but the files hold lm_head.weight, a "
                                  "head of its own that a tied model would ignore; set tie_embeddings false "
                                  "(the conversions untie the head) or remove lm_head.weight")
        return config

    def _freqs(self) -> torch.Tensor:
        c, v = self.config, self.variant
        base = next(getattr(c, f) for f in v.rope_fields if getattr(c, f) is not None)
        scaling = c.rope_scaling if c.rope_scaling_kind() else None
        return rope_table(c.head_dim, c.block_size, base, scaling)[None, :, None]

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device)."""
        self.freqs_cis = self._freqs().to(self.transformer.wte.weight.device)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        takase_init_(self, self.config.n_embd, self.config.effective_expected_depth, generator)

    # ---- the stage view the engine uses ----------------------------------------------------------
    @property
    def rope(self) -> torch.Tensor:
        # One view object per table: attention keeps the table's spread form on it (attention.spread_rope).
        table = self.freqs_cis
        held = self.__dict__.get("_rope_view")
        if held is None or held[0] is not table:
            held = (table, table[0, :, 0])
            self.__dict__["_rope_view"] = held
        return held[1]

    def _run_layers(self, layers: nn.ModuleList, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        rope = self.rope
        for layer in layers:
            x = layer(x, rope, ctx)
        return x

    def _init_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        std = self.config.state_std * self.config.init_scale
        if noise is None or std == 0:
            return torch.zeros_like(e)
        return noise * std

    def _core_step(self, s: torch.Tensor, e: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self._run_layers(self.transformer.core_block, self.transformer.adapter(torch.cat([s, e], -1)), ctx)

    def _frozen_core_step(self, s: torch.Tensor, e: torch.Tensor, ctx: AttnContext, keep: torch.Tensor
                          ) -> torch.Tensor:
        t, rope = self.transformer, self.rope
        # No injection for a pinned row: its pinned state itself enters every core layer.
        x = on_rows(s, keep, lambda a, b: t.adapter(torch.cat([a, b], -1)), s, e)
        return frozen_layers(t.core_block, x, s, keep, lambda layer, h: layer.attend(h, rope, ctx))

    def _build_stages(self) -> list[Stage | LoopGroup]:
        t, c = self.transformer, self.config
        ids = lambda layers: [blk.attn.layer_id for blk in layers]  # noqa: E731
        # embed-init (a conversion's option): the loop starts from the prelude's output, not from noise.
        from_input = c.initial_state_mode == "embed-init"
        return [
            Stage("prelude", lambda x, ctx: self._run_layers(t.prelude, x, ctx.at_iteration(0)), ids(t.prelude),
                  modules=[t.prelude]),
            LoopGroup("core_block", init=(lambda e, noise: e) if from_input else self._init_state,
                      step=self._core_step, finish=t.ln_f if self.variant.norm_before_coda else nn.Identity(),
                      attn_layers=ids(t.core_block), n_layers=len(t.core_block),
                      default_steps=c.mean_recurrence, max_steps=c.max_recurrence,
                      random_init=c.init_scale > 0 and not from_input, modules=[t.adapter, t.core_block],
                      frozen_step=self._frozen_core_step, injects_input=True),
            Stage("coda", lambda x, ctx: self._run_layers(t.coda, x, ctx.at_iteration(0)), ids(t.coda), modules=[t.coda]),
        ]

    def stages(self) -> list[Stage | LoopGroup]:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer.wte(ids) * self.emb_scale  # positions enter through RoPE, in attention

    def layer_split(self) -> dict[str, int]:
        c = self.config
        return {"prelude": c.n_layers_in_prelude, "core": c.n_layers_in_recurrent_block, "coda": c.n_layers_in_coda}

    def parameter_breakdown(self) -> dict[str, int]:
        t = self.transformer
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        parts = {"embedding": count(t.wte), "prelude": count(t.prelude), "adapter": count(t.adapter),
                 "core": count(t.core_block), "coda": count(t.coda), "ln_f": count(t.ln_f)}
        if not self.config.tie_embeddings:
            parts["lm_head"] = count(self.lm_head)
        return parts

    @property
    def tied_head(self) -> bool:
        return self.config.tie_embeddings

    def describe_variant(self) -> dict[str, str]:
        """What `info` says about the block this checkpoint holds and what told it."""
        v = self.variant
        return {"name": v.name, "summary": v.summary, "decided_by": v.decided_by,
                "rope": "rotate-half" + (" (llama3 scaling)" if self.config.rope_scaling_kind() else "")
                if v.rotate_half else "interleaved pairs",
                "ln_f_before_coda": v.norm_before_coda}

    def shape_hint(self) -> str:
        c, v = self.config, self.variant
        return (f" (read as the {v.name} variant, {v.decided_by}, with n_embd={c.n_embd}, n_heads={c.n_heads}, "
                f"num_key_value_heads={c.num_key_value_heads}, head_dim={c.head_dim}, intermediate_size="
                f"{c.intermediate_size}: attn.Wqkv has (n_heads + 2·num_key_value_heads)·head_dim rows)")

    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """Tensors Huginn's files carry beyond our parameters: the RoPE table (and the tied head, via state_dict);
        the retrofitted conversions store no table."""
        return {"freqs_cis": self.freqs_cis} if self.variant.stores_rope_table else {}
