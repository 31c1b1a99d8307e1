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

from .cache import KVCache
from .layers import AttnContext, trunc_normal_


@dataclass
class Stage:
    """Plain layers run once per token. `attn_layers` are the cache ids of its attention layers."""

    name: str
    run: Callable[[torch.Tensor, AttnContext], torch.Tensor]
    attn_layers: list[int]
    modules: list[nn.Module] = field(default_factory=list)  # what one pass computes, for FLOP counts


@dataclass
class LoopGroup:
    """A block iterated r times: s_0 = init(x, noise); s_k = step(s_{k-1}, x); output = finish(s_r).

    `x` is the group's input (Raven injects it at every step; GPT-2 groups start from it). When
    `random_init` is set, `noise` is a unit truncated normal shaped like x that the caller draws, so the
    engine can key it to token positions and batching never changes a token's start. Each iteration
    writes its KV entries in cache slot k, so the engine can stop a token after any iteration.
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


def unit_trunc_normal(shape: Sequence[int], generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    t = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    return trunc_normal_(t, 1.0, generator).to(dtype)


class LoopedLM(nn.Module):
    """Base class: subclasses set `config`, implement `embed`, `stages`, `head` and `cache_geometry`."""

    architecture: str = ""

    def embed(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def stages(self) -> list[Stage | LoopGroup]:
        raise NotImplementedError

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
        """(n_heads, head_dim) of every attention layer."""
        return self.config.n_heads, self.config.head_dim

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

    @classmethod
    def adapt_checkpoint(cls, tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Map a checkpoint's tensors as published onto this module tree's keys (default: as they are)."""
        return tensors

    def checkpoint_extras(self) -> dict[str, torch.Tensor]:
        """Tensors the checkpoint format stores beyond `state_dict()`."""
        return {}

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

    def new_cache(self, batch: int, capacity: int, max_steps: Sequence[int] | None = None) -> KVCache:
        """A cache with one slot per loop iteration up to each group's `max_steps` (or the given ones)."""
        groups = self.loop_groups()
        steps = list(max_steps) if max_steps is not None else [g.max_steps for g in groups]
        slots: dict[int, int] = {}
        for stage in self.stages():
            n = steps[groups.index(stage)] if isinstance(stage, LoopGroup) else 1
            slots.update({layer: max(n, 1) for layer in stage.attn_layers})
        n_heads, head_dim = self.cache_geometry()
        return KVCache(batch, n_heads, head_dim, slots, capacity, self.dtype, self.device)

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
        for group, r in zip(self.loop_groups(), steps):
            slots = cache.slots[group.attn_layers[0]] if group.attn_layers else r
            if r > slots:
                raise ValueError(f"{r} iterations of {group.name} need {r} cache slots; this cache has {slots} "
                                 "(build it with model.new_cache(..., max_steps=…))")

    def forward(self, ids: torch.Tensor, num_steps: int | Sequence[int] | None = None, *,
                backprop_depth: int | Sequence[int] | None = None, cache: KVCache | None = None, start: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits for `ids` (B, T) at fixed depth: every token runs `num_steps` iterations of every group.

        With `backprop_depth` k (one for all groups, or one per group) only the last k iterations of each group
        keep gradients (truncated BPTT, Huginn §1.6). With a cache, `ids` continue a sequence whose first `start`
        tokens are cached.
        """
        steps = self.resolve_steps(num_steps)
        depths = self.resolve_steps(backprop_depth) if backprop_depth is not None else None
        if cache is not None:
            self._check_cache_depth(cache, steps)
        ctx = AttnContext(start=start, cache=cache)
        x = self.embed(ids, start)
        g = 0
        for stage in self.stages():
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
                continue
            r = steps[g]
            no_grad_steps = r - depths[g] if depths is not None else 0
            g += 1
            s = stage.init(x, self._noise(stage, x, generator))
            for i in range(r):
                with torch.set_grad_enabled(torch.is_grad_enabled() and i >= no_grad_steps):
                    s = stage.step(s, x, ctx.at_slot(i))
            x = stage.finish(s)
        return self.head(x)

    @torch.no_grad()
    def iterates(self, ids: torch.Tensor, steps: int, generator: torch.Generator | None = None
                 ) -> list[torch.Tensor]:
        """Every loop group at `steps` iterations, keeping each iterate: one (steps + 1, B, T, d) tensor of
        s_0 … s_steps per group (what the depth report and the geometry measure)."""
        ctx = AttnContext()
        x = self.embed(ids)
        out = []
        for stage in self.stages():
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
                continue
            s = stage.init(x, self._noise(stage, x, generator))
            states = [s]
            for i in range(steps):
                s = stage.step(s, x, ctx.at_slot(i))
                states.append(s)
            out.append(torch.stack(states))
            x = stage.finish(s)
        return out

    def readout(self, group_index: int, state: torch.Tensor, ctx: AttnContext,
                steps: Sequence[int] | None = None) -> torch.Tensor:
        """Logits "if we exited now": finish group `group_index` from `state`, run the rest at default depth
        (or at `steps`, one per loop group, e.g. when a cache holds fewer iterations than the default)."""
        stages = self.stages()
        groups = self.loop_groups()
        depth = list(steps) if steps is not None else [g.default_steps for g in groups]
        pos = stages.index(groups[group_index])
        x = groups[group_index].finish(state)
        for stage in stages[pos + 1 :]:
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
            else:
                s = stage.init(x, self._noise(stage, x, None))
                for i in range(depth[groups.index(stage)]):
                    s = stage.step(s, x, ctx.at_slot(i))
                x = stage.finish(s)
        return self.head(x)

    @staticmethod
    def _noise(group: LoopGroup, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
        if not group.random_init:
            return None
        return unit_trunc_normal(x.shape, generator, x.dtype, x.device)
