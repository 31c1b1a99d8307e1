"""The C probe (exitbench._probe): its four per-row sums against float64 torch, its argument checks, and that
the engine really uses it for CPU float32 tokens (and only then)."""
from __future__ import annotations

import math

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.policies import latent

from engine_fixtures import tiny

native = latent.native


def test_c_probe_is_built():
    # Without it every test still passes on the tensor path, which costs 12% of a core iteration instead of
    # under 1% (bench/RESULTS.md); a build that silently lost it must not look green.
    assert native is not None, ("exitbench._probe was not built: install a C compiler and the Python headers, "
                                "then reinstall (pip install -e .)")


def states(rows: int, width: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 1, width, generator=g) for _ in range(3)]


@pytest.mark.parametrize("rows,width", [(1, 1), (1, 128), (3, 7), (16, 128), (2, 1000)])
def test_per_row_values_match_float64(rows, width):
    a, b, c = states(rows, width, rows * width)
    A, B, C = (t.double().reshape(rows, width) for t in (a, b, c))
    norm = A.norm(dim=1)
    want = {"dist": (A - B).norm(dim=1), "dist2": ((A - B) - (B - C)).norm(dim=1),
            "stepgap": ((A - B).norm(dim=1) - (B - C).norm(dim=1)).abs(),
            "cosgap": 1 - (A * B).sum(1) / (norm * B.norm(dim=1))}
    pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
    got = {"dist": native.dist(pa, pb, rows, width, False), "dist2": native.dist2(pa, pb, pc, rows, width, False),
           "stepgap": native.stepgap(pa, pb, pc, rows, width, False), "cosgap": native.cosgap(pa, pb, rows, width, False)}
    relative = {"dist": native.dist(pa, pb, rows, width, True), "dist2": native.dist2(pa, pb, pc, rows, width, True),
                "stepgap": native.stepgap(pa, pb, pc, rows, width, True)}
    for name, values in got.items():
        assert isinstance(values, list) and len(values) == rows, name
        assert values == pytest.approx(want[name].tolist(), rel=1e-9), name
    for name, values in relative.items():
        assert values == pytest.approx((want[name] / norm).tolist(), rel=1e-9), name


def test_tiny_steps_survive_large_states():
    # A settled state of norm ~113 that moved by a few float32 ulps: ‖a‖² − 2a·b + ‖b‖² would cancel to
    # noise; the C probe subtracts first and sums in double.
    a = torch.full((128,), 10.0)
    b = a.clone()
    b[::2] += 8e-6  # lands on the nearest float32, about 8 ulps of 10; the stored difference is what counts
    want = float((a.double() - b.double()).norm())
    assert want > 0
    assert native.dist(a.data_ptr(), b.data_ptr(), 1, 128, False) == [pytest.approx(want, rel=1e-9)]


def test_cosgap_of_a_zero_state_is_one():
    z, a = torch.zeros(16), torch.randn(16)
    assert native.cosgap(z.data_ptr(), a.data_ptr(), 1, 16, False) == [1.0]
    assert native.cosgap(a.data_ptr(), z.data_ptr(), 1, 16, False) == [1.0]
    assert native.cosgap(a.data_ptr(), a.data_ptr(), 1, 16, False) == [pytest.approx(0.0, abs=1e-15)]


