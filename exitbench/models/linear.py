"""A bias-free projection whose eager inference call is a bare matrix product.

On a small looped model a loop step costs its ops' dispatch, not their arithmetic (docs/engine.md), and
`F.linear` on a (B, T, d) input dispatches eleven aten ops around its one matrix product (a transpose of the
weight, matmul's reshapes). Without autograd the weight's transpose is the same view every call, so it is kept,
and the product is the same `mm` on the same operands: bit for bit `nn.Linear` (tests/test_engine_ops.py).
"""
from __future__ import annotations

import torch
from torch import nn


class FlatLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state_dict keys) whose no-grad forward is one `mm` on a kept
    transposed view of the weight. Training, compiling or a bias take nn.Linear's own path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return super().forward(x)
        w = self.weight
        held = self.__dict__.get("_transposed")
        # the view follows the weight's storage: a move to another device or dtype gives a new one
        if held is None or held[0] != w.data_ptr() or held[1].dtype != w.dtype:
            held = (w.data_ptr(), w.detach().t())
            self.__dict__["_transposed"] = held
        # view, not reshape, where it can: reshape dispatches a view of its own inside
        flat = x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])
        return torch.mm(flat, held[1]).view(*x.shape[:-1], w.shape[0])
