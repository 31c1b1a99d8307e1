"""The building blocks families named the Hugging Face Llama way share (Ouro's and those built the same way;
Raven's blocks use its RMSNorm), the way transformers keeps one file per model but shares its pieces: RMSNorm, Llama's
grouped-query attention with rotate-half RoPE and its gated MLP, its pre-norm block, the latent rules' grids for a
loop that ends in a norm, and `HFLoopedLM`, a looped LM whose tree is `model.embed_tokens`, the family's own
modules under `model`, and a (possibly tied) `lm_head`, with a RoPE table recomputed from its config.

A family module imports from here and from no other family's module: it keeps only what is its own (its config's
loop fields, its layer's norms, its loop structure as `LoopGroup`s). Key names are the published ones, so a
family's `state_dict()` loads a download with no remote code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttnContext, rope_table, rotary_attention
from .looped import LoopedLM, LoopGroup, frozen_layers, on_rows


class RMSNorm(nn.Module):
    """Learned RMSNorm computed in fp32; Huginn casts back to the input dtype *before* the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            xf = x.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return normed.to(x.dtype) * self.weight
        # The same arithmetic in seven ops instead of twenty: a loop step runs five of these, and on a small
        # model each op's dispatch costs more than its arithmetic. mean is sum ÷ n, and a Python scalar (n,
        # eps) is wrapped into a tensor on every call, so both are kept as tensors; the casts above are no-ops
        # here. Bit for bit the branch above (tests/test_engine_ops.py).
        n, eps = self._constants(x)
        return x * x.mul(x).sum(-1, keepdim=True).div_(n).add_(eps).rsqrt_() * self.weight

    def _constants(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.__dict__.get("_consts")
        if got is None or got[0].device != x.device:
            got = (torch.tensor(float(x.shape[-1]), device=x.device), torch.tensor(self.eps, device=x.device))
            self.__dict__["_consts"] = got
        return got


def normed_loop_grids(hidden_size: int) -> dict[str, tuple[float, ...]]:
    """Latent rules' grids for a loop that ends in an RMSNorm: ‖h‖ ≈ sqrt(d) (unit norm weights) after every
    step, so the step-norm grids span 1% … 100% of that; cosine's 1 − cos spans 1e-4 … 0.5."""
    scale = hidden_size ** 0.5
    steps = tuple(float(f"{scale * 10 ** (i / 3 - 2):.3g}") for i in range(7))
    return {"first_order": steps, "second_order": steps, "second_order_magnitude": steps,
            "cosine": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)}


class LlamaAttention(nn.Module):
    """Llama's attention (Qwen2's without biases): q/k/v/o projections, rotate-half RoPE, grouped-query heads
    (attention.rotary_attention: repeated before the cache, so a grouped model's cache is n_heads /
    n_kv_heads times larger than it needs to be)."""

    def __init__(self, c, layer_id: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.layer_id = (c.num_attention_heads, c.num_key_value_heads,
                                                                 c.head_dim, layer_id)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        return self.o_proj(rotary_attention(q, k, v, rope, ctx, self.layer_id, halves=True))


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    """Llama's pre-norm block: h = x + Attn(N_in x); y = h + MLP(N_post h). A family with more norms (Ouro's
    sandwich) subclasses it and overrides `attend` and `feed`."""

    def __init__(self, c, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c, layer_id)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.feed(self.attend(x, rope, ctx))

    # The attention sublayer, then the MLP sublayer: exit mode freeze runs them apart (looped.frozen_layers).
    def attend(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), rope, ctx)

    def feed(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


def llama_stack(c) -> dict[str, nn.Module]:
    """`layers` (num_hidden_layers of Llama's pre-norm block) and the final `norm`: a family_modules for a Llama."""
    return dict(layers=nn.ModuleList(LlamaLayer(c, i) for i in range(c.num_hidden_layers)),
                norm=RMSNorm(c.hidden_size, c.rms_norm_eps))


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class HFLoopedLM(LoopedLM):
    """A looped LM in the Hugging Face layout: `model.embed_tokens`, the family's modules under `model`
    (`family_modules`), `lm_head`, tied when the config says, and a (positions, head_dim/2, 2) cos/sin RoPE table from
    rope_theta over head_dim, recomputed, never stored. A family says its loop as `_build_stages`; one whose loop
    is its whole `model.layers` stack, normed after every pass, uses `_layers_step` and `_frozen_layers_step`."""

    def __init__(self, config):
        super().__init__(config)
        self.build(config, **self.family_modules(config))

    def family_modules(self, config) -> dict[str, nn.Module]:
        """The modules under `model` besides embed_tokens, in the published order (its layers, its norm, ...)."""
        raise NotImplementedError

    def build(self, config, **modules: nn.Module) -> None:
        self.config = c = config
        self.model = nn.ModuleDict(dict(embed_tokens=nn.Embedding(c.vocab_size, c.hidden_size), **modules))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("rope", rope_table(c.head_dim, c.max_position_embeddings, c.rope_theta),
                             persistent=False)
        self._stages = self._build_stages()

    def _build_stages(self) -> list[LoopGroup]:
        raise NotImplementedError

    def reset_buffers(self) -> None:
        c = self.config
        self.rope = rope_table(c.head_dim, c.max_position_embeddings, c.rope_theta).to(self.lm_head.weight.device)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Llama's init: N(0, std) for every matrix and the embedding, unit norms, zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings

    def tie_head(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        return normed_loop_grids(self.config.hidden_size)

    def stages(self) -> list[LoopGroup]:
        return self._stages

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # positions enter through RoPE, in attention

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x).float()  # the loop leaves its state normed

    def layer_split(self) -> dict[str, int]:
        return {"loop": self.config.num_hidden_layers}

    # The names parameter_breakdown reports `model`'s parts under, where they differ from the module's.
    part_names: dict[str, str] = {"embed_tokens": "embedding"}

    def parameter_breakdown(self) -> dict[str, int]:
        parts = {self.part_names.get(name, name): count(module) for name, module in self.model.items()}
        parts.update({name: p.numel() for name, p in self.model.named_parameters(recurse=False)})
        if not self.config.tie_word_embeddings:
            parts["lm_head"] = count(self.lm_head)
        return parts

    # ---- a loop that is the whole layer stack --------------------------------------------------------
    def _loop_norm(self, s: torch.Tensor) -> torch.Tensor:
        return self.model.norm(s)

    def _layers_step(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        for layer in self.model.layers:
            s = layer(s, self.rope, ctx)
        return self._loop_norm(s)

    def _frozen_layers_step(self, s: torch.Tensor, x: torch.Tensor, ctx: AttnContext, keep: torch.Tensor
                            ) -> torch.Tensor:
        out = frozen_layers(self.model.layers, s, s, keep, lambda layer, h: layer.attend(h, self.rope, ctx))
        return on_rows(s, keep, self._loop_norm, out)  # a pinned state is not normed again