@pytest.mark.parametrize("call,error,message", [
    (lambda a: native.dist(a, 0, 1, 4, False), ValueError, "address 1 is null"),
    (lambda a: native.dist(a, a, 0, 4, False), ValueError, "rows and width must be >= 1"),
    (lambda a: native.cosgap(a, a, 1, 0, False), ValueError, "rows and width must be >= 1"),
    (lambda a: native.dist2(a, a, 1, 4, False), TypeError, "takes 3 addresses, rows, width and relative"),
    (lambda a: native.cosgap(a, a, 1, 4), TypeError, "takes 2 addresses, rows, width and relative, got 4"),
    (lambda a: native.cosgap("x", a, 1, 4, False), TypeError, "integer"),
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
def test_engine_uses_the_c_probe_on_cpu_float32_only(policy, monkeypatch):
    counting = Counting(native)
    monkeypatch.setattr(latent, "native", counting)
    model = tiny(init_scale=1.0)
    knobs = dict(policy=policy, threshold=1e-30, max_steps=6)
    reqs = [([5, 7, 9], 1), ([3, 4, 8], 1)]
    # One C call per iteration for all tokens in the loop together (the second-order rules have no signal at
    # k = 1): two scored positions of six iterations.
    want = 2 * (5 if policy.startswith("second_order") else 6)
    ExitEngine(model, ExitConfig(**knobs)).score(reqs[:1])
    assert counting.calls == want
    counting.calls = 0
    ExitEngine(model, ExitConfig(**knobs)).score(reqs)  # two rows: still one call per iteration
    assert counting.calls == want
    counting.calls = 0
    ExitEngine(model.to(torch.float64), ExitConfig(**knobs)).score(reqs)  # not float32: the tensor path
    assert counting.calls == 0


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


def test_relative_signal_of_a_zero_state_follows_torch():
    """A relative rule divides by ‖s_k‖: where it is 0 the host path gives what the tensor path gives (x/0 =
    inf, 0/0 = nan), and neither counts as a hit."""
    from exitbench.policies import make_policy

    policy = make_policy("first_order", threshold=1.0, relative=True, max_steps=4)
    zero, other = torch.zeros(2, 1, 8), torch.randn(2, 1, 8)
    other[1] = 0
    probe = policy.host_probe(other)
    leave, host = probe.step(1, zero)
    tensor = policy.signal(1, zero[:, 0], {"prev": other[:, 0]}, None).tolist()
    assert host[0] == math.inf == tensor[0]
    assert math.isnan(host[1]) and math.isnan(tensor[1])
    assert leave is None and probe.streaks == [0, 0]


def test_host_probe_keeps_only_the_rows_that_stay():
    from exitbench.policies import make_policy

    policy = make_policy("second_order", threshold=1e9, patience=1, min_steps=3, max_steps=8)
    s0, s1, s2 = (torch.randn(3, 1, 4) for _ in range(3))
    probe = policy.host_probe(s0)
    assert probe.step(1, s1) == (None, [math.inf] * 3)
    probe.step(2, s2)
    assert probe.streaks == [1, 1, 1]
    probe.keep(torch.tensor([0, 2]))
    assert [h.shape[0] for h in probe.history] == [2, 2] and probe.streaks == [1, 1]
    s3 = torch.randn(2, 1, 4)
    leave, values = probe.step(3, s3)
    assert leave == [True, True]
    rows = torch.tensor([0, 2])
    want = ((s3 - s2[rows]) - (s2[rows] - s1[rows])).double().flatten(1).norm(dim=1).tolist()
    assert values == pytest.approx(want, rel=1e-6)


def test_a_batch_that_shrinks_to_one_token_carries_its_history_and_streak():
    from exitbench.policies import make_policy

    policy = make_policy("second_order", threshold=1e9, patience=3, max_steps=8)
    s0, s1, s2, s3 = (torch.randn(2, 1, 4) for _ in range(4))
    probe = policy.host_probe(s0)
    probe.step(1, s1)
    probe.step(2, s2)  # streaks [1, 1]: the signal exists from k = 2
    probe.keep(torch.tensor([1]))
    leave, values = probe.step(3, s3[1:])  # lone from here on: streak 2 < patience 3
    want = ((s3[1] - s2[1]) - (s2[1] - s1[1])).double().norm().item()
    assert leave is None and values == [pytest.approx(want, rel=1e-6)]
    leave, _ = probe.step(4, torch.randn(1, 1, 4))  # third hit in a row
    assert leave == [True]
