"""The looped GPT-2 (exitbench/models/gpt2.py): Hugging Face GPT-2's keys and shapes, a forward written out
again with plain torch ops, cached decoding, checkpoints (ours and Hugging Face's layout), config validation,
per-group exits through the engine, and `exitbench info`.

Every expected value here is computed independently of the module tree under test: key names and shapes are
written out by hand, the reference forward reads the state dict and uses explicit matmuls and a masked softmax.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError, ExitbenchError
from exitbench.models import (LoopedGPT2, LoopedGPT2Config, LoopGroup, Stage, load_checkpoint,
                              save_checkpoint)
from exitbench.policies import REGISTRY

from helpers.cli import assert_one_line_error
from helpers.engine import expected_exit, knobs_for, mixed_requests, varied
from helpers.models import GPT2_SHAPE, gpt2_config, make_gpt2, make_tiny_raven, random_ids

# vocab, n_embd, n_head, n_layer, n_positions: 100, 32, 4, 6, 64
V, D, H, L, P = (GPT2_SHAPE[k] for k in ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions"))
GROUPS = GPT2_SHAPE["loop_groups"]  # [[1], [2, 3], [4]]
STEPS = GPT2_SHAPE["loop_steps"]  # loop_steps: the default K_g per group, [3, 4, 3]
MAX_STEPS = GPT2_SHAPE["max_loop_steps"]  # [6, 8, 6]
ATOL = 1e-5
LOGP_TOL = 1e-5


@pytest.fixture(scope="module")
def gpt2() -> LoopedGPT2:
    return make_gpt2()


def hf_gpt2_shapes(V: int, d: int, n_layer: int, n_pos: int) -> dict[str, tuple[int, ...]]:
    """GPT2LMHeadModel's state dict (without the non-persistent mask buffers), written out by hand."""
    keys = {"transformer.wte.weight": (V, d), "transformer.wpe.weight": (n_pos, d),
            "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,), "lm_head.weight": (V, d)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        keys.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
                     p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                     p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                     p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                     p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
                     p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,)})
    return keys


def gpt2_parameter_count(V=V, d=D, n_layer=L, n_pos=P) -> int:
    per_layer = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return V * d + n_pos * d + n_layer * per_layer + 2 * d  # the tied head counts once


# ---- a reference forward in plain torch ops -----------------------------------------------------------

