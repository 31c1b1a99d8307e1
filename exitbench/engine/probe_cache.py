"""The keys and values a decoding rule's readout reads in the stages after its loop group, when scoring.

A probe at loop group g after iteration k reads out "if this token exited here": g's finish, every later stage
at its readout depth, the head. Where those stages attend (a coda, a later loop group) the readout of token t
reads earlier tokens' entries there, and scoring keeps those entries apart from the run's cache: each earlier
scored position's as its own readout wrote them after iteration min(k, its exit), the unscored prefix's as the
prefill left them. That is Huginn's `latest` rule applied to the readout's layers as the run applies it to the
loop's (an exited position's readout entries stay those of its exit), and it depends on nothing a later group
of another position did, so all positions of a sequence can probe together, one wave per iteration (waves.py),
with the answers of the token-by-token schedule, at the FLOPs the cost model counts: only positions still
iterating read out. (A readout of the whole sequence at iteration k would also redo every exited position's
readout at every later iteration.)

Generation keeps the run's own world: a generated token's readout reads earlier tokens' final entries (Huginn's
`generate_with_adaptive_compute`), where every earlier token is final before the next one starts. So a probe's
logits are a token's output only where its readout reads no other token; here the token's output is computed
after its last exit, from the run's cache.

The entries live in caches over the later stages' attention layers only, shaped as the run's:
- depth-major, one: wave k overwrites the entries of the positions still iterating and leaves an exited
  position's at its exit, so every read finds min(k, exit) without a copy;
- token-major, one per iteration: a token at k writes cache k; when it exits at e its entries there are copied
  into caches e+1 … K, the `latest` rule across caches instead of across slots. This is the reference the
  depth-major schedule is tested against (and it holds K times the later layers' entries).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable

import torch

from ..models import AttnContext, KVCache, LoopedLM
from .records import Token


class ProbeCache:
    def __init__(self, model: LoopedLM, group_index: int, readout_steps: list[int], main: KVCache,
                 layers: list[int], depth: int, per_iteration: bool):
        self.model, self.group_index, self.readout_steps = model, group_index, readout_steps
        self.layers = layers
        slots = {layer: main.slots[layer] for layer in layers}
        self.caches = [KVCache(main.batch, main.n_heads, main.head_dim, slots, main.capacity, main.dtype, main.device,
                               main.window, main.geometry, main.private)
                       for _ in range(depth if per_iteration else 1)]

    def at(self, k: int) -> KVCache:
        """Where a probe after iteration k (1-based) writes and reads."""
        return self.caches[k - 1] if len(self.caches) > 1 else self.caches[0]

    def copy_prefix(self, main: KVCache, rows: list[tuple[int, int]]) -> None:
        """After a prefill: each (row, first) row's positions before `first`, as the run's cache holds them."""
        for cache in self.caches:
            for layer in self.layers:
                for ours, theirs in ((cache.k, main.k), (cache.v, main.v)):
                    for b, first in rows:
                        ours[layer][:, b, :first] = theirs[layer][:, b, :first]

    def readout(self, states: torch.Tensor, tokens: list[Token], k: list[int],
                blocks: tuple[AttnContext, int] | None, context: Callable[[], AttnContext]) -> torch.Tensor:
        """Logits (n, V) of every token's probe (states (n, 1, d), after iterations `k`): a depth-major wave at
        one iteration in one call (as one chunk when `blocks` gives it), token by token one call per iteration."""
        if len(self.caches) == 1 or min(k) == max(k):
            cache = self.at(k[0])
            if blocks is not None:
                ctx, rows = blocks
                s = states.view(rows, -1, states.shape[-1])
                return self._read(s, dataclasses.replace(ctx, cache=cache)).reshape(-1, self.model.output_size)
            return self._read(states, dataclasses.replace(context(), cache=cache))[:, 0]
        logits = None
        by_depth: dict[int, list[int]] = defaultdict(list)
        for i, depth in enumerate(k):
            by_depth[depth].append(i)
        for depth, idx in by_depth.items():
            at = torch.tensor(idx, device=states.device)
            ctx = AttnContext.tokens(self.at(depth), [tokens[i].row for i in idx], [tokens[i].position for i in idx])
            out = self._read(states[at], ctx)[:, 0]
            logits = out.new_empty(len(k), out.shape[-1]) if logits is None else logits
            logits[at] = out
        return logits

    def _read(self, states: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        return self.model.readout(self.group_index, states, ctx, self.readout_steps)

    def exited(self, tokens: list[Token], steps: list[int]) -> None:
        """Tokens that left after `steps` iterations: later readers at deeper iterations find their entries of
        the exit (token-major; depth-major leaves them in place)."""
        if len(self.caches) == 1:
            return
        for token, e in zip(tokens, steps):
            source = self.caches[e - 1]
            for cache in self.caches[e:]:
                for layer in self.layers:
                    for ours, theirs in ((cache.k, source.k), (cache.v, source.v)):
                        ours[layer][:, token.row, token.position] = theirs[layer][:, token.row, token.position]
