"""The Raven architecture against Huginn-0125's reference (shared/reference/huginn-0125.md §0-2)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.models import HUGINN_CONFIG, HUGINN_PARAMETERS, make_tiny_raven, random_ids

from exitbench.models import AttnContext, LoopGroup, Raven, RavenConfig, Stage
from exitbench.models.attention import apply_rope, rope_table
from exitbench.models.looped import unit_trunc_normal
from exitbench.models.raven import CausalSelfAttention, GatedMLP, RMSNorm

ATOL = 1e-5


def huginn_keys() -> set[str]:
    """The 77 keys of reference §2, written out independently of the module tree."""
    keys = {"transformer.wte.weight", "lm_head.weight", "freqs_cis", "transformer.adapter.weight",
            "transformer.ln_f.weight"}
    prefixes = [f"transformer.prelude.{i}" for i in range(2)] + \
               [f"transformer.core_block.{i}" for i in range(4)] + [f"transformer.coda.{i}" for i in range(2)]
    per_layer = ["norm_1.weight", "norm_2.weight", "norm_3.weight", "norm_4.weight", "attn.Wqkv.weight",
                 "attn.qk_bias", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"]
    keys |= {f"{p}.{k}" for p in prefixes for k in per_layer}
    return keys


# ---- (1) the real Huginn-0125 shape, built on the meta device ---------------------------------------

@pytest.fixture(scope="module")
def huginn_meta() -> Raven:
    with torch.device("meta"):
        return Raven(RavenConfig(**HUGINN_CONFIG))


def test_huginn_parameter_count(huginn_meta):
    assert huginn_meta.num_parameters() == HUGINN_PARAMETERS
    # Reference §1.1 breakdown.
    parts = huginn_meta.parameter_breakdown()
    assert parts["embedding"] == 346_030_080
    assert parts["adapter"] == 55_756_800
    assert parts["core"] == 1_581_592_320
    assert parts["prelude"] + parts["coda"] == 1_581_592_320
    assert sum(parts.values()) == HUGINN_PARAMETERS
    assert huginn_meta.layer_split() == {"prelude": 2, "core": 4, "coda": 2}


def test_huginn_checkpoint_keys(huginn_meta):
    state = {**huginn_meta.state_dict(), **huginn_meta.checkpoint_extras()}
    assert len(state) == 77
    assert set(state) == huginn_keys()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["transformer.wte.weight"] == (65536, 5280)
    assert shapes["lm_head.weight"] == (65536, 5280)
    assert shapes["transformer.adapter.weight"] == (5280, 10560)
    assert shapes["transformer.ln_f.weight"] == (5280,)
    assert shapes["freqs_cis"] == (1, 4096, 1, 48, 2)
    for p in ("transformer.prelude.0", "transformer.core_block.3", "transformer.coda.1"):
        assert shapes[f"{p}.attn.Wqkv.weight"] == (15840, 5280)
        assert shapes[f"{p}.attn.qk_bias"] == (2, 1, 55, 96)
        assert shapes[f"{p}.attn.proj.weight"] == (5280, 5280)
        assert shapes[f"{p}.mlp.fc.weight"] == (35840, 5280)
        assert shapes[f"{p}.mlp.proj.weight"] == (5280, 17920)
        assert shapes[f"{p}.norm_4.weight"] == (5280,)
    # Reference §2: the fp32 files of this key set total exactly 15,645,600,384 bytes.
    assert sum(math.prod(s) for s in shapes.values()) * 4 == 15_645_600_384


def test_huginn_derived_config():
    c = RavenConfig(**HUGINN_CONFIG)
    assert c.head_dim == 96
    assert c.effective_expected_depth == 132
    assert c.max_recurrence == 64


# ---- (2) the stage view equals forward ---------------------------------------------------------------

def run_stage_view(model: Raven, ids: torch.Tensor, r: int) -> torch.Tensor:
    stages = model.stages()
    assert [type(s) for s in stages] == [Stage, LoopGroup, Stage]
    prelude, group, coda = stages
    ctx = AttnContext()
    e = prelude.run(model.embed(ids), ctx)
    s = group.init(e, None)
    for i in range(r):
        s = group.step(s, e, ctx.at_iteration(i))
    return model.head(coda.run(group.finish(s), ctx))


@pytest.mark.parametrize("r", [1, 2, 5])
def test_stage_view_matches_forward(tiny_raven, r):
    ids = random_ids(2, 9)
    with torch.no_grad():
        expected = tiny_raven(ids, r)
        got = run_stage_view(tiny_raven, ids, r)
    assert expected.shape == (2, 9, 100)
    assert expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_depth_changes_logits(tiny_raven):
    """Guards the test above: different r must give different logits, or the comparison means nothing."""
    ids = random_ids(1, 6)
    with torch.no_grad():
        assert not torch.allclose(tiny_raven(ids, 1), tiny_raven(ids, 2), atol=1e-3)


def test_forward_follows_reference_equations(tiny_raven):
    """e = prelude(sqrt(h)·wte); s_k = core(adapter([s; e])); logits = lm_head(ln_f(coda(ln_f(s_r))))."""
    model, t = tiny_raven, tiny_raven.transformer
    ids = random_ids(1, 7, seed=3)
    rope = rope_table(model.config.head_dim, model.config.block_size, model.config.rope_base)
    ctx = AttnContext()
    with torch.no_grad():
        x = t.wte(ids) * math.sqrt(32)
        for blk in t.prelude:
            x = blk(x, rope, ctx)
        s = torch.zeros_like(x)
        for _ in range(3):
            s = t.adapter(torch.cat([s, x], -1))
            for blk in t.core_block:
                s = blk(s, rope, ctx)
        y = t.ln_f(s)
        for blk in t.coda:
            y = blk(y, rope, ctx)
        expected = t.ln_f(y) @ t.wte.weight.T
        got = model(ids, 3)
    assert model.lm_head.weight is t.wte.weight  # tied
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_default_steps_is_mean_recurrence(tiny_raven):
    ids = random_ids(1, 5)
    with torch.no_grad():
        torch.testing.assert_close(tiny_raven(ids), tiny_raven(ids, 4), atol=0, rtol=0)
        assert not torch.allclose(tiny_raven(ids), tiny_raven(ids, 3), atol=1e-3)
    group = tiny_raven.loop_groups()[0]
    assert (group.default_steps, group.max_steps, group.n_layers) == (4, 8, 4)
    assert group.random_init is False


# ---- (3) incremental decoding with the KV cache ------------------------------------------------------

@pytest.mark.parametrize("r", [1, 3, 6])
def test_kv_cache_token_by_token(tiny_raven, r):
    ids = random_ids(2, 12, seed=1)
    p = 5
    with torch.no_grad():
        full = tiny_raven(ids, r)
        cache = tiny_raven.new_cache(2, 4)  # small capacity: the cache must grow on the way
        parts = [tiny_raven(ids[:, :p], r, cache=cache)]
        for t in range(p, ids.shape[1]):
            parts.append(tiny_raven(ids[:, t : t + 1], r, cache=cache, start=t))
    assert cache.capacity >= ids.shape[1]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("r", [2, 4])
def test_kv_cache_chunks(tiny_raven, r):
    ids = random_ids(2, 13, seed=2)
    with torch.no_grad():
        full = tiny_raven(ids, r)
        cache = tiny_raven.new_cache(2, 16)
        parts = [tiny_raven(ids[:, :4], r, cache=cache),
                 tiny_raven(ids[:, 4:9], r, cache=cache, start=4),    # a multi-token chunk
                 tiny_raven(ids[:, 9:10], r, cache=cache, start=9),   # one token
                 tiny_raven(ids[:, 10:], r, cache=cache, start=10)]   # another chunk
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)


def test_kv_cache_slots(tiny_raven):
    cache = tiny_raven.new_cache(3, 10)
    # prelude layers 0,1 and coda 6,7 have one slot; core layers 2..5 one per iteration up to max_steps.
    assert cache.slots == {0: 1, 1: 1, 2: 8, 3: 8, 4: 8, 5: 8, 6: 1, 7: 1}
    # (slots, batch, positions, heads, head_dim): a position's (heads, head_dim) block is contiguous
    assert tuple(cache.k[2].shape) == (8, 3, 10, 2, 16)
    assert tuple(cache.k[0].shape) == (1, 3, 10, 2, 16)


def test_kv_cache_without_start_is_wrong(tiny_raven):
    """Guards the cache tests: continuing at the wrong position must change the logits."""
    ids = random_ids(1, 8, seed=4)
    with torch.no_grad():
        full = tiny_raven(ids, 2)
        cache = tiny_raven.new_cache(1, 8)
        tiny_raven(ids[:, :4], 2, cache=cache)
        wrong = tiny_raven(ids[:, 4:5], 2, cache=cache, start=5)
    assert not torch.allclose(wrong, full[:, 4:5], atol=1e-3)


# ---- (4) the layers, by hand --------------------------------------------------------------------------

def test_rmsnorm_fp32_then_cast_then_weight():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.7 + 1.0)
    x = (torch.randn(16, 64, generator=g) * 3.0).to(torch.bfloat16)
    with torch.no_grad():
        got = norm(x)
    xf = x.float()
    normed = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    expected = normed.to(torch.bfloat16) * norm.weight
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    # The other order (weight applied in fp32, cast last) rounds differently: the test can tell them apart.
    other = (normed * norm.weight.float()).to(torch.bfloat16)
    assert not torch.equal(got, other)
    # And so does a norm computed in bf16 throughout.
    in_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert not torch.equal(got, in_bf16)


def test_rmsnorm_fp32_value():
    norm = RMSNorm(4, eps=0.0)
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
        got = norm(x)
    rms = math.sqrt((1 + 4 + 9 + 16) / 4)
    expected = torch.tensor([[1 / rms, -4 / rms, 1.5 / rms, 4 / rms]])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_rope_table_values():
    table = rope_table(8, 16, 50000.0)
    assert tuple(table.shape) == (16, 4, 2)
    for pos in (0, 3, 11):
        for i in range(4):
            angle = pos * 50000.0 ** (-2 * i / 8)
            assert table[pos, i, 0].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert table[pos, i, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_rotates_adjacent_pairs():
    D, base, pos = 4, 10.0, 3
    table = rope_table(D, 8, base)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, D)  # (B, T, H, D)
    got = apply_rope(x, table, start=pos).view(D)
    expected = []
    for i in range(D // 2):
        theta = pos * base ** (-2 * i / D)
        x0, x1 = x.view(D)[2 * i].item(), x.view(D)[2 * i + 1].item()
        expected += [x0 * math.cos(theta) - x1 * math.sin(theta), x1 * math.cos(theta) + x0 * math.sin(theta)]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)
    # The half-split (rotate_half / NeoX) convention gives a different answer here.
    theta = torch.tensor([pos * base ** (-2 * i / D) for i in range(D // 2)])
    half = torch.cat([x.view(D)[:2] * theta.cos() - x.view(D)[2:] * theta.sin(),
                      x.view(D)[2:] * theta.cos() + x.view(D)[:2] * theta.sin()])
    assert not torch.allclose(got, half, atol=1e-3)


def test_rope_positions_in_a_sequence():
    """Token t of a chunk starting at `start` is rotated by position start + t."""
    D = 6
    table = rope_table(D, 32, 100.0)
    x = torch.randn(2, 3, 2, D, generator=torch.Generator().manual_seed(0))
    whole = apply_rope(x, table, start=7)
    for t in range(3):
        torch.testing.assert_close(whole[:, t : t + 1], apply_rope(x[:, t : t + 1], table, start=7 + t))
    with pytest.raises(ValueError):
        apply_rope(x, table, start=30)


def test_rope_computes_in_fp32():
    D = 8
    table = rope_table(D, 64, 50000.0)
    x = torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = apply_rope(x, table, start=40)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, apply_rope(x.float(), table, start=40).to(torch.bfloat16))


def test_gated_mlp_gate_is_first_half():
    g = torch.Generator().manual_seed(0)
    mlp = GatedMLP(8, 5)
    with torch.no_grad():
        mlp.fc.weight.copy_(torch.randn(10, 8, generator=g))
        mlp.proj.weight.copy_(torch.randn(8, 5, generator=g))
    x = torch.randn(3, 8, generator=g)
    with torch.no_grad():
        got = mlp(x)
    W = mlp.fc.weight.detach()
    gate, up = x @ W[:5].T, x @ W[5:].T
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.proj.weight.detach().T
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    swapped = (F.silu(up) * gate) @ mlp.proj.weight.detach().T
    assert not torch.allclose(got, swapped, atol=1e-3)


def hand_attention(attn: CausalSelfAttention, x: torch.Tensor, table: torch.Tensor, bias_after_rope: bool = False):
    B, T, C = x.shape
    H, D = attn.n_heads, attn.head_dim
    W = attn.Wqkv.weight.detach()
    q = (x @ W[:C].T).view(B, T, H, D)       # rows [0:C] = q, [C:2C] = k, [2C:3C] = v, head-major
    k = (x @ W[C : 2 * C].T).view(B, T, H, D)
    v = (x @ W[2 * C :].T).view(B, T, H, D)
    bq, bk = attn.qk_bias.detach()[0, 0], attn.qk_bias.detach()[1, 0]  # (H, D)
    if not bias_after_rope:
        q, k = q + bq, k + bk
    q, k = apply_rope(q, table, 0), apply_rope(k, table, 0)
    if bias_after_rope:
        q, k = q + bq, k + bk
    out = torch.empty(B, T, H, D)
    for b in range(B):
        for h in range(H):
            scores = q[b, :, h] @ k[b, :, h].T / math.sqrt(D)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            out[b, :, h] = scores.softmax(-1) @ v[b, :, h]
    return out.reshape(B, T, C) @ attn.proj.weight.detach().T


def test_attention_qk_bias_before_rope():
    g = torch.Generator().manual_seed(0)
    attn = CausalSelfAttention(n_embd=12, n_heads=3, qk_bias=True, layer_id=0)
    with torch.no_grad():
        attn.Wqkv.weight.copy_(torch.randn(36, 12, generator=g) * 0.4)
        attn.proj.weight.copy_(torch.randn(12, 12, generator=g) * 0.4)
        attn.qk_bias.copy_(torch.randn(2, 1, 3, 4, generator=g))
    assert tuple(attn.qk_bias.shape) == (2, 1, 3, 4)
    table = rope_table(4, 16, 10.0)
    x = torch.randn(2, 5, 12, generator=g)
    with torch.no_grad():
        got = attn(x, table, AttnContext())
    torch.testing.assert_close(got, hand_attention(attn, x, table), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, hand_attention(attn, x, table, bias_after_rope=True), atol=1e-3)


# ---- (5) the initial state ------------------------------------------------------------------------------

def test_random_initial_state_distribution():
    scale = 1.5
    model = make_tiny_raven(init_scale=scale)
    group = model.loop_groups()[0]
    assert group.random_init is True
    e = torch.zeros(8, 64, 32)
    noise = unit_trunc_normal(e.shape, torch.Generator().manual_seed(0))
    s0 = group.init(e, noise)
    std = math.sqrt(2 / 5) * scale  # ≈ 0.632 · init_scale
    assert s0.shape == e.shape
    assert s0.abs().max().item() <= 3 * std + 1e-6          # truncated at ±3σ
    assert s0.abs().max().item() > 2.5 * std                 # ... but not much tighter
    # A unit normal truncated at ±3 has std sqrt(1 - 6·φ(3)/(Φ(3) - Φ(-3))) ≈ 0.98658.
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    trunc_std = math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert s0.std().item() == pytest.approx(std * trunc_std, rel=0.03)
    assert s0.mean().item() == pytest.approx(0.0, abs=0.03)
    torch.testing.assert_close(s0, noise * std)


def test_random_state_makes_forward_stochastic_but_seedable():
    model = make_tiny_raven(init_scale=1.0)
    ids = random_ids(1, 6)
    with torch.no_grad():
        a = model(ids, 2, generator=torch.Generator().manual_seed(5))
        b = model(ids, 2, generator=torch.Generator().manual_seed(5))
        c = model(ids, 2, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c, atol=1e-4)


def test_zero_init_scale_gives_zero_state(tiny_raven):
    group = tiny_raven.loop_groups()[0]
    assert group.random_init is False
    e = torch.randn(2, 5, 32)
    assert torch.equal(group.init(e, None), torch.zeros_like(e))
    # Even if a caller hands it noise, init_scale = 0 means a zero state.
    assert torch.equal(group.init(e, unit_trunc_normal(e.shape)), torch.zeros_like(e))


# ---- (6) truncated backprop -----------------------------------------------------------------------------

def grads(model: Raven) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def loss_and_grads(model: Raven, ids: torch.Tensor, r: int, k: int | None):
    model.zero_grad(set_to_none=True)
    logits = model(ids, r, backprop_depth=k)
    logits.square().mean().backward()
    return logits.detach(), grads(model)


def manual_truncated(model: Raven, ids: torch.Tensor, r: int, k: int):
    """Reference truncated BPTT: the first r-k iterations detached, the last k with gradients."""
    model.zero_grad(set_to_none=True)
    prelude, group, coda = model.stages()
    ctx = AttnContext()
    e = prelude.run(model.embed(ids), ctx)
    s = group.init(e, None)
    with torch.no_grad():
        for i in range(r - k):
            s = group.step(s, e, ctx.at_iteration(i))
    for i in range(r - k, r):
        s = group.step(s, e, ctx.at_iteration(i))
    model.head(coda.run(group.finish(s), ctx)).square().mean().backward()
    return grads(model)


def test_truncated_backprop():
    model = make_tiny_raven().train()
    ids = random_ids(2, 6, seed=7)
    r, k = 4, 2
    full_logits, full = loss_and_grads(model, ids, r, None)
    trunc_logits, trunc = loss_and_grads(model, ids, r, k)
    assert torch.equal(trunc_logits, full_logits)
    # Every parameter still gets a gradient: the core via the last k steps, the prelude via e.
    for name, gr in trunc.items():
        assert gr is not None, name
    assert trunc["transformer.core_block.0.attn.Wqkv.weight"].abs().sum() > 0
    assert trunc["transformer.prelude.0.mlp.fc.weight"].abs().sum() > 0
    # ... but not the full-depth gradient,
    assert not torch.allclose(trunc["transformer.core_block.0.mlp.fc.weight"],
                              full["transformer.core_block.0.mlp.fc.weight"], atol=1e-7)
    # ... it is exactly the reference truncated one.
    ref = manual_truncated(model, ids, r, k)
    for name in trunc:
        torch.testing.assert_close(trunc[name], ref[name], atol=1e-6, rtol=1e-5, msg=name)
    # And with k ≥ r nothing is truncated.
    _, deep = loss_and_grads(model, ids, r, r)
    for name in deep:
        torch.testing.assert_close(deep[name], full[name], atol=1e-6, rtol=1e-5, msg=name)
