"""The C probe (exitbench._probe): its four sums against float64 torch, its argument checks, and that the
engine really uses it for a lone CPU token (and only then)."""
from __future__ import annotations

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.policies import latent

from engine_fixtures import tiny

native = latent.native


def test_c_probe_is_built():
    # Without it every test still passes on the tensor path, which costs 12% of a core iteration instead of
    # 0.6% (bench/RESULTS.md); a build that silently lost it must not look green.
    assert native is not None, ("exitbench._probe was not built: install a C compiler and the Python headers, "
                                "then reinstall (pip install -e .)")


def states(n: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale for _ in range(3)]


@pytest.mark.parametrize("n", [1, 7, 128, 1000])
def test_sums_match_float64(n):
    a, b, c = states(n, n)
    A, B, C = a.double(), b.double(), c.double()
    assert native.sqnorm(a.data_ptr(), n) == pytest.approx(float(A @ A), rel=1e-12)
    assert native.sqdist(a.data_ptr(), b.data_ptr(), n) == pytest.approx(float((A - B) @ (A - B)), rel=1e-12)
    e = (A - B) - (B - C)
    assert native.sqdist2(a.data_ptr(), b.data_ptr(), c.data_ptr(), n) == pytest.approx(float(e @ e), rel=1e-12)
    cos = float(A @ B / (A.norm() * B.norm()))
    assert native.cosgap(a.data_ptr(), b.data_ptr(), n) == pytest.approx(1 - cos, rel=1e-9)


def test_tiny_steps_survive_large_states():
    # A settled state of norm ~113 that moved by a few float32 ulps: ‖a‖² − 2a·b + ‖b‖² would cancel to
    # noise; the C probe subtracts first and sums in double.
    a = torch.full((128,), 10.0)
    b = a.clone()
    b[::2] += 8e-6  # lands on the nearest float32, about 8 ulps of 10; the stored difference is what counts
    want = float(((a.double() - b.double()) ** 2).sum())
    assert want > 0
    assert native.sqdist(a.data_ptr(), b.data_ptr(), 128) == pytest.approx(want, rel=1e-9)


def test_cosgap_of_a_zero_state_is_one():
    z, a = torch.zeros(16), torch.randn(16)
    assert native.cosgap(z.data_ptr(), a.data_ptr(), 16) == 1.0
    assert native.cosgap(a.data_ptr(), z.data_ptr(), 16) == 1.0
    assert native.cosgap(a.data_ptr(), a.data_ptr(), 16) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("call,error,message", [
    (lambda a: native.sqdist(a, 0, 4), ValueError, "address 1 is null"),
    (lambda a: native.sqnorm(a, 0), ValueError, "length must be >= 1"),
    (lambda a: native.sqdist2(a, a, 4), TypeError, "takes 3 addresses and a length"),
    (lambda a: native.cosgap("x", a, 4), TypeError, "integer"),
])
def test_bad_arguments_raise(call, error, message):
    a = torch.zeros(4)
    with pytest.raises(error, match=message):
        call(a.data_ptr())


class Counting:
    """Stands in for the C module and counts what the engine asks of it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*args):
            self.calls += 1
            return fn(*args)
        return counted


@pytest.mark.parametrize("policy", ["first_order", "second_order", "second_order_magnitude", "cosine"])
def test_engine_uses_the_c_probe_for_a_lone_cpu_token_only(policy, monkeypatch):
    counting = Counting(native)
    monkeypatch.setattr(latent, "native", counting)
    model = tiny(init_scale=1.0)
    eng = ExitEngine(model, ExitConfig(policy=policy, threshold=1e-30, max_steps=6))
    reqs = [([5, 7, 9], 1), ([3, 4, 8], 1)]
    eng.score(reqs[:1])
    # Two scored tokens, six iterations each, one C call per iteration (second_order has no signal at k = 1).
    assert counting.calls == 2 * (5 if policy == "second_order" else 6)
    before = counting.calls
    eng.score(reqs)  # two tokens in every loop: the tensor path
    assert counting.calls == before


def test_a_strided_state_reaches_the_c_probe_as_a_contiguous_copy(monkeypatch):
    """The C probe reads memory by address, so a state whose last dimension is strided must not reach it."""
    model = tiny(init_scale=1.0)
    group = model.loop_groups()[0]
    step = group.step

    def strided_step(s, x, ctx):
        y = step(s, x, ctx)
        return torch.cat([y, torch.full_like(y, 1e6)], -1).view(*y.shape[:-1], 2, -1).transpose(-1, -2)[..., 0]

    monkeypatch.setattr(group, "step", strided_step)
    counting = Counting(native)
    monkeypatch.setattr(latent, "native", counting)
    knobs = dict(policy="first_order", threshold=1e-30, max_steps=5, record_signals=True)
    c_path = ExitEngine(model, ExitConfig(**knobs)).score([([5, 7], 1)])[0].records[0].signals[0]
    assert counting.calls == 5
    monkeypatch.setattr(latent, "native", None)
    tensor_path = ExitEngine(model, ExitConfig(**knobs)).score([([5, 7], 1)])[0].records[0].signals[0]
    assert max(tensor_path) < 1e5  # the interleaved 1e6 entries were skipped by the stride
    assert c_path == pytest.approx(tensor_path, rel=1e-5)
