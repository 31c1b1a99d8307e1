"""Looped GPT-2: the model of the two-scale paper (Pappone et al. 2025, arXiv 2509.23314).

    x = wte(ids) + wpe(positions)
    layers outside loop groups run once; a loop group g = layers [a … b] runs K_g times on its own output,
    s_0 = x_in, s_k = layers_a…b(s_{k−1}), x_out = s_{K_g}                    (no input injection)
    logits = lm_head(ln_f(x))                                                 lm_head tied to wte

The module tree and parameter shapes are Hugging Face's GPT2LMHeadModel (Conv1D weights stored (in, out)), so a
GPT-2 checkpoint loads as it is and becomes looped by naming `loop_groups` in its config.json.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from . import attention, limits
from .attention import AttnContext
from .looped import LoopedLM, LoopGroup, Stage, frozen_layers

ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# Buffers older GPT-2 checkpoints store: the causal mask, recomputed by every attention call here.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
_TOP_LEVEL = ("wte.", "wpe.", "h.", "ln_f.")


class Conv1D(nn.Module):
    """GPT-2's linear layer: y = x W + b with W stored (in, out), so Hugging Face GPT-2 weights load as they are."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


@dataclass
class LoopedGPT2Config:
    vocab_size: int
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    # Each group is a run of consecutive layer indices iterated together, e.g. [[4], [5, 6], [7]].
    loop_groups: list[list[int]] = field(default_factory=list)
    loop_steps: list[int] | None = None  # default K_g per group (the depth trained for)
    max_loop_steps: list[int] | None = None  # the deepest K_g the checkpoint is meant to run
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "looped_gpt2"
    hf_class = "LoopedGPT2LMHeadModel"
    # A plain GPT-2 checkpoint becomes a looped one once its config.json names loop_groups.
    model_type_aliases = ("gpt2",)
    hf_aliases = ("GPT2LMHeadModel",)

    def __post_init__(self):
        for name in ("loop_groups", "loop_steps", "max_loop_steps"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise CheckpointError(f"config {name} must be a list (one entry per loop group), got {value!r}")
        if self.loop_steps is None:
            self.loop_steps = [1] * len(self.loop_groups)
        if self.max_loop_steps is None:
            self.max_loop_steps = [2 * k for k in self.loop_steps]
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config n_embd={self.n_embd} must split into n_head={self.n_head} heads")
        if self.activation_function not in ACTIVATIONS:
            raise CheckpointError(f"config activation_function={self.activation_function!r} is not one of "
                                  f"{', '.join(ACTIVATIONS)}")
        groups = self.loop_groups
        if not groups:
            raise CheckpointError("config.json names no loop_groups, so the model has nothing to loop; add e.g. "
                                  '"loop_groups": [[4], [5, 6], [7]] (runs of consecutive layer indices)')
        previous = -1
        for g in groups:
            if (not isinstance(g, list) or not g or not all(isinstance(i, int) and not isinstance(i, bool) for i in g)
                    or g != list(range(g[0], g[0] + len(g)))):
                raise CheckpointError(f"loop group {g!r} must be a non-empty run of consecutive layer indices")
            if g[0] <= previous:
                raise CheckpointError(f"loop groups must be in layer order and must not overlap; {g!r} comes after "
                                      f"layer {previous}")
            if g[-1] >= self.n_layer:
                raise CheckpointError(f"loop group {g!r} names layer {g[-1]}, but the model has n_layer="
                                      f"{self.n_layer} (indices 0…{self.n_layer - 1})")
            previous = g[-1]
        for name in ("loop_steps", "max_loop_steps"):
            steps = getattr(self, name)
            if (not isinstance(steps, list) or len(steps) != len(groups)
                    or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in steps)):
                raise CheckpointError(f"config {name} must list one positive integer per loop group "
                                      f"({len(groups)}), got {steps!r}")
        for g, k, m in zip(groups, self.loop_steps, self.max_loop_steps):
            if m < k:
                raise CheckpointError(f"loop group {g}: max_loop_steps {m} is below loop_steps {k}")
            limits.loop_steps(f"max_loop_steps of loop group {g}", m)
        limits.norm_eps("layer_norm_epsilon", self.layer_norm_epsilon)

    # Names the rest of exitbench reads from every architecture's config.
    @property
    def n_heads(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def block_size(self) -> int:
        return self.n_positions

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LoopedGPT2Config":
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in raw.items() if k in known}
        extra = {k: v for k, v in raw.items() if k not in known}
        if "vocab_size" not in kwargs:
            raise CheckpointError("config.json lacks the field 'vocab_size', which a looped GPT-2 needs")
        if "layer_norm_epsilon" in kwargs:
            kwargs["layer_norm_epsilon"] = float(kwargs["layer_norm_epsilon"])
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update({"model_type": self.model_type, "architectures": [self.hf_class],
                    "n_ctx": self.n_positions})
        extra = {k: v for k, v in self.extra.items() if k not in out}
        return {**extra, **out}


