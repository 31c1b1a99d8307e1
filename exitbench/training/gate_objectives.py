"""Ouro's two training objectives for a looped LM with an exit gate (Zhu et al. 2025, arXiv 2510.25741, §3.3).

The gate gives step t a stopping probability λ_t; the exit distribution it defines over T steps is
p_t = λ_t ∏_{j<t}(1 − λ_j), the last step taking what is left (policies/gate.py reads the same distribution).

- Stage I trains the LM and the gate together on the LM loss expected under p, minus β × the entropy of p.
  The entropy term is the KL to a uniform prior over steps (up to a constant), which keeps the gate from
  collapsing onto one step before the later steps have learned anything.
- Stage II freezes the LM and trains the gate alone towards "continue while the next step still lowers this
  token's loss": the improvement I_t = max(0, L_t − L_{t+1}) becomes a soft continue label
  w_t = σ(k (I_t − γ)), and the gate's continue probability 1 − λ_t is fitted to it by binary cross-entropy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..policies.gate import exit_mass


def exit_distribution(lams: torch.Tensor) -> torch.Tensor:
    """(T, N) stopping probabilities → (T, N) exit probabilities, summing to 1 over T for every token."""
    remaining = torch.ones_like(lams[0])
    out = []
    for t in range(lams.shape[0]):
        p, remaining = exit_mass(lams[t], remaining, last=torch.full_like(remaining, t == lams.shape[0] - 1,
                                                                           dtype=torch.bool))
        out.append(p)
    return torch.stack(out)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(B, L, V) logits of one step → (N,) cross-entropy of its N scored tokens (targets ≠ ignore_index)."""
    flat = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="none")
    return flat[targets.flatten() != ignore_index]


def stage_one_loss(losses: torch.Tensor, lams: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ_t p_t L_t − β H(p), averaged over tokens; also the expected exit step (1-based) and the entropy."""
    p = exit_distribution(lams)
    expected = (p * losses).sum(0).mean()
    entropy = -(p * p.clamp_min(1e-12).log()).sum(0).mean()
    steps = torch.arange(1, p.shape[0] + 1, dtype=p.dtype, device=p.device)[:, None]
    return expected - beta * entropy, {"expected_loss": expected.item(), "entropy": entropy.item(),
                                       "mean_exit": (p * steps).sum(0).mean().item()}


def continue_labels(losses: torch.Tensor, k: float, gamma: float) -> torch.Tensor:
    """(T, N) per-step losses → (T − 1, N) soft labels: 1 where step t + 1 still lowers the loss by more than γ."""
    improvement = (losses[:-1] - losses[1:]).clamp_min(0.0)
    return torch.sigmoid(k * (improvement - gamma))


def stage_two_loss(losses: torch.Tensor, gate_logits: torch.Tensor, k: float, gamma: float
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """Binary cross-entropy between the gate's continue probability and the labels, over steps 1 … T − 1 (the
    last step exits whatever the gate says). `losses` come from the frozen LM and carry no gradient."""
    labels = continue_labels(losses.detach(), k, gamma)
    # continue = 1 − λ = σ(−g), so BCE on −g with the continue label.
    loss = F.binary_cross_entropy_with_logits(-gate_logits[:-1], labels)
    return loss, {"continue_label": labels.mean().item(),
                  "continue_prob": torch.sigmoid(-gate_logits[:-1]).mean().item()}
