"""Lossless depth speculation: the baseline an exit rule has to beat (LoopSpec, WaveFront, DAS).

A round drafts k tokens greedily at a shallow depth, then verifies them at full depth in one pass over their k + 1
positions (the last accepted token and the k drafts, side by side: chunk mode, every iteration of every position
written before any is read), keeps the longest prefix of drafts that full depth's own greedy tokens agree with,
and emits full depth's token where they first disagree, or full depth's next token after all k (the bonus). Every
emitted token is full depth's greedy choice and every kept position's cache entries are full depth's own (the
verify pass wrote them), so the output is full depth's greedy output, token for token, to float rounding: a
draft only decides how many positions one full-depth pass covers.

The cache needs no rollback: a draft writes only the iterations it runs at its positions and reads only those
iterations of earlier positions, which are full depth's entries where kept; the verify pass rewrites every
iteration at every position it covers; a rejected position is rewritten when the sequence reaches it again.
Initial-state noise is keyed by position (engine/noise.py), as the engine keys it, so a random-start loop (Raven's)
draws the same start for a position whichever pass computes it.

This module generates; the cells, clocks and tables that compare it with the exit rules are issue 71's next steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import ExitbenchError
from ..models import LoopedLM
from ..models.attention import AttnContext
from ..policies import log_probs
from .noise import PositionNoise


@dataclass
class Speculated:
    """One prompt's continuation: full depth's tokens and their log-probabilities (float64 log-softmax of full
    depth's logits), and what it took: drafts accepted per round, and the loop iterations drafts and verification
    ran per loop group (a position verified at full depth counts each group's full depth)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_iterations: int = 0
    verify_iterations: int = 0
    stopped_by: str | None = None

    @property
    def iterations_per_token(self) -> float:
        """Loop iterations per emitted token, the prompt's prefill left out (it is full depth's too)."""
        return (self.draft_iterations + self.verify_iterations) / max(1, len(self.tokens))


class DepthSpeculator:
    """Greedy generation by depth speculation: drafts at `draft_depth` iterations of every loop group, `k` per
    round, verified at each group's default (full) depth. k = 0 drafts nothing: full depth one token a pass, through
    the same passes (speculation's own baseline for a clock)."""

    def __init__(self, model: LoopedLM, draft_depth: int, k: int = 4, seed: int = 0):
        self.model = model.eval()
        self.full = model.resolve_steps(None)
        if isinstance(draft_depth, bool) or not isinstance(draft_depth, int) or draft_depth < 1:
            raise ExitbenchError(f"a draft depth must be a whole number ≥ 1, got {draft_depth!r}")
        if draft_depth >= min(self.full):
            raise ExitbenchError(f"draft depth {draft_depth} is not below full depth {min(self.full)}: a draft "
                                 "that deep saves nothing over generating at full depth; give a shallower one")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ExitbenchError(f"draft tokens (k) must be a whole number ≥ 1 (0: none, full depth alone), got {k!r}")
        self.draft, self.k = model.resolve_steps(draft_depth), k
        dim = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device)).shape[-1]
        self.noise = PositionNoise(seed, dim)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = ()
                 ) -> list[Speculated]:
        if max_new_tokens < 1:
            raise ExitbenchError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ExitbenchError("generation needs a non-empty prompt (at least a BOS token)")
        return [self._one(list(p), max_new_tokens, set(stop_ids)) for p in prompts]

    def _pass(self, ids: list[int], start: int, depths: list[int], cache, prefix: int | None = None) -> torch.Tensor:
        """Logits (T, V) of `ids` at positions start … through the cache, every loop group at `depths`."""
        model, x = self.model, torch.tensor([ids], device=self.model.device)

        def noise(group, h: torch.Tensor) -> torch.Tensor | None:
            return self.noise.rows(start, h.shape[1], h.dtype, h.device).unsqueeze(0) if group.random_init else None

        h = model.walk(model.embed(x, start), AttnContext(start=start, cache=cache, prefix=prefix), depths,
                       noise=noise)
        return model.head(h)[0]

    def _one(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> Speculated:
        model, out = self.model, Speculated()
        n = len(prompt)
        if n + max_new_tokens + self.k > model.config.block_size:
            raise ExitbenchError(f"a sequence needs {n + max_new_tokens + self.k} positions (prompt, new tokens "
                                 f"and a round of drafts) but the model's context is {model.config.block_size}")
        cache = model.new_cache(1, n + max_new_tokens + self.k + 1, self.full)

        def emit(logits: torch.Tensor) -> int:
            logp = log_probs(logits)  # the engine's float64 log-softmax, so the two agree
            token = int(logp.argmax())
            out.tokens.append(token)
            out.logprobs.append(float(logp[token]))
            if token in stop_ids:
                out.stopped_by = "stop_id"
            elif len(out.tokens) >= max_new_tokens:
                out.stopped_by = "max_new_tokens"
            return token

        emit(self._pass(prompt, 0, self.full, cache, n if model.prefix_lm else None)[-1])
        while out.stopped_by is None:
            pos = n + len(out.tokens) - 1  # the last emitted token's position: the next pass's first input
            k = min(self.k, max_new_tokens - len(out.tokens))
            drafts = []
            for j in range(k):
                logits = self._pass([drafts[-1] if drafts else out.tokens[-1]], pos + j, self.draft, cache)[-1]
                drafts.append(int(logits.argmax()))
            out.draft_iterations += k * sum(self.draft)
            verified = self._pass([out.tokens[-1], *drafts], pos, self.full, cache)
            out.verify_iterations += (k + 1) * sum(self.full)
            kept = 0
            for j in range(k + 1):
                token = emit(verified[j])
                if out.stopped_by is not None or j == k or token != drafts[j]:
                    break
                kept += 1
            out.accepted.append(kept)
        return out