class GPT2Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, layer_id: int):
        super().__init__()
        self.n_head, self.head_dim, self.layer_id = n_head, n_embd // n_head, layer_id
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).transpose(1, 3).unbind(2)
        y = attention.cached_causal_attention(q, k, v, ctx, self.layer_id)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT2MLP(nn.Module):
    def __init__(self, n_embd: int, activation: str):
        super().__init__()
        self.c_fc = Conv1D(n_embd, 4 * n_embd)
        self.c_proj = Conv1D(4 * n_embd, n_embd)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln_1 x), then + mlp(ln_2 x)."""

    def __init__(self, c: LoopedGPT2Config, layer_id: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.attn = GPT2Attention(c.n_embd, c.n_head, layer_id)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.mlp = GPT2MLP(c.n_embd, c.activation_function)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.feed(self.attend(x, ctx))

    # The attention sublayer, then the MLP sublayer: exit mode freeze runs them apart (looped.frozen_layers).
    def attend(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.attn(self.ln_1(x), ctx)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln_2(x))


class LoopedGPT2(LoopedLM):
    config_class = LoopedGPT2Config

    def __init__(self, config: LoopedGPT2Config):
        super().__init__(config)
        c = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.n_positions, c.n_embd),
            h=nn.ModuleList(GPT2Block(c, i) for i in range(c.n_layer)),
            ln_f=nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self._stages = self._build_stages()

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 · layers run per token)."""
        c = self.config
        depth = c.n_layer + sum(len(g) * (k - 1) for g, k in zip(c.loop_groups, c.loop_steps))
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * depth), generator=generator)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02, generator=generator)

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings

    @classmethod
    def adapt_checkpoint(cls, tensors: dict[str, torch.Tensor], config: LoopedGPT2Config) -> dict[str, torch.Tensor]:
        """Accept Hugging Face GPT-2 files as published: GPT2Model keys without `transformer.`, stored causal-mask
        buffers, and no lm_head when it is tied."""
        out = {}
        for key, t in tensors.items():
            if key.endswith(_MASK_BUFFERS):
                continue
            out["transformer." + key if key.startswith(_TOP_LEVEL) else key] = t
        if config.tie_word_embeddings and "lm_head.weight" not in out and "transformer.wte.weight" in out:
            out["lm_head.weight"] = out["transformer.wte.weight"]
        return out

    # ---- the stage view the engine uses ----------------------------------------------------------
    def _run(self, layers: list[GPT2Block], x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        for layer in layers:
            x = layer(x, ctx)
        return x

    def _build_stages(self) -> list[Stage | LoopGroup]:
        c, h = self.config, self.transformer.h
        stages: list[Stage | LoopGroup] = []
        plain: list[int] = []

        def flush() -> None:
            if plain:
                layers = [h[i] for i in plain]
                stages.append(Stage(f"layers {plain[0]}-{plain[-1]}" if len(plain) > 1 else f"layer {plain[0]}",
                                    lambda x, ctx, layers=layers: self._run(layers, x, ctx.at_iteration(0)),
                                    list(plain), modules=layers))
                plain.clear()

        starts = {g[0]: (g, k, m) for g, k, m in zip(c.loop_groups, c.loop_steps, c.max_loop_steps)}
        i = 0
        while i < c.n_layer:
            if i not in starts:
                plain.append(i)
                i += 1
                continue
            flush()
            group, k, m = starts[i]
            layers = [h[j] for j in group]
            stages.append(LoopGroup(
                "loop " + ",".join(map(str, group)),
                init=lambda x, noise: x,
                step=lambda s, x, ctx, layers=layers: self._run(layers, s, ctx),
                finish=lambda s: s,
                attn_layers=list(group), n_layers=len(group), default_steps=k, max_steps=m, modules=layers,
                frozen_step=lambda s, x, ctx, keep, layers=layers: frozen_layers(
                    layers, s, s, keep, lambda layer, h: layer.attend(h, ctx))))
            i = group[-1] + 1
        flush()
        return stages

    def stages(self) -> list[Stage | LoopGroup]:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:  # one token per row, each at its own position
            return self.transformer.wte(ids) + self.transformer.wpe(positions).unsqueeze(1)
        T = ids.shape[-1]
        if start + T > self.config.n_positions:
            raise ValueError(f"position {start + T} exceeds the model's context of {self.config.n_positions} tokens")
        pos = torch.arange(start, start + T, device=ids.device)
        return self.transformer.wte(ids) + self.transformer.wpe(pos)

    def layer_split(self) -> dict[str, int]:
        return {s.name: (s.n_layers if isinstance(s, LoopGroup) else len(s.attn_layers)) for s in self.stages()}

    def parameter_breakdown(self) -> dict[str, int]:
        t = self.transformer
        count = lambda ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
        parts = {"wte": count([t.wte]), "wpe": count([t.wpe])}
        for s in self.stages():
            parts[s.name] = count(s.modules)
        parts["ln_f"] = count([t.ln_f])
        if not self.config.tie_word_embeddings:
            parts["lm_head"] = count([self.lm_head])
        return parts