def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _block(sd, i, x, n_head):
    p = f"transformer.h.{i}."
    B, T, C = x.shape
    Dh = C // n_head
    h = _layer_norm(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
    qkv = h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]  # Conv1D: x W with W stored (in, out)
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    heads = lambda t: t.reshape(B, T, n_head, Dh).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, C)
    x = x + (y @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"])
    h = _layer_norm(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
    m = _gelu_tanh(h @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
    return x + (m @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"])


def reference_logits(sd, ids, groups, steps, n_layer=L, n_head=H):
    """GPT-2 with each group's consecutive layers applied K_g times to their own output (no injection)."""
    T = ids.shape[1]
    x = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][torch.arange(T)]
    starts = {g[0]: (g, k) for g, k in zip(groups, steps)}
    i = 0
    while i < n_layer:
        if i in starts:
            group, k = starts[i]
            for _ in range(k):
                for j in group:
                    x = _block(sd, j, x, n_head)
            i = group[-1] + 1
        else:
            x = _block(sd, i, x, n_head)
            i += 1
    x = _layer_norm(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"])
    return x @ sd["transformer.wte.weight"].T


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(model, ids, steps=None, **kw):
    with torch.no_grad():
        return model(ids, steps, **kw)


# ---- (1) Hugging Face GPT-2 keys and shapes -----------------------------------------------------------

def test_keys_and_shapes_are_hugging_face_gpt2(gpt2):
    shapes = {k: tuple(v.shape) for k, v in gpt2.state_dict().items()}
    assert shapes == hf_gpt2_shapes(V, D, L, P)
    assert len(shapes) == 12 * L + 5
    # lm_head is wte: one tensor, counted once.
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert gpt2.state_dict()["lm_head.weight"].data_ptr() == gpt2.state_dict()["transformer.wte.weight"].data_ptr()
    assert "lm_head.weight" not in dict(gpt2.named_parameters())
    assert gpt2.num_parameters() == gpt2_parameter_count() == 81_536
    assert sum(gpt2.parameter_breakdown().values()) == gpt2.num_parameters()
    # Conv1D weights are stored (in, out): writing x @ W by hand must reproduce the module.
    c_fc = gpt2.transformer.h[0].mlp.c_fc
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(c_fc(x), x @ c_fc.weight + c_fc.bias, atol=1e-6, rtol=1e-6)


def test_untied_head_is_its_own_parameter():
    model = make_gpt2(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.num_parameters() == gpt2_parameter_count() + V * D
    assert model.parameter_breakdown()["lm_head"] == V * D


# ---- (2) the forward against the reference, and the stage view ----------------------------------------

@pytest.mark.parametrize("steps", [[1, 1, 1], [3, 4, 3], [2, 5, 1], [6, 1, 4], 2])
def test_forward_matches_reference(gpt2, steps):
    ids = random_ids(2, 11, V, seed=3)
    got = run(gpt2, ids, steps)
    per_group = steps if isinstance(steps, list) else [steps] * 3
    want = reference_logits(state(gpt2), ids, GROUPS, per_group)
    assert got.shape == (2, 11, V) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_forward_depth_is_per_group(gpt2):
    ids = random_ids(2, 9, V, seed=4)
    # Default steps are loop_steps.
    torch.testing.assert_close(run(gpt2, ids), run(gpt2, ids, STEPS), atol=0, rtol=0)
    torch.testing.assert_close(run(gpt2, ids), reference_logits(state(gpt2), ids, GROUPS, STEPS), atol=ATOL, rtol=0)
    # The reference (and the model) tell the groups apart: swapping two groups' depths changes the logits.
    a, b = run(gpt2, ids, [2, 5, 1]), run(gpt2, ids, [1, 5, 2])
    assert (a - b).abs().max() > 1e-2
    assert (a - reference_logits(state(gpt2), ids, GROUPS, [1, 5, 2])).abs().max() > 1e-2
    # ... and so does one more iteration of the middle group alone.
    assert (run(gpt2, ids, [2, 6, 1]) - a).abs().max() > 1e-2
    with pytest.raises(ValueError, match="3 loop groups"):
        run(gpt2, ids, [1, 2])


def test_forward_matches_reference_other_layout():
    """A group at layer 0, a group at the last layer, and a run of plain layers between them."""
    groups = [[0, 1], [5]]
    model = make_gpt2(seed=5, loop_groups=groups, loop_steps=[2, 3], max_loop_steps=[4, 3])
    assert [(s.name, type(s)) for s in model.stages()] == [("loop 0,1", LoopGroup), ("layers 2-4", Stage),
                                                          ("loop 5", LoopGroup)]
    ids = random_ids(3, 7, V, seed=6)
    for steps in ([1, 1], [2, 3], [4, 2]):
        torch.testing.assert_close(run(model, ids, steps), reference_logits(state(model), ids, groups, steps),
                                   atol=ATOL, rtol=0)


def test_stage_view(gpt2):
    stages = gpt2.stages()
    assert [(s.name, type(s)) for s in stages] == [("layer 0", Stage), ("loop 1", LoopGroup),
                                                   ("loop 2,3", LoopGroup), ("loop 4", LoopGroup),
                                                   ("layer 5", Stage)]
    assert [s.attn_layers for s in stages] == [[0], [1], [2, 3], [4], [5]]
    groups = gpt2.loop_groups()
    assert groups == stages[1:4]
    assert [g.n_layers for g in groups] == [1, 2, 1]
    assert [g.default_steps for g in groups] == STEPS
    assert [g.max_steps for g in groups] == MAX_STEPS
    assert not any(g.random_init for g in groups)
    assert gpt2.layer_split() == {"layer 0": 1, "loop 1": 1, "loop 2,3": 2, "loop 4": 1, "layer 5": 1}
    # A group starts from its input (no injection, no noise) and hands back its last state.
    x = torch.randn(1, 3, D)
    assert torch.equal(groups[1].init(x, None), x) and torch.equal(groups[1].finish(x), x)

    plain = make_gpt2(loop_groups=[[2, 3]], loop_steps=[2], max_loop_steps=None)
    assert [s.name for s in plain.stages()] == ["layers 0-1", "loop 2,3", "layers 4-5"]
    assert plain.loop_groups()[0].max_steps == 4  # max_loop_steps defaults to 2 · loop_steps
    assert LoopedGPT2Config(vocab_size=V, n_layer=L, loop_groups=[[1], [3]]).loop_steps == [1, 1]


# ---- (3) cached incremental decoding ------------------------------------------------------------------

@pytest.mark.parametrize("steps", [[3, 4, 3], [2, 7, 5], [6, 8, 6], [1, 1, 1]])
def test_cached_decoding_equals_whole_sequence(gpt2, steps):
    ids = random_ids(2, 13, V, seed=8)
    whole = run(gpt2, ids, steps)
    cache = gpt2.new_cache(2, 4)  # grows as positions arrive
    chunks, start = [], 0
    for end in (3, 4, 5, 9, 13):  # a prefill chunk, single tokens, longer chunks
        chunks.append(run(gpt2, ids[:, start:end], steps, cache=cache, start=start))
        start = end
    torch.testing.assert_close(torch.cat(chunks, 1), whole, atol=ATOL, rtol=0)
    # A cache with exactly `steps` slots per group works too; one slot short does not.
    tight = gpt2.new_cache(2, 13, max_steps=steps)
    first = run(gpt2, ids[:, :6], steps, cache=tight)
    rest = run(gpt2, ids[:, 6:], steps, cache=tight, start=6)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="cache slots"):
        run(gpt2, ids[:, :2], [s + 1 for s in steps], cache=gpt2.new_cache(2, 13, max_steps=steps))


def test_cache_slots_follow_groups(gpt2):
    cache = gpt2.new_cache(1, 8)
    assert cache.slots == {0: 1, 1: 6, 2: 8, 3: 8, 4: 6, 5: 1}
    assert (cache.n_heads, cache.head_dim) == (H, D // H)
    with pytest.raises(ValueError, match="context"):
        gpt2.embed(torch.zeros(1, 2, dtype=torch.long), start=P - 1)


# ---- (4) checkpoints ----------------------------------------------------------------------------------

def read_dir_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_checkpoint_round_trip(tmp_path, gpt2):
    path = save_checkpoint(gpt2, tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "looped_gpt2"
    assert config["architectures"] == ["LoopedGPT2LMHeadModel"]
    assert (config["loop_groups"], config["loop_steps"], config["max_loop_steps"]) == (GROUPS, STEPS, MAX_STEPS)
    assert (config["n_embd"], config["n_head"], config["n_layer"], config["n_positions"]) == (D, H, L, P)
    on_disk = read_dir_tensors(path)
    assert {k: tuple(v.shape) for k, v in on_disk.items()} == hf_gpt2_shapes(V, D, L, P)
    assert torch.equal(on_disk["lm_head.weight"], on_disk["transformer.wte.weight"])

    ck = load_checkpoint(path)
    loaded = ck.model
    assert isinstance(loaded, LoopedGPT2) and ck.tokenizer is None
    want, got = gpt2.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert [s.name for s in loaded.stages()] == [s.name for s in gpt2.stages()]
    assert [g.max_steps for g in loaded.loop_groups()] == MAX_STEPS
    ids = random_ids(2, 10, V, seed=9)
    for steps in ([1, 2, 3], None):
        assert torch.equal(run(loaded, ids, steps), run(gpt2, ids, steps))
    # Another model's checkpoint does not give the same logits (guards the comparison).
    other = load_checkpoint(save_checkpoint(make_gpt2(seed=1), tmp_path / "other")).model
    assert (run(other, ids) - run(gpt2, ids)).abs().max() > 1e-2


def hf_config(**extra) -> dict:
    """A config.json in the style of Hugging Face's gpt2, tiny, with fields exitbench does not use."""
    config = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
              "bos_token_id": V - 1, "embd_pdrop": 0.1, "eos_token_id": V - 1, "initializer_range": 0.02,
              "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": P, "n_embd": D, "n_head": H,
              "n_inner": None, "n_layer": L, "n_positions": P, "resid_pdrop": 0.1,
              "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
              "summary_type": "cls_index", "summary_use_proj": True,
              "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
              "vocab_size": V}
    config.update(extra)
    return config


def write_hf_dir(path: Path, model: LoopedGPT2, config: dict, prefix: str = "", with_head: bool = False) -> Path:
    """GPT-2 as published: GPT2Model keys (no `transformer.`), stored causal-mask buffers, no lm_head."""
    path.mkdir()
    tensors = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        tensors[prefix + key.removeprefix("transformer.")] = t.detach().clone().contiguous()
    mask = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
    for i in range(L):
        tensors[f"{prefix}h.{i}.attn.bias"] = mask.clone()
        tensors[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if with_head:
        tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("layout", ["gpt2_model", "lm_head_model"])
def test_hugging_face_gpt2_directory(tmp_path, gpt2, layout):
    config = hf_config(loop_groups=GROUPS, loop_steps=STEPS, max_loop_steps=MAX_STEPS)
    if layout == "gpt2_model":  # GPT2Model keys, e.g. h.0.attn.c_attn.weight, wte.weight; no lm_head
        path = write_hf_dir(tmp_path / "hf", gpt2, config)
        keys = set(read_dir_tensors(path))
        assert {"wte.weight", "h.0.attn.c_attn.weight", "h.5.attn.bias", "ln_f.bias"} <= keys
        assert not any(k.startswith("transformer.") or k == "lm_head.weight" for k in keys)
    else:  # GPT2LMHeadModel keys with the duplicate head, and no model_type: found by its class name
        del config["model_type"]
        path = write_hf_dir(tmp_path / "hf", gpt2, config, prefix="transformer.", with_head=True)
    ck = load_checkpoint(path)
    model = ck.model
    assert isinstance(model, LoopedGPT2) and model.architecture == "looped_gpt2"
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config.extra["attn_pdrop"] == 0.1
    assert [g.default_steps for g in model.loop_groups()] == STEPS
    for key, t in gpt2.state_dict().items():
        assert torch.equal(model.state_dict()[key], t), key
    ids = random_ids(2, 12, V, seed=10)
    for steps in ([1, 1, 1], [2, 6, 3], None):
        torch.testing.assert_close(run(model, ids, steps), run(gpt2, ids, steps), atol=1e-6, rtol=0)


def test_hugging_face_gpt2_without_loop_groups_fails(tmp_path, gpt2):
    path = write_hf_dir(tmp_path / "hf", gpt2, hf_config())
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    msg = str(err.value)
    assert "loop_groups" in msg and "\n" not in msg


# ---- (5) bad configs ----------------------------------------------------------------------------------

BAD_CONFIGS = {
    # name: (overrides of the tiny config, words the one-line error must contain)
    "empty-loop-groups": (dict(loop_groups=[], loop_steps=None, max_loop_steps=None), ["loop_groups"]),
    "not-consecutive": (dict(loop_groups=[[2, 4]], loop_steps=None, max_loop_steps=None),
                        ["[2, 4]", "consecutive"]),
    "descending": (dict(loop_groups=[[3, 2]], loop_steps=None, max_loop_steps=None), ["[3, 2]", "consecutive"]),
    "empty-group": (dict(loop_groups=[[1], []], loop_steps=None, max_loop_steps=None), ["[]", "consecutive"]),
    "overlapping": (dict(loop_groups=[[1, 2], [2, 3]], loop_steps=None, max_loop_steps=None),
                    ["[2, 3]", "overlap"]),
    "out-of-order": (dict(loop_groups=[[3], [1]], loop_steps=None, max_loop_steps=None), ["[1]", "layer order"]),
    "layer-too-large": (dict(loop_groups=[[1], [5, 6]], loop_steps=None, max_loop_steps=None),
                        ["[5, 6]", "layer 6", "n_layer=6"]),
    "loop-steps-too-short": (dict(loop_steps=[3, 4], max_loop_steps=None), ["loop_steps", "[3, 4]"]),
    "loop-steps-too-long": (dict(loop_steps=[3, 4, 3, 1]), ["loop_steps", "[3, 4, 3, 1]"]),
    "loop-steps-zero": (dict(loop_steps=[3, 0, 3], max_loop_steps=[6, 8, 6]), ["loop_steps", "[3, 0, 3]"]),
    "max-steps-wrong-length": (dict(max_loop_steps=[6, 8]), ["max_loop_steps", "[6, 8]"]),
    "max-below-default": (dict(max_loop_steps=[6, 3, 6]), ["max_loop_steps 3", "loop_steps 4", "[2, 3]"]),
    "heads-do-not-split": (dict(n_head=5), ["n_embd=32", "n_head=5"]),
    "unknown-activation": (dict(activation_function="swish"), ["activation_function", "swish"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_one_line(case):
    overrides, words = BAD_CONFIGS[case]
    with pytest.raises(CheckpointError) as err:
        gpt2_config(**overrides)
    msg = str(err.value)
    assert "\n" not in msg and msg
    for word in words:
        assert word in msg, (word, msg)


@pytest.mark.parametrize("case", ["not-consecutive", "layer-too-large", "max-below-default"])
def test_bad_config_json_one_line(tmp_path, gpt2, case):
    path = save_checkpoint(gpt2, tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    config.update({k: v for k, v in BAD_CONFIGS[case][0].items()})
    config = {k: v for k, v in config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in BAD_CONFIGS[case][1])


@pytest.mark.parametrize("overrides", [dict(loop_steps=3, max_loop_steps=None), dict(loop_groups=5)],
                         ids=["scalar-loop-steps", "scalar-loop-groups"])
def test_scalar_loop_fields_fail_with_one_line(overrides):
    with pytest.raises(CheckpointError):
        gpt2_config(**overrides)


# ---- (6) through the exit engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def requests_16():
    reqs = mixed_requests(16, vocab=V)
    assert len({len(t) for t, _ in reqs}) >= 4 and len({n for _, n in reqs}) >= 4
    return reqs


def _steps(results):
    return [[rec.exit_steps for rec in r.records] for r in results]


def _close(a, b, tol=LOGP_TOL):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def _plain_logprobs(model, tokens, n_ctx, steps):
    logp = torch.log_softmax(run(model, torch.tensor([tokens]), steps)[0].double(), -1)
    return [float(logp[p, tokens[p + 1]]) for p in range(n_ctx - 1, len(tokens) - 1)]


@pytest.mark.parametrize("r", [1, 3, 6])
def test_fixed_equals_plain_forward(gpt2, requests_16, r):
    results = ExitEngine(gpt2, ExitConfig(policy="fixed", threshold=r)).score(requests_16)
    for (tokens, n_ctx), res in zip(requests_16, results):
        assert res.tokens == tokens[n_ctx:]
        assert [rec.position for rec in res.records] == list(range(n_ctx - 1, len(tokens) - 1))
        assert all(rec.exit_steps == [r, r, r] for rec in res.records)
        want = _plain_logprobs(gpt2, tokens, n_ctx, r)
        assert _close(res.logprobs, want), (r, res.logprobs, want)


def test_fixed_without_threshold_runs_each_groups_default(gpt2, requests_16):
    results = ExitEngine(gpt2, ExitConfig(policy="fixed")).score(requests_16)
    for (tokens, n_ctx), res in zip(requests_16, results):
        assert all(rec.exit_steps == STEPS for rec in res.records)
        assert _close(res.logprobs, _plain_logprobs(gpt2, tokens, n_ctx, STEPS))
    # Fixed depth beyond a group's configured maximum (6 for the first group) is refused.
    with pytest.raises(ExitbenchError, match="maximum"):
        ExitEngine(gpt2, ExitConfig(policy="fixed", threshold=7))


ENGINE_MAX = 6  # max_steps for the tuned runs: at most every group's max_loop_steps


def _never(cls) -> float:
    """A threshold the signal never passes, so the recorded run shows whole trajectories."""
    if cls.exits_below:
        return 1e-30
    if cls.integer_threshold:
        return 1000.0
    return 1e9 if cls.name == "margin" else 1.0  # (a margin is a gap of log-probabilities, not a probability)


def _spread_threshold(model, requests, policy: str) -> float:
    """From a recorded run that never exits, a threshold under which the three groups' trajectories exit at as
    many different (group, step) pairs as possible, in a gap of ≥ 2 % between observed signal values (far
    from float32 noise, so batching cannot flip an exit)."""
    cls = REGISTRY[policy]
    if cls.retrospective:
        return cls.default_threshold
    if cls.signal_free:
        return 3.0
    if cls.takes_rules:  # a conjunction's τ is its varied rule's, spread as that rule's is
        return _spread_threshold(model, requests, varied(policy))
    probe = ExitEngine(model, ExitConfig(policy=policy, threshold=_never(cls), max_steps=ENGINE_MAX,
                                         **knobs_for(policy),
                                         record_signals=True)).score(requests)
    sigs = [(g, np.asarray(rec.signals[g], dtype=np.float64)) for r in probe for rec in r.records
            for g in range(3)]
    assert all(len(s) == ENGINE_MAX and np.isnan(s).sum() == 0 for _, s in sigs)
    if cls.integer_threshold:
        candidates = [float(t) for t in range(1, ENGINE_MAX)]
    else:
        vals = np.unique(np.concatenate([s[np.isfinite(s)] for _, s in sigs]))
        vals = vals[vals > 1e-6]
        candidates = [math.sqrt(a * b) for a, b in zip(vals[:-1], vals[1:]) if b > 1.02 * a]
        if policy == "learned":  # risks are probabilities packed densely (here 0.87-0.95 over 800 values): an
            # absolute gap, 5x the batch-shape noise measured on the learned rule (3.6e-5, test_policies)
            candidates = [(a + b) / 2 for a, b in zip(vals[:-1], vals[1:]) if b - a > 2e-4]
    best, best_score = None, -1
    for tau in candidates:
        score = len({(g, expected_exit(s, tau, not cls.exits_below, 1, cls.default_patience, ENGINE_MAX))
                     for g, s in sigs})
        if score > best_score:
            best, best_score = tau, score
    return best


def _check_batched_equals_single(model, requests, config_kwargs):
    config_kwargs = {**knobs_for(config_kwargs["policy"]), **config_kwargs}
    batched = ExitEngine(model, ExitConfig(**config_kwargs)).score(requests)
    single = [ExitEngine(model, ExitConfig(**config_kwargs)).score([req])[0] for req in requests]
    assert _steps(batched) == _steps(single)
    for (tokens, n_ctx), b, s in zip(requests, batched, single):
        assert b.tokens == s.tokens == tokens[n_ctx:]
        assert len(b.records) == len(tokens) - n_ctx
        assert _close(b.logprobs, s.logprobs), (b.logprobs, s.logprobs)
    return batched


def _replay(model, tokens, n_ctx, exits, M):
    """The documented computation behind one scored sequence, given the engine's recorded exits: the prefix at
    depth M in every group, then each scored position alone at its own per-group depths, and after it, in each
    group it left early, its KV entries at the exit iteration copied into the slots above (by direct indexing).
    Returns the teacher-forced log-probs."""
    return [float(logp[tokens[pos + 1]]) for pos, logp in
            zip(range(n_ctx - 1, len(tokens) - 1), _replay_distributions(model, tokens, n_ctx, exits, M))]


def _replay_distributions(model, tokens, n_ctx, exits, M):
    """`_replay`'s whole next-token log-distributions, one per scored position that `exits` names."""
    groups = model.loop_groups()
    cache = model.new_cache(1, len(tokens), [M] * len(groups))
    ids = torch.tensor([tokens])
    if n_ctx > 1:
        run(model, ids[:, :n_ctx - 1], [M] * len(groups), cache=cache)
    out = []
    for j, pos in enumerate(range(n_ctx - 1, n_ctx - 1 + len(exits))):
        out.append(torch.log_softmax(run(model, ids[:, pos:pos + 1], exits[j], cache=cache, start=pos)[0, 0].double(), -1))
        for group, e in zip(groups, exits[j]):
            for layer in group.attn_layers:
                for store in (cache.k, cache.v):
                    store[layer][e:, 0, pos] = store[layer][e - 1, 0, pos].clone()  # (slots, batch, positions, H, D)
    return out


LATENT = {"first_order", "second_order", "second_order_magnitude", "cosine"}


# Fast: a latent rule; every other rule, decoding, counting and retrospective, with the slow tests (2-6 s each on
# three loop groups). The decoding probe through later groups stays fast in
# test_kl_probe_reads_out_later_groups_at_default_depth, every rule's batching on one loop group in test_engine.
FAST_KINDS = {"second_order"}


@pytest.mark.parametrize("policy", [p if p in FAST_KINDS else pytest.param(p, marks=pytest.mark.slow)
                                    for p in REGISTRY if not REGISTRY[p].needs_gate and not REGISTRY[p].drafts])
def test_every_policy_batched_equals_one_at_a_time(gpt2, requests_16, policy):
    cls = REGISTRY[policy]
    tau = _spread_threshold(gpt2, requests_16, policy)
    # Tuned threshold, every group capped at ENGINE_MAX iterations.
    batched = _check_batched_equals_single(gpt2, requests_16, dict(policy=policy, threshold=tau,
                                                                   max_steps=ENGINE_MAX))
    exits = [rec.exit_steps for r in batched for rec in r.records]
    assert all(len(e) == 3 and all(1 <= k <= ENGINE_MAX for k in e) for e in exits)
    if policy == "fixed":
        assert all(e == [3, 3, 3] for e in exits)
    else:
        pairs = {(g, e[g]) for e in exits for g in range(3)}
        varying_groups = [g for g in range(3) if len({e[g] for e in exits}) >= 2]
        early = sum(k < ENGINE_MAX for e in exits for k in e)
        assert early > 0, f"{policy}: no token exits before {ENGINE_MAX} at τ={tau}: {exits}"
        assert varying_groups, f"{policy}: exits do not vary across tokens at τ={tau}: {exits}"
        if policy == "prefill_random":  # its draw is the sequence's, the same positions kept in every group
            assert all(len(set(e)) == 1 for e in exits), f"{policy}: a group drew other positions: {exits}"
        else:
            assert any(len(set(e)) > 1 for e in exits), f"{policy}: groups always exit together: {exits}"
        if policy in LATENT or cls.needs_logits:
            assert len(pairs) >= 4, f"{policy}: too few distinct per-group exits at τ={tau}: {sorted(pairs)}"
    # The recorded per-group exits are the depths each token really ran: replaying them reproduces the scores. (Not
    # under a budget over positions: its prompt positions exit too, and no record holds their exits.)
    for (tokens, n_ctx), res in zip(requests_16, [] if cls.ranks_positions else batched):
        depth = int(tau) if cls.signal_free else ENGINE_MAX  # fixed r binds every group's maximum to r
        want = _replay(gpt2, tokens, n_ctx, [rec.exit_steps for rec in res.records], depth)
        assert _close(res.logprobs, want), (policy, res.logprobs, want)
    # The policy's default threshold, each group capped at its own default depth (3, 4, 3).
    batched = _check_batched_equals_single(gpt2, requests_16, dict(policy=policy))
    for r in batched:
        for rec in r.records:
            assert len(rec.exit_steps) == 3
            assert all(1 <= k <= m for k, m in zip(rec.exit_steps, STEPS)), rec.exit_steps


def test_kl_probe_reads_out_later_groups_at_default_depth(gpt2, requests_16):
    """The KL signal of group g after iteration k compares readouts that finish the earlier groups at their
    exits, group g at k (and k−1; p_0 uniform) and the later groups at their default depth, i.e. plain
    forwards at num_steps = [e_0, …, k, defaults …] (first position of a sequence: no cache involved)."""
    tau = _spread_threshold(gpt2, requests_16, "kl")
    reqs = [(t[:2], 1) for t, _ in requests_16[:8]]
    results = ExitEngine(gpt2, ExitConfig(policy="kl", threshold=tau, max_steps=ENGINE_MAX,
                                          record_signals=True)).score(reqs)
    uniform = torch.full((V,), -math.log(V), dtype=torch.float64)
    checked = 0
    for (tokens, _), res in zip(reqs, results):
        (rec,) = res.records
        ids = torch.tensor([tokens[:1]])
        for g, e in enumerate(rec.exit_steps):
            sig = rec.signals[g]
            assert all(math.isnan(v) for v in sig[e:]) and not any(math.isnan(v) for v in sig[:e])
            prev = uniform
            for k in range(1, e + 1):
                steps = rec.exit_steps[:g] + [k] + STEPS[g + 1:]
                lp = torch.log_softmax(run(gpt2, ids, steps)[0, 0].double(), -1)
                want = float((prev.exp() * (prev - lp)).sum())
                assert sig[k - 1] == pytest.approx(want, rel=1e-4, abs=1e-7), (g, k, sig, want)
                prev = lp
                checked += 1
    assert checked > 8 * 3


def _probe_signals(model, tokens, n_ctx, exits, g, M):
    """The KL signals of group g at every scored position, from plain forwards at given depths, under the rule
    of engine/probe_cache.py: the readout of position j after iteration m reads, in the stages after group g,
    each earlier position's entries as that position's own readout left them after iteration min(m, its exit)
    (the prefix's as the prefill left them), and in group g and before it the run's entries (the `latest` rule).
    Kept per iteration m: a cache whose later layers hold every position's readout entries of iteration m."""
    groups = model.loop_groups()
    later = [layer for st in model.stages()[model.stages().index(groups[g]) + 1:] for layer in st.attn_layers]
    run_cache = model.new_cache(1, len(tokens), [M] * len(groups))
    ids = torch.tensor([tokens])
    run(model, ids[:, :n_ctx - 1], [M] * len(groups), cache=run_cache)
    probes = {m: copy.deepcopy(run_cache) for m in range(1, M + 1)}
    uniform = torch.full((V,), -math.log(V), dtype=torch.float64)
    signals = []
    for j, pos in enumerate(range(n_ctx - 1, n_ctx - 1 + len(exits))):
        e, prev, mine = exits[j], uniform, []
        for m in range(1, e[g] + 1):
            cache = copy.deepcopy(probes[m])
            for layer in set(run_cache.k) - set(later):  # group g and before: the run's entries
                cache.k[layer], cache.v[layer] = run_cache.k[layer].clone(), run_cache.v[layer].clone()
            logits = run(model, ids[:, pos:pos + 1], e[:g] + [m] + STEPS[g + 1:], cache=cache, start=pos)[0, 0]
            lp = torch.log_softmax(logits.double(), -1)
            mine.append(float((prev.exp() * (prev - lp)).sum()))
            prev = lp
            for layer in later:  # this position's readout entries of iteration m, and above it once it exits
                for depth in range(m, M + 1) if m == e[g] else (m,):
                    for ours, theirs in ((probes[depth].k, cache.k), (probes[depth].v, cache.v)):
                        ours[layer][:, 0, pos] = theirs[layer][:, 0, pos]
        signals.append(mine)
        run(model, ids[:, pos:pos + 1], e, cache=run_cache, start=pos)
        for group, x in zip(groups, e):
            for layer in group.attn_layers:
                for store in (run_cache.k, run_cache.v):
                    store[layer][x:, 0, pos] = store[layer][x - 1, 0, pos].clone()
    return signals


@pytest.mark.parametrize("schedule", ["depth_major", "token_major"])
def test_a_probe_reads_earlier_positions_as_their_own_readouts_left_them(gpt2, requests_16, schedule):
    """Scoring, the KL signal of position t in loop group g after iteration k reads out through the later
    groups reading each earlier scored position's entries of its own readout after iteration min(k, its exit):
    computed here from plain forwards (`_probe_signals`), against both schedules, where exits spread."""
    tokens, n_ctx = next((t[:9], 3) for t, _ in requests_16 if len(t) >= 9)

    def score(tau):
        config = ExitConfig(policy="kl", threshold=tau, max_steps=ENGINE_MAX, record_signals=True)
        return ExitEngine(gpt2, config, schedule=schedule).score([(tokens, n_ctx)])[0]
    # τ at the median of the earlier groups' signals of this sequence: their positions exit apart
    never = score(1e-30)
    tau = float(np.median([v for rec in never.records for g in (0, 1) for v in rec.signals[g]]))
    res = score(tau)
    exits = [rec.exit_steps for rec in res.records]
    assert len({e[0] for e in exits}) > 1 and len({e[1] for e in exits}) > 1, exits
    for g in range(3):
        want = _probe_signals(gpt2, tokens, n_ctx, exits, g, ENGINE_MAX)
        for rec, signal in zip(res.records, want):
            got = rec.signals[g][:len(signal)]
            assert got == pytest.approx(signal, rel=1e-4, abs=1e-7), (g, got, signal)


def test_a_decoding_rules_cells_through_later_groups_are_keyed_apart(gpt2):
    """Cells scored before issue 45 read earlier positions' final outputs in such a readout: a decoding rule's
    cell on a model whose readout attends is keyed apart from them; every other cell keeps its id."""
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.keys import cell_key, readout_attends

    from exitbench.models.checkpoint import open_checkpoint

    # three loop groups, a Huginn-layout coda: the readout attends; the embedded tiny-raven has no coda
    assert readout_attends(gpt2) and readout_attends(make_tiny_raven())
    assert not readout_attends(open_checkpoint("tiny-raven").model)
    cfg = SweepConfig(tasks=["chains"], policies=["kl"])
    key = lambda model, c: cell_key(model, "chains", "t", c, cfg, "cpu")  # noqa: E731
    plain, attends = {"fingerprint": "f", "dtype": "float32"}, {"fingerprint": "f", "dtype": "float32",
                                                                "readout_attends": True}
    assert key(attends, ExitConfig("kl"))["probe"] == "own_readouts" and "probe" not in key(plain, ExitConfig("kl"))
    for latent in (ExitConfig("second_order"), ExitConfig("fixed", threshold=3)):
        assert key(attends, latent) == key(plain, latent)


def test_policy_max_steps_below_later_groups_default(gpt2, requests_16):
    """A latent rule capped below the later groups' default depth runs fine: the cap is per group."""
    results = ExitEngine(gpt2, ExitConfig(policy="first_order", threshold=1e-30, max_steps=2)).score(requests_16)
    assert all(rec.exit_steps == [2, 2, 2] for r in results for rec in r.records)
    for (tokens, n_ctx), res in zip(requests_16, results):
        assert _close(res.logprobs, _plain_logprobs(gpt2, tokens, n_ctx, 2))


@pytest.mark.parametrize("policy", ["kl", "oracle"])
def test_distribution_policy_max_steps_below_later_groups_default(gpt2, requests_16, policy):
    """max_steps=2 is within every group's maximum, so it must either run (exits ≤ 2) or be refused in one line;
    today the probe's readout runs group 2,3 for its default 4 iterations into a 2-slot cache: IndexError."""
    try:
        results = ExitEngine(gpt2, ExitConfig(policy=policy, max_steps=2)).score(requests_16[:2])
    except ExitbenchError as exc:
        assert "\n" not in str(exc) and "max_steps" in str(exc)
        return
    assert all(1 <= k <= 2 for r in results for rec in r.records for k in rec.exit_steps)


# ---- (7) exitbench info -------------------------------------------------------------------------------

def test_info_json(tmp_path, gpt2):
    path = save_checkpoint(gpt2, tmp_path / "ck")
    res = CliRunner().invoke(app, ["info", "--checkpoint", str(path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["architecture"] == "looped_gpt2"
    assert report["parameters"] == gpt2.num_parameters() == gpt2_parameter_count()
    assert sum(report["parameter_breakdown"].values()) == report["parameters"]
    assert (report["hidden_size"], report["heads"], report["context"]) == (D, H, P)
    assert report["layers"] == {"layer 0": 1, "loop 1": 1, "loop 2,3": 2, "loop 4": 1, "layer 5": 1}
    assert report["loop_groups"] == [
        {"name": "loop 1", "layers": 1, "default_steps": 3, "max_steps": 6, "random_init": False},
        {"name": "loop 2,3", "layers": 2, "default_steps": 4, "max_steps": 8, "random_init": False},
        {"name": "loop 4", "layers": 1, "default_steps": 3, "max_steps": 6, "random_init": False},
    ]
    assert report["weights"] == "model.safetensors" and report["tokenizer"] is None


def test_info_gpt2_without_loop_groups_one_line(tmp_path, gpt2):
    path = write_hf_dir(tmp_path / "hf", gpt2, hf_config())
    res = CliRunner().invoke(app, ["info", "--checkpoint", str(path), "--json"])
    assert_one_line_error(res, ["loop_groups"])


# ---- FLOPs per token: later groups read out at their default depth ----------------------------------------------

def test_flops_count_each_later_group_at_its_readout_depth(gpt2):
    """Per token: a block costs 2·12d² (c_attn, c_proj, c_fc, c_proj) + 4·context·d (attention), the head 2·V·d;
    a probe of group g runs every later stage, a later loop group at its default depth."""
    eng = ExitEngine(gpt2, ExitConfig(policy="kl", threshold=1e-3))
    [res] = eng.score([(list(range(5, 25)), 3)])
    head = 2.0 * V * D
    for rec in res.records:
        ctx = rec.position + 1
        block = 24.0 * D * D + 4.0 * ctx * D
        e0, e1, e2 = rec.exit_steps
        readout = [2 * block * STEPS[1] + block * STEPS[2] + block + head,  # after loop 1: loops 2,3 and 4, layer 5
                   block * STEPS[2] + block + head,                        # after loop 2,3
                   block + head]                                           # after loop 4
        assert rec.flops["prelude"] == pytest.approx(block, rel=1e-12)
        assert rec.flops["core"] == pytest.approx((e0 + 2 * e1 + e2) * block, rel=1e-12)
        assert rec.flops["probe"] == pytest.approx(e0 * readout[0] + e1 * readout[1] + e2 * readout[2], rel=1e-12)
        assert rec.flops["coda"] == pytest.approx(block + head, rel=1e-12)
    # Latent rules read no logits: no probe FLOPs at all.
    [res] = ExitEngine(gpt2, ExitConfig(policy="second_order", threshold=1e-3)).score([(list(range(5, 25)), 3)])
    assert all(rec.flops["probe"] == 0 for rec in res.records)


# ---- the embedded tiny-looped-gpt2 ---------------------------------------------------------------------------

@pytest.mark.slow  # 27 s: twelve policies, each batched and one request at a time, on the shipped model; the
# same property on the random model (test_every_policy_batched_equals_one_at_a_time) stays fast
def test_embedded_looped_gpt2_every_policy_batched_equals_one_at_a_time():
    """On the shipped model and real GSM8K text, with thresholds where exits differ per token and per group.

    Its residual stream grows to norms of ~35 over the loops, so float32 rounding that depends on the batch
    shape reaches ~1e-5 in a log-probability; exits must be identical, log-probabilities within 5e-5.
    """
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint("tiny-looped-gpt2")
    text = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
            "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per egg.")
    ids = ck.tokenizer.encode(text, add_bos=True)
    requests = [(ids[: 12 + 5 * i], 1 + 2 * i) for i in range(5)]
    thresholds = {"kl": 1e-3, "minp_kl": 1e-4, "entropy_diff": 1e-2, "argmax_stability": 2, "confidence": 0.3,
                  "first_order": 1.0, "second_order": 0.5, "second_order_magnitude": 0.1, "cosine": 1e-3,
                  "learned": 0.883, "oracle": None, "fixed": 4,  # learned: mid-gap (0.8824-0.8836) of its risks here
                  "margin": 1.0, "contraction": 0.1, "all_of": 0.5,  # (all_of: second_order's τ, margin ≥ 0.01 beside)
                  "prefill_topk": 0.25, "prefill_random": 0.25}
    # (no gate on GPT-2; speculation is no per-token exit: tests/test_speculation.py)
    assert set(thresholds) == {n for n, c in REGISTRY.items() if not c.needs_gate and not c.drafts}
    for name, tau in thresholds.items():
        cfg = ExitConfig(policy=name, threshold=tau, **knobs_for(name))
        batched = ExitEngine(ck.model, cfg).score(requests)
        single = [ExitEngine(ck.model, cfg).score([r])[0] for r in requests]
        steps = [rec.exit_steps for res in batched for rec in res.records]
        assert steps == [rec.exit_steps for res in single for rec in res.records], name
        assert all(len(s) == 3 and all(1 <= k <= 6 for k in s) for s in steps), name
        for a, b in zip(batched, single):
            assert a.logprobs == pytest.approx(b.logprobs, abs=5e-5), name
        if name not in ("fixed", "argmax_stability"):
            assert len({tuple(s) for s in steps}) > 1, f"{name}: every token exited alike; pick another threshold"
