"""Rules on the next-token distribution p_k of the readout at s_k: each iteration pays for a coda + LM head."""
from __future__ import annotations

import math

import torch

from ..errors import ExitbenchError
from .base import ExitPolicy, Memory, log_grid, register


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _kl(logp_prev: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p_prev ‖ p) summed over the vocabulary."""
    return (logp_prev.exp() * (logp_prev - logp)).sum(-1)


class _DistributionRule(ExitPolicy):
    needs_logits = True

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {}


@register
class KL(_DistributionRule):
    """KL(p_{k−1} ‖ p_k) < τ with p_0 uniform. Geiping et al. 2025 exit at τ = 5e-4 (code default later 1e-3)."""

    name = "kl"
    source = "Geiping et al. 2025 (arXiv 2502.05171) §6, KLExitEvaluator"
    default_threshold = 5e-4
    default_grid = log_grid(1e-6, 1e-1, per_decade=1)

    def _distribution(self, logp: torch.Tensor) -> torch.Tensor:
        """The log-distribution the KL compares (subclasses filter it)."""
        return logp

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        # p_0 is uniform, in the float64 the engine hands log-probabilities over in.
        return {"logp": torch.full((s0.shape[0], vocab), -math.log(vocab), dtype=torch.float64, device=s0.device)}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        logp = self._distribution(logp)
        value = _kl(memory["logp"], logp)
        memory["logp"] = logp
        return value


@register
class MinPKL(KL):
    """KL between min-p filtered p_{k−1}, p_k: probabilities below 0.1·max set to 1/V, renormalised (Huginn)."""

    name = "minp_kl"
    source = "Geiping et al. 2025, recurrent-pretraining MinKLExitEvaluator"
    default_threshold = 1e-5
    default_grid = log_grid(1e-7, 1e-2, per_decade=1)
    min_p = 0.1

    def _distribution(self, logp: torch.Tensor) -> torch.Tensor:
        p = logp.exp()
        keep = p >= self.min_p * p.max(-1, keepdim=True).values
        p = torch.where(keep, p, torch.full_like(p, 1.0 / p.shape[-1]))
        return (p / p.sum(-1, keepdim=True)).log()


@register
class EntropyDiff(_DistributionRule):
    """|H(p_k) − H(p_{k−1})| < τ (Huginn's `entropy-diff`, 1e-3); undefined, so never a hit, at k = 1."""

    name = "entropy_diff"
    source = "Geiping et al. 2025, recurrent-pretraining EntropyDiffExitEvaluator"
    default_threshold = 1e-3
    default_grid = log_grid(1e-5, 1e-1, per_decade=1)
    defined_from = 2

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return {"entropy": torch.zeros(s0.shape[0], dtype=torch.float64, device=s0.device)}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        h = _entropy(logp)
        value = (h - memory["entropy"]).abs()
        memory["entropy"] = h
        return value


@register
class ArgmaxStability(_DistributionRule):
    """Exit once argmax p_k has stayed the same for τ consecutive iterations (Huginn's default 5)."""

    name = "argmax_stability"
    source = "Geiping et al. 2025, recurrent-pretraining ArgmaxStabilityExitEvaluator"
    exits_below = False
    integer_threshold = True
    default_threshold = 5
    default_grid = (1, 2, 3, 5, 8)

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        n = s0.shape[0]
        # argmax −1 matches no token: at k = 1 the run starts at 0.
        return {"argmax": torch.full((n,), -1, dtype=torch.long, device=s0.device),
                "run": torch.zeros(n, dtype=torch.long, device=s0.device)}

    def first_hit(self) -> int:
        # the run of unchanged argmaxes starts at k = 2, so it reaches τ at k = τ + 1
        return int(self.threshold) + 1

    def _why_late(self) -> str:
        why = f"its argmax must stay unchanged for {self.threshold:g} iterations"
        return why + (f", then {self.patience} times in a row" if self.patience > 1 else "")

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        top = logp.argmax(-1)
        run = torch.where(top == memory["argmax"], memory["run"] + 1, 0)
        memory["argmax"], memory["run"] = top, run
        return run.float()


@register
class Confidence(_DistributionRule):
    """max_v p_k(v) ≥ τ: softmax-response confidence (CALM, Schuster et al. 2022)."""

    name = "confidence"
    source = "Schuster et al. 2022, Confident Adaptive Language Modeling (softmax response)"
    exits_below = False
    default_threshold = 0.9
    default_grid = (0.5, 0.7, 0.9, 0.99, 0.999)

    def _validate(self) -> None:
        super()._validate()
        if self.threshold > 1:
            raise ExitbenchError(f"confidence: threshold is a probability and must be ≤ 1, got {self.threshold}")

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        return logp.max(-1).values.exp()


@register
class Margin(_DistributionRule):
    """log p_k(top-1) − log p_k(top-2) ≥ τ: the readout's lead of its first choice over its second.

    The peer's `logit_margin` (top-1 minus top-2 logit), which equals the log-probability margin since
    softmax shifts every logit alike; not the probability difference p₁ − p₂, which shrinks with the mass of
    the tail and would need a different grid per vocabulary. The peer's benchmark uses 0.125.
    """

    name = "margin"
    source = "IBM vLLM-Hook recurrent-depth exit (PR #30, 2026), logit_margin readout"
    exits_below = False
    default_threshold = 0.125
    default_grid = (0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        top2 = logp.topk(2, dim=-1).values
        return top2[:, 0] - top2[:, 1]
