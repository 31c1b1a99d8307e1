"""Dory (NVIDIA Nemotron-Labs Dory1.0; arXiv 2611.03998), a normalised (nGPT) transformer with a looped middle,
written from vLLM's own `dory.py` and its published checkpoint's layout (nvidia/NVIDIA-Nemotron-Labs-Dory1.0-4B-BF16)
with no remote code.

    h = input_sublayers(embeddings(ids))                        n_input_layers, once
    state = h
    for each loop (n_recurrent_loops, 1 … 4):
        state = justnorm(recurrent_sublayers(justnorm(state + h)))
    logits = lm_head(output_sublayers(state)) · logit_scale / initializer_range      untied, no final norm

One config "layer" is one sublayer, attention or a SwiGLU MLP (`layer_types`: sliding_attention, full_attention,
mlp), each with an nGPT residual justnorm(â + |α · ngpt_alpha_init / initializer_range| · (b̂ − â)), â and b̂ the
unit-normed input and sublayer output, justnorm(x) = x / sqrt(Σx² + 1e-6) in float32. Attention: grouped-query,
rotate-half RoPE over the first `partial_rotary_factor` of each head, then per head q ← (sqk·√head_dim/std)² ⊙
q̂ and k ← k̂, scores over √head_dim; its output gated by σ(g_proj(x) · (s_gate·√g0/std)²) and normed over
all heads before o_proj. A sliding layer's query at i sees keys j with i − j < sliding_window. MLP: silu(gate ·
suv_gate·√hidden) · (up · suv_up·√hidden), normed, then down. Every state is unit-norm, so ‖Δ‖ is relative
already: the latent rules' grids are their own here.

A token may stop after any loop: the output block reads any loop's state as it reads the last. KV: per_loop (the
default) keeps one cache per loop, as the engine's one slot per iteration does; last_loop keeps one per recurrent
layer, overwritten by every loop, which is the engine's KV window 1 (`--kv-layout single`), and a run must ask
for it (`cache_layout_problem`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from . import attention
from .attention import AttnContext, apply_rope, rope_table
from .hf_config import HFNamedConfig, refuse_set
from .looped import LoopedLM, LoopGroup, Stage

SLIDING, FULL, MLP = "sliding_attention", "full_attention", "mlp"
KV_MODES = ("per_loop", "last_loop")
# The most loops Dory runs: its paper and cards use 1 to 4, and llama.cpp refuses more.
MAX_LOOPS = 4
EPS = 1e-6


@dataclass
class DoryConfig(HFNamedConfig):
    hidden_size: int = 2560
    intermediate_size: int = 7168
    num_attention_heads: int = 16
    num_hidden_layers: int = 72  # sublayers
    vocab_size: int = 131072
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    rope_theta: float = 10_000.0  # what an attention kind's rope_parameters entry without rope_theta takes
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    sliding_window: int | None = 1024
    rope_parameters: dict | None = None
    layer_types: list[str] | None = None
    ngpt_alpha_init: float = 0.05
    attention_output_gate_logit_scale_init: float | None = None
    mlp_bias: bool = False
    attention_bias: bool = False
    n_input_layers: int = 0
    n_recurrent_layers: int | None = None
    n_output_layers: int = 0
    n_recurrent_loops: int = 1
    recurrent_kv_cache_mode: str = "per_loop"
    # exitbench's own: the most loops a run may ask for, MAX_LOOPS unless the file says fewer.
    max_loops: int | None = None

    model_type = "dory"
    family = "Dory"
    hf_class = "DoryForCausalLM"
    loop_positive = ("n_recurrent_loops", "max_loops", "n_recurrent_layers")
    depth_field, max_depth_field = "n_recurrent_loops", "max_loops"

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None and isinstance(n, int):  # vLLM's default, the cards' "S-S-S-*-"
            self.layer_types = [MLP if i % 2 else FULL if i % 8 == 6 else SLIDING for i in range(n)]
        if self.rope_parameters is None and isinstance(self.layer_types, list):
            self.rope_parameters = {kind: {"rope_type": "default", "partial_rotary_factor": 1.0}
                                    for kind in (SLIDING, FULL) if kind in self.layer_types}
        ends = (n, self.n_input_layers, self.n_output_layers)
        if self.n_recurrent_layers is None and all(isinstance(v, int) for v in ends):
            self.n_recurrent_layers = n - self.n_input_layers - self.n_output_layers
        super().__post_init__()

    def fill_depth(self) -> None:
        if self.max_loops is None:
            self.max_loops = MAX_LOOPS

    def validate(self) -> None:
        for name in ("n_recurrent_loops", "max_loops"):  # before the common depth checks: this is the rule to say
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOOPS:
                raise CheckpointError(f"config {name}={value}: Dory runs 1 to {MAX_LOOPS} loops (its paper and "
                                      f"llama.cpp stop at {MAX_LOOPS}); give at most {MAX_LOOPS}")
        super().validate()
        kinds = self.layer_types
        if not isinstance(kinds, list) or len(kinds) != self.num_hidden_layers or set(kinds) - {SLIDING, FULL, MLP}:
            raise CheckpointError(f"config layer_types must name each of the num_hidden_layers="
                                  f"{self.num_hidden_layers} sublayers {SLIDING!r}, {FULL!r} or {MLP!r}, got "
                                  f"{kinds!r}")
        parts = (self.n_input_layers, self.n_recurrent_layers, self.n_output_layers)
        if any(not isinstance(p, int) or p < 0 for p in parts) or sum(parts) != self.num_hidden_layers:
            raise CheckpointError(f"config n_input_layers + n_recurrent_layers + n_output_layers = "
                                  f"{' + '.join(map(str, parts))} must be num_hidden_layers={self.num_hidden_layers}, "
                                  "each ≥ 0")
        if self.recurrent_kv_cache_mode not in KV_MODES:
            raise CheckpointError(f"config recurrent_kv_cache_mode={self.recurrent_kv_cache_mode!r}: use "
                                  f"{' or '.join(KV_MODES)}")
        if SLIDING in kinds and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise CheckpointError(f"config sliding_window={self.sliding_window!r}: sliding_attention layers need a "
                                  "window of at least 1 key")
        for name in ("initializer_range", "ngpt_alpha_init"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CheckpointError(f"config {name} must be a finite number > 0 (it divides Dory's learned "
                                      f"scales), got {value!r}")
        self._validate_rope(kinds)

    def _validate_rope(self, kinds: list[str]) -> None:
        rope = self.rope_parameters
        wanted = set(kinds) - {MLP}
        if not isinstance(rope, dict) or set(rope) - {SLIDING, FULL} or wanted - set(rope):
            raise CheckpointError(f"config rope_parameters must give an entry for each attention kind in layer_types "
                                  f"({', '.join(sorted(wanted))}) and no other, got {rope!r}")
        for kind, entry in rope.items():
            kind_type = entry.get("rope_type", entry.get("type")) if isinstance(entry, dict) else None
            if kind_type != "default":
                raise CheckpointError(f"config rope_parameters[{kind!r}]={entry!r}: Dory uses plain RoPE "
                                      "(rope_type default); no other is implemented")
            theta, fraction = self.rope_of(kind)
            if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
                raise CheckpointError(f"config rope_parameters[{kind!r}] rope_theta must be a finite number > 0, "
                                      f"got {theta!r}")
            dims = self.head_dim * fraction if isinstance(fraction, (int, float)) else 0
            if not (0 < dims <= self.head_dim and int(dims) % 2 == 0 and int(dims) > 0):
                raise CheckpointError(f"config rope_parameters[{kind!r}] partial_rotary_factor={fraction!r} gives "
                                      f"{dims} rotary dimensions of head_dim={self.head_dim}: they must be even and "
                                      "> 0")

    def rope_of(self, kind: str) -> tuple[float, float]:
        """(θ, partial_rotary_factor) of an attention kind."""
        entry = self.rope_parameters[kind]
        return entry.get("rope_theta", self.rope_theta), entry.get("partial_rotary_factor", 1.0)

    def rotary_dim(self, kind: str) -> int:
        return int(self.head_dim * self.rope_of(kind)[1])

    @classmethod
    def refuse(cls, raw: dict[str, Any]) -> None:
        refuse_set(raw, ("attention_bias", "mlp_bias"), "Dory's projections are bias-free (vLLM refuses biases)")
        refuse_set(raw, ("tie_word_embeddings",), "Dory's embedding and lm_head are separate matrices")
        quantized = raw.get("quantization_config")
        if quantized:
            # vLLM's loader for the -NVFP4 release takes ModelOpt's parts (packed columns, per-block and per-tensor
            # scales); exitbench's NVFP4 reader knows Inkling 2's part names, not those
            method = quantized.get("quant_algo") or quantized.get("quant_method") if isinstance(quantized, dict) \
                else quantized
            raise CheckpointError(f"config quantization_config ({method}): exitbench reads Dory's BF16 release; its "
                                  "NVFP4 parts (ModelOpt's weight_scale / weight_scale_2) are not a format it reads")


def justnorm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last axis, in float32, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + EPS)).to(x.dtype)


def ngpt_residual(a: torch.Tensor, b: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """justnorm(â + rate · (b̂ − â)): a step from the normed input towards the normed output, renormed."""
    ya, yb = justnorm(a).float(), justnorm(b).float()
    return justnorm(ya + rate * (yb - ya)).to(a.dtype)


def partial_rope(x: torch.Tensor, table: torch.Tensor, ctx: AttnContext, dims: int) -> torch.Tensor:
    """Rotate-half RoPE over the first `dims` coordinates of each head of x (B, T, H, D), the rest as they are."""
    rotation = ctx.rotation(table, True) if ctx.positions is not None else None
    if dims == x.shape[-1]:
        return apply_rope(x, table, ctx.start, rotation, halves=True)
    return torch.cat([apply_rope(x[..., :dims], table, ctx.start, rotation, halves=True), x[..., dims:]], dim=-1)


class DoryAttention(nn.Module):
    def __init__(self, c: DoryConfig, kind: str, cache_id: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.cache_id = (c.num_attention_heads, c.num_key_value_heads,
                                                                 c.head_dim, cache_id)
        self.kind, self.rotary_dim = kind, c.rotary_dim(kind)
        self.window = c.sliding_window if kind == SLIDING else None
        width, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=False)
        self.g_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, c.hidden_size, bias=False)
        self.sqk = nn.Parameter(torch.empty(width))
        self.s_gate = nn.Parameter(torch.empty(width))
        std = c.initializer_range
        g0 = c.attention_output_gate_logit_scale_init or c.hidden_size ** 0.5
        self.sqk_factor, self.gate_factor = c.head_dim ** 0.5 / std, g0 ** 0.5 / std

    def forward(self, x: torch.Tensor, rope: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x.shape
        q = partial_rope(self.q_proj(x).view(B, T, self.n_heads, -1), rope, ctx, self.rotary_dim)
        k = partial_rope(self.k_proj(x).view(B, T, self.n_kv, -1), rope, ctx, self.rotary_dim)
        scale = (self.sqk.float() * self.sqk_factor).square().view(self.n_heads, self.head_dim)
        q = (scale * justnorm(q).float()).to(x.dtype).transpose(1, 2)
        k, v = justnorm(k).transpose(1, 2), self.v_proj(x).view(B, T, self.n_kv, -1).transpose(1, 2)
        if self.window is None:
            out = attention.cached_causal_attention(q, k, v, ctx, self.cache_id)
        else:
            out = attention.sliding_window_attention(q, k, v, ctx, self.cache_id, self.window)
        out = out.transpose(1, 2).reshape(B, T, -1)
        gate = torch.sigmoid(self.g_proj(x).float() * (self.s_gate.float() * self.gate_factor).square())
        return self.o_proj(justnorm((out.float() * gate).to(x.dtype)))


class DoryMLP(nn.Module):
    def __init__(self, c: DoryConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.suv_gate = nn.Parameter(torch.empty(c.intermediate_size))
        self.suv_up = nn.Parameter(torch.empty(c.intermediate_size))
        self.suv_factor = c.hidden_size ** 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = (self.gate_proj(x).float() * (self.suv_gate.float() * self.suv_factor)).to(x.dtype)
        u = (self.up_proj(x).float() * (self.suv_up.float() * self.suv_factor)).to(x.dtype)
        return self.down_proj(justnorm((F.silu(g.float()) * u.float()).to(x.dtype)))


class DoryLayer(nn.Module):
    """One sublayer, attention or MLP, and its nGPT residual (`attn_alpha` or `mlp_alpha`, as the file names it)."""

    def __init__(self, c: DoryConfig, kind: str, cache_id: int | None):
        super().__init__()
        self.attention = kind != MLP
        self.mixer = DoryAttention(c, kind, cache_id) if self.attention else DoryMLP(c)
        alpha = nn.Parameter(torch.empty(c.hidden_size))
        self.register_parameter("attn_alpha" if self.attention else "mlp_alpha", alpha)
        self.alpha_scale = c.ngpt_alpha_init / c.initializer_range

    @property
    def alpha(self) -> nn.Parameter:
        return self.attn_alpha if self.attention else self.mlp_alpha

    def forward(self, x: torch.Tensor, ropes: dict[str, torch.Tensor], ctx: AttnContext) -> torch.Tensor:
        out = self.mixer(x, ropes[self.mixer.kind], ctx) if self.attention else self.mixer(x)
        return ngpt_residual(x, out, (self.alpha.float() * self.alpha_scale).abs())


class DoryHead(nn.Module):
    """`lm_head`: the output embedding and its per-word `logit_scale`."""

    def __init__(self, c: DoryConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.logit_scale = nn.Parameter(torch.empty(c.vocab_size))


class Dory(LoopedLM):
    config_class = DoryConfig

    def __init__(self, config: DoryConfig):
        super().__init__(config)
        c = config
        attending = [i for i, kind in enumerate(c.layer_types) if kind != MLP]
        self.backbone = nn.Module()
        ends = [0, c.n_input_layers, c.n_input_layers + c.n_recurrent_layers, c.num_hidden_layers]
        self._parts = {part: range(ends[i], ends[i + 1]) for i, part in enumerate(("input", "recurrent", "output"))}
        self.backbone.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        # Attention sublayers take cache layers 0, 1, … in order; an MLP sublayer keeps no cache.
        self.backbone.layers = nn.ModuleList(
            DoryLayer(c, kind, attending.index(i) if kind != MLP else None) for i, kind in enumerate(c.layer_types))
        self.lm_head = DoryHead(c)
        for kind, table in self._rope_tables().items():  # one table per attention kind: θ and width may differ
            self.register_buffer(f"rope_{kind}", table, persistent=False)
        self._stages = self._build_stages()

    def _rope_tables(self) -> dict[str, torch.Tensor]:
        c = self.config
        return {kind: rope_table(c.rotary_dim(kind), c.max_position_embeddings, c.rope_of(kind)[0])
                for kind in c.rope_parameters}

    def reset_buffers(self) -> None:
        device = self.backbone.embeddings.weight.device
        for kind, table in self._rope_tables().items():
            setattr(self, f"rope_{kind}", table.to(device))

    @property
    def ropes(self) -> dict[str, torch.Tensor]:
        return {kind: getattr(self, f"rope_{kind}") for kind in self.config.rope_parameters}

    # ---- the stage view the engine uses ----------------------------------------------------------
    def _part(self, part: str) -> range:
        return self._parts[part]

    def _run(self, part: str, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        ropes = self.ropes
        for i in self._part(part):
            x = self.backbone.layers[i](x, ropes, ctx)
        return x

    def _loop(self, state: torch.Tensor, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return justnorm(self._run("recurrent", justnorm(state + x), ctx))

    def _cache_ids(self, part: str) -> list[int]:
        layers = self.backbone.layers
        return [layers[i].mixer.cache_id for i in self._part(part) if layers[i].attention]

    def _build_stages(self) -> list[Stage | LoopGroup]:
        c, layers = self.config, self.backbone.layers
        modules = lambda part: [layers[i] for i in self._part(part)]  # noqa: E731
        stages: list[Stage | LoopGroup] = []
        if c.n_input_layers:
            stages.append(Stage("input", lambda x, ctx: self._run("input", x, ctx.at_iteration(0)),
                                self._cache_ids("input"), modules=modules("input")))
        stages.append(LoopGroup("recurrent", init=lambda x, noise: x, step=self._loop, finish=lambda s: s,
                                attn_layers=self._cache_ids("recurrent"), n_layers=c.n_recurrent_layers,
                                default_steps=c.n_recurrent_loops, max_steps=c.max_loops,
                                modules=modules("recurrent"), injects_input=True))
        if c.n_output_layers:
            stages.append(Stage("output", lambda x, ctx: self._run("output", x, ctx.at_iteration(0)),
                                self._cache_ids("output"), modules=modules("output")))
        return stages

    def stages(self) -> list[Stage | LoopGroup]:
        return self._stages

    def cache_layout_problem(self, window: int | None, private: int) -> str | None:
        if self.config.recurrent_kv_cache_mode == "last_loop" and (window, private) != (1, 0):
            return ("this Dory checkpoint says recurrent_kv_cache_mode last_loop: one KV slot per recurrent layer, "
                    "shared by every loop; run it with --kv-layout single (or set per_loop in its config.json)")
        return None

    def new_cache(self, batch: int, capacity: int, max_steps=None, window: int | None = None, private: int = 0):
        if self.config.recurrent_kv_cache_mode == "last_loop":  # whoever builds the cache, the checkpoint's KV mode
            window, private = 1, 0
        return super().new_cache(batch, capacity, max_steps, window, private)

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.backbone.embeddings(ids)  # positions enter through RoPE, in attention

    def head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        return F.linear(x, head.weight).float() * (head.logit_scale.float() / self.config.initializer_range)

    def head_modules(self) -> list[nn.Module]:
        return [self.lm_head]

    @property
    def output_size(self) -> int:
        return self.config.vocab_size

    @property
    def attention_width(self) -> int:
        return self.config.num_attention_heads * self.config.head_dim

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        """The state is unit-norm, so a step is at most 2 and relative already: step grids span 1e-3 … 1."""
        steps = tuple(float(f"{10 ** (i / 3 - 3):.3g}") for i in range(10))
        return {"first_order": steps, "second_order": steps, "second_order_magnitude": steps,
                "cosine": (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)}

    def layer_split(self) -> dict[str, int]:
        c = self.config
        return {"input": c.n_input_layers, "recurrent": c.n_recurrent_layers, "output": c.n_output_layers}

    def parameter_breakdown(self) -> dict[str, int]:
        count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
        layers = self.backbone.layers
        return {"embedding": self.backbone.embeddings.weight.numel(),
                **{part: count(layers[i] for i in self._part(part)) for part in ("input", "recurrent", "output")},
                "lm_head": count([self.lm_head])}

    def shape_hint(self) -> str:
        c = self.config
        return (f" (config: hidden_size={c.hidden_size}, intermediate_size={c.intermediate_size}, heads "
                f"{c.num_attention_heads}/{c.num_key_value_heads} of {c.head_dim}, vocab_size={c.vocab_size})")

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Matrices N(0, std), the embeddings' rows about unit-norm (as nGPT keeps them); the learned scales near
        the values nGPT starts them at, each drawn ±25% so a parity test sees it: α about 4 × initializer_range
        (residual rates near 0.2), sqk and s_gate about initializer_range, suv about 1/√hidden, logit_scale about
        20 × initializer_range (logits of a few units from unit rows)."""
        c = self.config
        near = {"alpha": 4 * c.initializer_range, "sqk": c.initializer_range, "s_gate": c.initializer_range,
                "suv_gate": c.hidden_size ** -0.5, "suv_up": c.hidden_size ** -0.5,
                "logit_scale": 20 * c.initializer_range}
        with torch.no_grad():
            for name, p in self.named_parameters():
                centre = next((v for k, v in near.items() if name.endswith(k)), None)
                if name in ("backbone.embeddings.weight", "lm_head.weight"):
                    p.normal_(0.0, c.hidden_size ** -0.5, generator=generator)
                elif centre is None:
                    p.normal_(0.0, std, generator=generator)
                else:
                    p.copy_(centre * (1 + 0.25 * torch.randn(p.shape, generator=generator)))
