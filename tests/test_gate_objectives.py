"""Ouro's two gate objectives against hand computations."""
from __future__ import annotations

import math

import torch

from exitbench.training import gate_objectives as go


def test_exit_distribution_is_the_gate_survival_product_with_the_last_step_taking_the_rest():
    lams = torch.tensor([[0.5], [0.5], [0.5]])
    p = go.exit_distribution(lams)
    assert torch.allclose(p[:, 0], torch.tensor([0.5, 0.25, 0.25]))
    assert torch.allclose(go.exit_distribution(torch.rand(5, 7)).sum(0), torch.ones(7))


def test_stage_one_loss_is_the_expected_loss_minus_beta_entropy():
    losses = torch.tensor([[3.0], [1.0]])
    lams = torch.tensor([[0.25], [0.9]])  # p = (0.25, 0.75): the last step takes the rest, whatever λ_2 says
    loss, stats = go.stage_one_loss(losses, lams, beta=0.1)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert math.isclose(loss.item(), 0.25 * 3 + 0.75 * 1 - 0.1 * entropy, rel_tol=1e-6)
    assert math.isclose(stats["mean_exit"], 1.75, rel_tol=1e-6)


def test_stage_two_labels_say_continue_only_where_the_next_step_lowers_the_loss():
    # Token 0 improves a lot from step 1 to 2 and not after; token 1 gets worse.
    losses = torch.tensor([[2.0, 1.0], [0.5, 1.2], [0.5, 1.3]])
    labels = go.continue_labels(losses, k=50.0, gamma=0.005)
    assert labels[0, 0] > 0.99 and labels[1, 0] < 0.5 and (labels[:, 1] < 0.5).all()
    # A gate whose continue probability already equals the labels is at the loss's minimum in its logits.
    gate_logits = torch.zeros(3, 2, requires_grad=True)
    loss, _ = go.stage_two_loss(losses, gate_logits, 50.0, 0.005)
    loss.backward()
    assert gate_logits.grad[-1].abs().max() == 0  # the last step exits whatever the gate says
    target = -torch.logit(labels.clamp(1e-6, 1 - 1e-6))
    best = torch.cat([target, torch.zeros(1, 2)]).requires_grad_(True)
    go.stage_two_loss(losses, best, 50.0, 0.005)[0].backward()
    assert best.grad.abs().max() < 1e-4
