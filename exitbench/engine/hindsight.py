"""A retrospective rule's side of a loop group (the oracle): run every token to max_steps, then settle.

A rule that decides from a token's whole trajectory cannot stop the token when it decides; every token runs
to K = max_steps, this module records what the rule reads at each iteration, and when the token leaves it
settles on the rule's exit step and makes the token look as if it had stopped there:
- its state is the state at the exit step;
- under a KV window of fewer than K iterations, the iterations past the exit have overwritten the window's
  slots, so the entries of every iteration are kept and the exit's are put back;
- in the last loop group the readout is rerun from the exit state, so the coda's KV entries are those of a
  token that stopped there.
The token loop keeps the per-token record beside its other per-token tensors (it moves rows as tokens come
and go) and calls `start`, `keep_entries`, `record` and `settle` at the matching points of its own work.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..models import AttnContext, KVCache, LoopedLM, LoopGroup
from ..policies import ExitPolicy, log_probs
from .records import Token

Record = dict[str, torch.Tensor]  # per token: its record of every iteration


class Hindsight:
    def __init__(self, model: LoopedLM, group: LoopGroup, policy: ExitPolicy, window: int | None):
        self.model, self.group, self.policy, self.window = model, group, policy, window
        self.K = policy.max_steps
        self.keeps_entries = bool(window) and window < self.K and bool(group.attn_layers)

    def start(self, tokens: list[Token], s0: torch.Tensor) -> Record:
        """Room for every iteration of new tokens: states, argmax, the target's log-probability (and the KV
        entries, under a short window)."""
        m, device = len(tokens), s0.device
        record = {"states": torch.zeros(m, self.K, s0.shape[-1], dtype=s0.dtype, device=device),
                  "top": torch.zeros(m, self.K, dtype=torch.long, device=device),
                  "picked": torch.zeros(m, self.K, dtype=torch.float64, device=device),
                  "target": torch.tensor([-1 if t.target is None else t.target for t in tokens], device=device)}
        if self.keeps_entries:  # (token, iteration, layer, key or value, head, dim)
            heads, head_dim = self.model.cache_geometry()
            record["kv"] = torch.zeros(m, self.K, len(self.group.attn_layers), 2, heads, head_dim,
                                       dtype=self.model.dtype, device=device)
        return record

    def keep_entries(self, record: Record, tokens: list[Token], k: list[int], cache: KVCache) -> None:
        """Each token's KV entries of the iteration it just ran (only under a window shorter than K)."""
        if not self.keeps_entries:
            return
        at = [i - 1 for i in k]
        entries = cache.entries(self.group.attn_layers, [t.row for t in tokens], [t.position for t in tokens], at)
        device = entries.device
        record["kv"][torch.arange(len(at), device=device), torch.tensor(at, device=device)] = entries

    def record(self, record: Record, s: torch.Tensor, k: list[int], logits: torch.Tensor) -> None:
        """What the rule reads of the iteration each token just ran: its state, argmax and target's log-prob."""
        rows = torch.arange(len(k), device=logits.device)
        at = torch.tensor(k, device=logits.device) - 1  # each token's own iteration
        logp = log_probs(logits)
        record["states"][rows, at] = s[:, 0]
        record["top"][rows, at] = logp.argmax(-1)
        record["picked"][rows, at] = logp.gather(1, record["target"].clamp(min=0).unsqueeze(1)).squeeze(1)

    def settle(self, record: Record, tokens: list[Token], cache: KVCache,
               readout: Callable[[torch.Tensor, AttnContext], torch.Tensor] | None
               ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """For leaving tokens (their rows of the record): exit steps by the rule, the states there and, given
        the last group's `readout`, its logits rerun from those states."""
        steps = self.policy.exit_steps(record["top"], record["picked"], record["target"] >= 0)
        states = record["states"][torch.arange(len(tokens)), steps - 1].unsqueeze(1)
        if self.keeps_entries:
            self._restore_entries(tokens, steps.tolist(), record["kv"], cache)
        logits = None
        if readout is not None:
            logits = readout(states, AttnContext.tokens(cache, [t.row for t in tokens], [t.position for t in tokens]))
        return steps.tolist(), states, logits

    def _restore_entries(self, tokens: list[Token], steps: list[int], kept: torch.Tensor, cache: KVCache) -> None:
        """Put back the entries of each settled token's last `window` iterations up to its exit (the window's
        slots as a token that stopped there left them; the loop carries the exit's entry above it)."""
        rows, positions, iterations, picks = [], [], [], []
        for i, (token, e) in enumerate(zip(tokens, steps)):
            if e == self.K:
                continue
            for it in range(max(0, e - self.window), e):
                rows.append(token.row)
                positions.append(token.position)
                iterations.append(it)
                picks.append(i * self.K + it)
        if rows:
            flat = kept.view(-1, *kept.shape[2:])
            cache.put_entries(self.group.attn_layers, rows, positions, iterations,
                              flat[torch.tensor(picks, device=kept.device)])
