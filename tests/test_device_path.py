"""What the GPU path relies on, checked on CPU (issue 15): the per-token loop reads the device once per
iteration at most (the exit decision), plus once when tokens leave; and attention is torch's fused
scaled_dot_product_attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.loop import TokenLoop

from helpers.engine import knobs_for, mixed_requests, tiny

# Every way a tensor's values reach the host (each one a synchronisation on a GPU).
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def model():
    return tiny(init_scale=1.0)


def _count(monkeypatch, owner, names):
    counts = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(owner, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)
    return counts


@pytest.mark.parametrize("policy,tau", [("second_order", 0.3), ("first_order", 0.05), ("learned", 0.3),
                                        ("kl", 1e-3), ("fixed", 8)])
@pytest.mark.parametrize("batch", [1, 4])
def test_the_loop_reads_the_device_once_per_iteration(model, monkeypatch, policy, tau, batch):
    engine = ExitEngine(model, ExitConfig(policy, threshold=tau, **knobs_for(policy)))
    requests = mixed_requests(6)
    engine.score(requests[:1])  # warm up outside the count
    steps = {"calls": 0, "leaving": 0}
    step = TokenLoop.step

    def counted_step(self, cache):
        out = step(self, cache)
        steps["calls"] += 1
        steps["leaving"] += out is not None
        return out
    monkeypatch.setattr(TokenLoop, "step", counted_step)
    reads = _count(monkeypatch, torch.Tensor, HOST_READS)
    engine.score(requests, batch_size=batch)
    total = sum(reads.values())
    assert steps["calls"] > 0
    # One read per step for the decision (none for fixed depth, which counts), one per step where tokens
    # leave (their answers), and per request a handful outside the loop (prefill, results).
    allowed = steps["calls"] * (0 if policy == "fixed" else 1) + steps["leaving"] + 4 * len(requests)
    assert total <= allowed, (reads, steps)


def test_attention_is_the_fused_kernel(model, monkeypatch):
    calls = _count(monkeypatch, F, ["scaled_dot_product_attention"])
    ExitEngine(model, ExitConfig("second_order", threshold=0.3)).score(mixed_requests(3), batch_size=2)
    assert calls["scaled_dot_product_attention"] > 0
