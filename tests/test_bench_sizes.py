"""bench/sizes.py's random weights: a real-size tensor from one pool of normals, a small one drawn value by value,
so the tiny fixtures the make_*_size.py scripts wrote are still what their documented commands write (held here).
The real-size scripts themselves run in tests/test_full_size.py (slow)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.bench import bench_script
from helpers.paths import REPO

Normals = bench_script("sizes").Normals


def test_a_small_tensor_is_drawn_value_by_value():
    t = Normals(torch.Generator().manual_seed(3))(torch.empty(Normals.POOL), 0.5, 0.02)
    assert torch.equal(t, torch.empty(Normals.POOL).normal_(0.5, 0.02, generator=torch.Generator().manual_seed(3)))


class SmallPool(Normals):
    POOL = 1 << 10  # the real pool's 4M values, a thousandth as long: the same code, in milliseconds


def test_a_large_tensor_is_the_pool_in_stretches_of_their_own_start_and_sign():
    normal = SmallPool(torch.Generator().manual_seed(0))
    n = 8 * SmallPool.POOL + 100  # nine stretches, the last one short
    t = normal(torch.empty(n), 0.25, 0.02)
    # each value N(0.25, 0.02²), though the stretches share the pool's 1,024 draws: so the mean within 5 standard
    # errors of those draws' (0.02 / √1024 = 6e-4), the spread within 15% (its standard error 2.2%, and a stretch's
    # random sign moves no spread)
    assert abs(t.mean().item() - 0.25) < 5 * 0.02 / 32 and abs(t.std().item() / 0.02 - 1) < 0.15
    pool = normal._pool[:SmallPool.POOL]
    doubled = torch.cat([pool, pool])
    stretches = (t - 0.25).split(SmallPool.POOL)
    for stretch in stretches:  # each is ±σ times a run of the pool from some start
        unit = stretch / 0.02
        assert any(torch.allclose(unit, sign * doubled[start:start + len(unit)], atol=1e-5, rtol=0)
                   for sign in (1, -1) for start in range(SmallPool.POOL)), "a stretch is no run of the pool"
    assert len({(round(s[0].item(), 6), round(s[1].item(), 6)) for s in stretches}) > 1  # not one copy again and again
    # a second tensor reuses the pool: nothing more drawn than its starts and signs
    pool_before = normal._pool.clone()
    normal(torch.empty(n), 0.0, 1.0)
    assert torch.equal(normal._pool, pool_before)


@pytest.mark.parametrize("script,fixture,options", [
    ("make_ouro_size", "ouro-tiny", {"size": "tiny", "shards": 1, "seed": 25}),
    ("make_retrofit_size", "retrofit-llama-tiny", {"size": "llama-tiny", "seed": 26}),
    ("make_retrofit_size", "retrofit-olmo-tiny", {"size": "olmo-tiny", "seed": 26}),
])
def test_a_tiny_fixture_is_what_its_documented_command_writes(script, fixture, options, tmp_path):
    """The scripts' docstrings (and docs/models.md for Ouro) give each tiny fixture's command: it writes the
    fixture's tensors exactly."""
    out = bench_script(script).write(tmp_path / fixture, dtype=torch.float32, log=lambda *_: None, **options)
    written = load_file(out / "model.safetensors")
    committed = load_file(REPO / "tests" / "fixtures" / fixture / "model.safetensors")
    assert written.keys() == committed.keys() and all(torch.equal(written[k], committed[k]) for k in committed)
