"""A copy of a model (copy.deepcopy, then e.g. .double()) runs its own layers, for every architecture.

A model's stages are closures over its layers; deepcopy copies functions by reference, so without
LoopedLM.__setstate__ rebuilding them a copy silently ran the original's weights (found when a float64 copy
of a float32 model failed on mixed dtypes)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from exitbench.models.checkpoint import load_checkpoint, open_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {"tiny-raven": lambda: open_checkpoint("tiny-raven").model,
          "tiny-looped-gpt2": lambda: open_checkpoint("tiny-looped-gpt2").model,
          "ouro": lambda: load_checkpoint(FIXTURES / "ouro-tiny").model,
          "retrofit-llama": lambda: load_checkpoint(FIXTURES / "retrofit-llama-tiny").model}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    if hasattr(model.config, "init_scale"):
        model.config.init_scale = 0.0  # Raven's random initial state off: two calls must give the same logits
    with torch.no_grad():
        return model(ids, num_steps=3).double()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_copy_runs_its_own_weights(name):
    model = MODELS[name]().eval()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    halved = copy.deepcopy(model)
    with torch.no_grad():
        for p in halved.parameters():
            p.mul_(0.5)
    assert torch.equal(_logits(model, ids), before)            # the original is untouched …
    assert (_logits(halved, ids) - before).abs().max() > 1e-2  # … and the copy computes with its own weights
    # A float64 copy runs in float64 end to end and agrees with the float32 model to float32 rounding
    # (3 loop steps of a tiny model: 1e-3 is far above that and far below what halving the weights moves).
    exact = copy.deepcopy(model).double()
    assert all(p.dtype == torch.float64 for p in exact.parameters())
    assert (_logits(exact, ids) - before).abs().max() < 1e-3
