"""A looped LM is a sequence of stages: plain layer stacks and loop groups.

Architectures (Raven, looped GPT-2) build their own module trees, so checkpoint keys stay exactly the
published ones, and describe them to the rest of exitbench as `Stage` / `LoopGroup` views. The exit engine
only ever talks to these views: it needs to see a loop group one iteration at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from .attention import AttnContext, keep_outside_graphs
from .cache import KVCache


def trunc_normal_(t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Truncated normal at ±3σ, drawn with an explicit generator so runs are reproducible."""
    if std == 0:
        return t.zero_()
    with torch.no_grad():
        return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


@dataclass
class Stage:
    """Plain layers run once per token. `attn_layers` are the cache ids of its attention layers."""

    name: str
    run: Callable[[torch.Tensor, AttnContext], torch.Tensor]
    attn_layers: list[int]
    modules: list[nn.Module] = field(default_factory=list)  # what one pass computes, for FLOP counts
    # Cache layers of per-position states its layers keep beside their keys (a short convolution's inputs), with
    # one slot each as its attention layers; not attention, so no FLOPs of their own.
    state_layers: list[int] = field(default_factory=list)


@dataclass
class LoopGroup:
    """A block iterated r times: s_0 = init(x, noise); s_k = step(s_{k-1}, x); output = finish(s_r).

    `x` is the group's input (Raven injects it at every step; GPT-2 groups start from it). When
    `random_init` is set, `noise` is a unit truncated normal shaped like x that the caller draws, so the
    engine can key it to token positions and batching never changes a token's start. Iteration k writes its
    KV entries as iteration k's (the cache maps it to a slot), so the engine can stop a token after any one.
    """

    name: str
    init: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    step: Callable[[torch.Tensor, torch.Tensor, AttnContext], torch.Tensor]
    finish: Callable[[torch.Tensor], torch.Tensor]
    attn_layers: list[int]
    n_layers: int
    default_steps: int
    max_steps: int
    random_init: bool = False
    modules: list[nn.Module] = field(default_factory=list)  # what one iteration computes, for FLOP counts
    compiled: bool = False  # `step` is torch.compile'd (LoopedLM.compile_loops)
    # A trained exit gate (Ouro's): the logit of stopping after an iteration, from the state it left, (n, d) →
    # (n,); it reads no other token. None: the model has none, and a gate rule refuses it.
    gate: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Exit mode freeze: `step` with only the rows `keep` (indices into s's rows flattened to (-1, d)) active;
    # every other row is pinned at its state in s (`frozen_layers`). With every row in `keep` it computes what
    # `step` does, bit for bit. None: the family has no such step, and freeze is refused.
    frozen_step: Callable[[torch.Tensor, torch.Tensor, AttnContext, torch.Tensor], torch.Tensor] | None = None
    # Cache layers of per-position states kept beside the keys, with a slot per iteration as `attn_layers`.
    state_layers: list[int] = field(default_factory=list)
    # Whether `step` reads the group's input x at every iteration (Raven's adapter injects it). Only then can a
    # token start from another token's state (warm_start) and still see its own input; a group that starts from
    # its input and never reads it again would lose the token.
    injects_input: bool = False


def on_rows(base: torch.Tensor, keep: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
            ) -> torch.Tensor:
    """`base` with its rows `keep` (indices into its rows flattened to (-1, d)) replaced by `fn` of those rows of
    `inputs`: work that only some rows need runs on those rows only."""
    if not len(keep):  # (a shape, known on the host: no device read)
        return base
    picked = [t.reshape(-1, t.shape[-1]).index_select(0, keep) for t in inputs]
    return base.reshape(-1, base.shape[-1]).index_copy(0, keep, fn(*picked)).view(base.shape)


def frozen_layers(layers: Sequence[nn.Module], x: torch.Tensor, pinned: torch.Tensor, keep: torch.Tensor,
                  attend: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Exit mode freeze (IBM vLLM-Hook's vLLM executor) through `layers`, each of which splits into its attention
    sublayer (`attend(layer, x)`) and its MLP sublayer with its norms (`layer.feed`). Attention runs on every row,
    so a pinned row writes keys and values computed from its pinned state at every layer and iteration; the MLP
    runs on the rows `keep` only; after each layer every other row is reset to `pinned`."""
    for layer in layers:
        x = on_rows(pinned, keep, layer.feed, attend(layer, x))
    return x


def _compiled_step(step: Callable, sharing: int) -> Callable:
    """`step` compiled for a whole run: a few graphs on the first calls (size-1 axes and the chunk and token
    modes compile apart), then none, whatever the lengths and batches. The attention layers' ids (ints on their
    modules) only name the cache layer the uncompiled attention boundary reads, so they stay symbolic:
    specialised, every layer of a block would be a compilation of its own and a deep block alone would exceed
    dynamo's recompile limit, after which steps silently run eagerly. What still varies is bounded: chunk or
    token mode, size-1 batch or length axes, an argument that is None or not (up to 16 graphs of a frame). Dynamo
    keeps graphs per code object, so groups whose steps are one function (the looped GPT-2's) share a frame:
    the limit is 16 per group sharing it, `sharing`."""
    import torch._dynamo
    import torch.fx.experimental._config as shapes

    keep_outside_graphs()
    compiled = torch.compile(step, dynamic=True)
    limit = max(torch._dynamo.config.recompile_limit, 16) * sharing

    def run(s: torch.Tensor, x: torch.Tensor, ctx: AttnContext, *keep: torch.Tensor) -> torch.Tensor:
        # No duck sizing either: two axes that happen to be equal once (rows = positions) are not a rule.
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=limit), \
                shapes.patch(use_duck_shape=False):
            return compiled(s, x, ctx, *keep)
    return run


def unit_trunc_normal(shape: Sequence[int], generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    t = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    return trunc_normal_(t, 1.0, generator).to(dtype)


class LoopedLM(nn.Module):
    """Base class: a family names its `config_class` (its architecture is that class's model_type) and implements
    `embed`, `stages`, `head` and `cache_geometry`."""

    architecture: str = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "config_class" in cls.__dict__:  # a family's name is its config's model_type
            cls.architecture = cls.config_class.model_type

    def __init__(self, config=None):
        super().__init__()
        if config is not None:
            self.config = config

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings of ids (B, T) at positions start…, or of one token per row (B, 1) at `positions`."""
        raise NotImplementedError

    def stages(self) -> list[Stage | LoopGroup]:
        raise NotImplementedError

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy copies a stage's lambdas by reference, so they would still run the original's layers:
        # a float64 copy would run the float32 weights. The copy builds its own stages over its own layers.
        super().__setstate__(state)
        if "_stages" in state:
            self._stages = self._build_stages()

    # Both architectures end in `transformer.ln_f` and a (possibly tied) `lm_head`, and their configs name
    # `n_heads` and `head_dim`; an architecture that differs overrides these.
    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x)).float()

    def head_modules(self) -> list[nn.Module]:
        """What `head` computes, for FLOP counts."""
        return [self.lm_head]

    @property
    def output_size(self) -> int:
        """Width of the logits `head` returns."""
        return self.lm_head.out_features

    def cache_geometry(self) -> tuple[int, int]:
        """(heads, head_dim) of every attention layer's cached keys: the key/value heads, fewer than the query
        heads under grouped-query attention."""
        return getattr(self.config, "num_key_value_heads", None) or self.config.n_heads, self.config.head_dim

    @property
    def attention_width(self) -> int:
        """Query heads × head_dim: what each attended key costs in scores and weighted values (FLOP counts)."""
        return self.config.n_heads * self.config.head_dim

    def layer_split(self) -> dict[str, int]:
        """Layers per stage, for reports."""
        raise NotImplementedError

    def parameter_breakdown(self) -> dict[str, int]:
        """Parameters per part of the module tree, for reports."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers after the model was built on the meta device."""

    @property
    def tied_head(self) -> bool:
        """Whether lm_head shares its weight with the token embedding `transformer.wte`."""
        return False

    def exit_grids(self) -> dict[str, tuple[float, ...]]:
        """Default threshold grids of rules whose useful thresholds depend on the model (its scale, how far its
        steps contract), by policy name; a rule not named here sweeps its own `default_grid`."""
        return {}

    def float32_keys(self) -> set[str]:
        """Checkpoint keys loaded in float32 whatever the run's dtype (the reference pins them: routers, small
        convolutions, depth queries); empty for most families."""
        return set()

    @property
    def prefix_lm(self) -> bool:
        """Whether the model was trained as a prefix-LM: a prompt is one bidirectional block, so the engine prefills
        it as one (AttnContext.prefix)."""
        return False

    @property
    def gated(self) -> bool:
        """Whether a loop group has a trained exit gate (the gate rules can run)."""
        return any(g.gate is not None for g in self.loop_groups())

    def tie_head(self) -> None:
        """Make lm_head share the token embedding's weight (after a load assigned both)."""
        self.lm_head.weight = self.transformer.wte.weight

    def cache_layout_problem(self, window: int | None, private: int) -> str | None:
        """Why a run whose loop layers' slots are laid out as (window, private) (ExitConfig.cache_layout) cannot run
        this checkpoint as it was made to run, or None; a checkpoint whose loops share one KV slot says so here."""
        return None

    def describe_variant(self) -> dict | None:
        """For an architecture whose checkpoints come in several block layouts: which one this is and what
        told it (`info`); None for one with a single layout."""
        return None

    def shape_hint(self) -> str:
        """What a shape-mismatch error adds: the config values the expected shapes were computed from."""
        return ""

    @classmethod
    def read_config(cls, raw: dict, keys: set[str], where: str):
        """This architecture's config from config.json (`raw`), given the keys the checkpoint's files hold
        (an architecture whose files, not its config, say which blocks it has reads them)."""
        return cls.config_class.from_dict(raw)

    @classmethod
    def adapt_checkpoint(cls, tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Map a checkpoint's tensors as published onto this module tree's keys (default: as they are)."""
        return tensors

    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """Tensors the checkpoint format stores beyond `state_dict()`."""
        return {}

    def compile_loops(self) -> None:
        """Replace each loop group's `step` by its torch.compile'd version: the code every token runs r times.

        dynamic=True: the engine's tick holds however many tokens are in flight, at whatever positions, so
        shapes change every call; specialising on them would recompile nearly every tick. Everything that
        runs a step (the engine's loops, the prefill walk) picks it up, since they call `group.step`.
        """
        groups = self.loop_groups()
        for group in groups:
            if not group.compiled:
                group.step = _compiled_step(group.step, len(groups))
                if group.frozen_step is not None:
                    group.frozen_step = _compiled_step(group.frozen_step, len(groups))
                group.compiled = True

    @property
    def compiled(self) -> bool:
        return any(g.compiled for g in self.loop_groups())

    # ---- derived -------------------------------------------------------------------------------
    def loop_groups(self) -> list[LoopGroup]:
        return [s for s in self.stages() if isinstance(s, LoopGroup)]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def num_parameters(self) -> int:
        """Unique parameters: a tied head counts once, buffers not at all."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def cache_slots(self, max_steps: Sequence[int] | None = None, window: int | None = None,
                    private: int = 0) -> dict[int, int]:
        """Cache slots per attention layer: one per loop iteration up to each group's `max_steps` (or the given
        ones) for a loop group's layers, at most `private + window` of them (a rolling buffer after `private`
        slots of their own, models/cache.py), and one for a plain layer's."""
        groups = self.loop_groups()
        steps = list(max_steps) if max_steps is not None else [g.max_steps for g in groups]
        depth = {id(group): min(n, private + window) if window else n for group, n in zip(groups, steps)}
        slots: dict[int, int] = {}
        for stage in self.stages():
            n = depth.get(id(stage), 1)
            slots.update({layer: max(n, 1) for layer in [*stage.attn_layers, *stage.state_layers]})
        return slots

    def new_cache(self, batch: int, capacity: int, max_steps: Sequence[int] | None = None,
                  window: int | None = None, private: int = 0) -> KVCache:
        """A cache with cache_slots(max_steps, window, private) slots per layer, for `batch` rows of `capacity`
        positions."""
        n_heads, head_dim = self.cache_geometry()
        return KVCache(batch, n_heads, head_dim, self.cache_slots(max_steps, window, private), capacity, self.dtype,
                       self.device, window, self.state_geometry(), private)

    def state_geometry(self) -> dict[int, tuple[int, int]]:
        """Cache layers that hold per-position states rather than attention keys (a stage's `state_layers`), by
        id, with their (heads, width); none for most families."""
        return {}

    def resolve_steps(self, num_steps: int | Sequence[int] | None) -> list[int]:
        groups = self.loop_groups()
        if num_steps is None:
            return [g.default_steps for g in groups]
        if isinstance(num_steps, int):
            return [num_steps] * len(groups)
        if len(num_steps) != len(groups):
            raise ValueError(f"num_steps has {len(num_steps)} entries but the model has {len(groups)} loop groups")
        return list(num_steps)

    def _check_cache_depth(self, cache: KVCache, steps: list[int]) -> None:
        if cache.window:  # a rolling buffer takes any depth
            return
        for group, r in zip(self.loop_groups(), steps):
            slots = cache.slots[group.attn_layers[0]] if group.attn_layers else r
            if r > slots:
                raise ValueError(f"{r} iterations of {group.name} need {r} cache slots; this cache has {slots} "
                                 "(build it with model.new_cache(..., max_steps=…))")

    # ---- the stage walk: the one place that runs stages in order ------------------------------------
    def walk(self, x: torch.Tensor, ctx: AttnContext, depths: Sequence[int] | None = None, *, start: int = 0,
             stop: int | None = None, noise: Callable[[LoopGroup, torch.Tensor], torch.Tensor | None] | None = None,
             on_state: Callable[[int, int, torch.Tensor], None] | None = None,
             grad_steps: Sequence[int] | None = None) -> torch.Tensor:
        """Run stages[start:stop] on x: a plain stage once; loop group g as init → step × depths[g] → finish.

        `noise(group, x)` draws a group's initial-state noise (default: none, a zero or input state);
        `on_state(g, k, s_k)` sees every iterate, s_0 included; with `grad_steps`, only the last
        grad_steps[g] iterations of group g keep gradients (truncated BPTT, Huginn §1.6). Everything that
        runs a model at a known depth goes through here: forward, iterates, readout, the engine's prefill
        and the stretches between its loop groups.
        """
        groups = self.loop_groups()
        index = {id(group): g for g, group in enumerate(groups)}
        depths = list(depths) if depths is not None else [group.default_steps for group in groups]
        for stage in self.stages()[start:stop]:
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
                continue
            g = index[id(stage)]
            s = stage.init(x, noise(stage, x) if noise is not None else None)
            if on_state is not None:
                on_state(g, 0, s)
            no_grad = depths[g] - grad_steps[g] if grad_steps is not None else 0
            for i in range(depths[g]):
                with torch.set_grad_enabled(torch.is_grad_enabled() and i >= no_grad):
                    s = stage.step(s, x, ctx.at_iteration(i))
                if on_state is not None:
                    on_state(g, i + 1, s)
            x = stage.finish(s)
        return x

    def generator_noise(self, generator: torch.Generator | None) -> Callable[[LoopGroup, torch.Tensor], torch.Tensor | None]:
        """Initial-state noise drawn from `generator` in call order (training and the plain forward)."""
        def draw(group: LoopGroup, x: torch.Tensor) -> torch.Tensor | None:
            return unit_trunc_normal(x.shape, generator, x.dtype, x.device) if group.random_init else None
        return draw

    def forward(self, ids: torch.Tensor, num_steps: int | Sequence[int] | None = None, *,
                backprop_depth: int | Sequence[int] | None = None, cache: KVCache | None = None, start: int = 0,
                generator: torch.Generator | None = None, prefix: torch.Tensor | int | None = None) -> torch.Tensor:
        """Logits for `ids` (B, T) at fixed depth: every token runs `num_steps` iterations of every group.

        With `backprop_depth` k (one for all groups, or one per group) only the last k iterations of each group
        keep gradients (truncated BPTT, Huginn §1.6). With a cache, `ids` continue a sequence whose first `start`
        tokens are cached. With `prefix` (one length, or one per row) the leading positions form a bidirectional
        block (a prefix-LM's prompt, `prefix_lm`); the rest is causal.
        """
        steps = self.resolve_steps(num_steps)
        if cache is not None:
            self._check_cache_depth(cache, steps)
        grad = self.resolve_steps(backprop_depth) if backprop_depth is not None else None
        x = self.walk(self.embed(ids, start), AttnContext(start=start, cache=cache, prefix=prefix), steps,
                      noise=self.generator_noise(generator), grad_steps=grad)
        return self.head(x)

    @torch.no_grad()
    def iterates(self, ids: torch.Tensor, steps: int, generator: torch.Generator | None = None
                 ) -> list[torch.Tensor]:
        """Every loop group at `steps` iterations, keeping each iterate: one (steps + 1, B, T, d) tensor of
        s_0 … s_steps per group (what the depth report and the geometry measure)."""
        kept: dict[int, list[torch.Tensor]] = {}
        self.walk(self.embed(ids), AttnContext(), [steps] * len(self.loop_groups()),
                  noise=self.generator_noise(generator), on_state=lambda g, k, s: kept.setdefault(g, []).append(s))
        return [torch.stack(kept[g]) for g in sorted(kept)]

    def _after(self, group_index: int) -> int:
        """The index among the stages of the stage after loop group `group_index`."""
        group = self.loop_groups()[group_index]
        return next(i for i, stage in enumerate(self.stages()) if stage is group) + 1

    def readout_attention(self, group_index: int) -> list[int]:
        """The attention layers `readout(group_index, …)` runs: every stage's after that loop group (a coda, later
        loop groups); empty where the readout reads no other token."""
        return [layer for stage in self.stages()[self._after(group_index):]
                for layer in [*stage.attn_layers, *stage.state_layers]]

    def readout(self, group_index: int, state: torch.Tensor, ctx: AttnContext,
                steps: Sequence[int] | None = None) -> torch.Tensor:
        """Logits "if we exited now": finish group `group_index` from `state`, run the rest at default depth
        (or at `steps`, one per loop group, e.g. when a cache holds fewer iterations than the default).
        A later loop group starts from its input (its noise, if any, is left out: a readout is a probe)."""
        group = self.loop_groups()[group_index]
        return self.head(self.walk(group.finish(state), ctx, steps, start=self._after(group_index)))
