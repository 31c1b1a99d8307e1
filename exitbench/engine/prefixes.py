"""Prefilled prompts kept for reuse: the KV entries a request's prefix leaves at full depth, by what decides them.

A prompt's prefix runs at full depth whatever the exit rule (prefill "full"), so every cell of a sweep prefills the
same prompts to the same entries, and a cell's paired timings prefill its timed documents six times more. The
store keeps each prefix's entries, every layer's slots over its positions, keyed by everything that decides them:
the tokens (and a prefix-LM's block), each loop group's depth, the loop layers' slot layout, the seed of the
initial-state noise, the dtype, and whether the run scores (it prefills from inputs walked apart) or generates. A
run restores a stored prefix with two copies per layer instead of running the loop over it.

Each prefix is prefilled alone, stored or not: a prefix prefilled beside others of other lengths differs from one
prefilled alone in its last bits (attention over padded keys sums in another order), so prefilling them together
would make a cell's numbers depend on which cell first met its prompts, or on what the store still held; alone,
they depend on the prompt alone. The store holds at most `budget` bytes, the least recently used prefix going
first (EXITBENCH_PREFIX_CACHE_MB sets it; 0 stores nothing).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

DEFAULT_BUDGET_MB = 512

Entries = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (keys, values), each (slots, positions, H, D)


class PrefixStore:
    def __init__(self, budget: int):
        self.budget = budget
        self.held: OrderedDict[tuple, Entries] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: tuple) -> Entries | None:
        entries = self.held.get(key)
        if entries is None:
            self.misses += 1
            return None
        self.held.move_to_end(key)
        self.hits += 1
        return entries

    def put(self, key: tuple, entries: Entries) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in entries.values())
        if size > self.budget or key in self.held:
            return
        while self.held and self.bytes + size > self.budget:
            _, dropped = self.held.popitem(last=False)
            self.bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in dropped.values())
        self.held[key] = entries
        self.bytes += size


def shared_store(model: Any) -> PrefixStore | None:
    """The store every engine over `model` in this process shares (None when the budget is 0), made at first use."""
    held = model.__dict__.get("_exitbench_prefixes")
    if held is None:
        budget = int(float(os.environ.get("EXITBENCH_PREFIX_CACHE_MB", DEFAULT_BUDGET_MB)) * 2**20)
        held = model.__dict__["_exitbench_prefixes"] = PrefixStore(budget) if budget > 0 else False
    return held or None
