"""Checkpoint directories in Huginn's layout: save, load, shards, dtypes, atomic writes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exitbench.errors import CheckpointError
from exitbench.models import Raven, load_checkpoint, save_checkpoint

from helpers.files import listing
from helpers.models import SHARD_BYTES, make_tiny_raven, random_ids

INDEX = "model.safetensors.index.json"


def read_dir_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = fh.get_tensor(key)
    return out


def expected_keys(model: Raven) -> dict[str, tuple[int, ...]]:
    c = model.config
    h, H, D, I, V = c.n_embd, c.n_heads, c.head_dim, c.intermediate_size, c.padded_vocab_size
    keys = {"transformer.wte.weight": (V, h), "lm_head.weight": (V, h),
            "freqs_cis": (1, c.block_size, 1, D // 2, 2), "transformer.adapter.weight": (h, 2 * h),
            "transformer.ln_f.weight": (h,)}
    prefixes = [f"transformer.prelude.{i}" for i in range(2)] + \
               [f"transformer.core_block.{i}" for i in range(4)] + [f"transformer.coda.{i}" for i in range(2)]
    for p in prefixes:
        keys.update({f"{p}.norm_{n}.weight": (h,) for n in range(1, 5)})
        keys.update({f"{p}.attn.Wqkv.weight": (3 * h, h), f"{p}.attn.qk_bias": (2, 1, H, D),
                     f"{p}.attn.proj.weight": (h, h), f"{p}.mlp.fc.weight": (2 * I, h),
                     f"{p}.mlp.proj.weight": (h, I)})
    return keys


def logits(model: Raven, ids: torch.Tensor, r: int = 3) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, r)


# ---- round trips -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip_float32(tmp_path, tiny_raven, tiny_tokenizer, sharded):
    path = save_checkpoint(tiny_raven, tmp_path / "ck", tokenizer=tiny_tokenizer,
                           max_shard_bytes=SHARD_BYTES if sharded else None)
    names = set(p.name for p in path.iterdir())
    if sharded:
        assert INDEX in names and "model.safetensors" not in names
        assert len([n for n in names if n.endswith(".safetensors")]) >= 2
    else:
        assert "model.safetensors" in names and INDEX not in names
    assert {"config.json", "tokenizer.json"} <= names

    ck = load_checkpoint(path)
    assert ck.dtype == "float32"
    assert ck.model.dtype == torch.float32
    assert ck.model.lm_head.weight is ck.model.transformer.wte.weight
    ids = random_ids(2, 10)
    for r in (1, 4):
        assert torch.equal(logits(ck.model, ids, r), logits(tiny_raven, ids, r))
    assert ck.tokenizer is not None
    assert ck.tokenizer.encode("the cat sat", add_bos=True) == [0, 4, 5, 6]
    assert ck.tokenizer.special_tokens() == {"bos": (0, "<|begin_text|>"), "eos": (1, "<|end_text|>"),
                                             "pad": (2, "<|pad|>")}
    assert ck.model.config.mean_recurrence == 4 and ck.model.config.init_scale == 0.0


def test_round_trip_distinguishes_models(tmp_path):
    """Guards the round trip: another model's checkpoint must not give the same logits."""
    a, b = make_tiny_raven(seed=0), make_tiny_raven(seed=1)
    ck = load_checkpoint(save_checkpoint(b, tmp_path / "b"))
    ids = random_ids(1, 8)
    assert not torch.allclose(logits(ck.model, ids), logits(a, ids), atol=1e-3)


def test_on_disk_keys_are_huginns_77(tiny_checkpoint, tiny_raven):
    tensors = read_dir_tensors(tiny_checkpoint)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert len(shapes) == 77
    assert shapes == expected_keys(tiny_raven)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    # The duplicate head equals the embedding; freqs_cis is the (cos, sin) table of adjacent-pair RoPE.
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    c = tiny_raven.config
    pos, i = 17, 3
    angle = pos * c.rope_base ** (-2 * i / c.head_dim)
    assert tensors["freqs_cis"][0, pos, 0, i, 0].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert tensors["freqs_cis"][0, pos, 0, i, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)

    index = json.loads((tiny_checkpoint / INDEX).read_text())
    assert set(index["weight_map"]) == set(shapes)
    assert set(index["weight_map"].values()) == {p.name for p in tiny_checkpoint.glob("*.safetensors")}
    for key, shard in index["weight_map"].items():
        with safe_open(str(tiny_checkpoint / shard), framework="pt") as fh:
            assert key in fh.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model_type"] == "huginn_raven"
    assert config["architectures"] == ["RavenForCausalLM"]
    assert config["n_embd"] == config["hidden_size"] == 32
    assert config["torch_dtype"] == "float32"


def test_single_file_has_77_keys(tmp_path, tiny_raven):
    path = save_checkpoint(tiny_raven, tmp_path / "single")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert {k: tuple(v.shape) for k, v in read_dir_tensors(path).items()} == expected_keys(tiny_raven)


# ---- a checkpoint written by hand in Huginn's layout --------------------------------------------------

def test_hand_written_huginn_layout(tmp_path, tiny_raven):
    c = tiny_raven.config
    state = {k: v.detach().clone().contiguous() for k, v in tiny_raven.named_parameters()}
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # Huginn's duplicate copy
    D = c.head_dim
    inv = 1.0 / (c.rope_base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(c.block_size, dtype=torch.float64), inv)
    state["freqs_cis"] = torch.stack([angles.cos(), angles.sin()], -1).float()[None, :, None].contiguous()
    assert len(state) == 77

    keys = sorted(state)
    split = [keys[:20], keys[20:50], keys[50:]]
    path = tmp_path / "huginn"
    path.mkdir()
    weight_map = {}
    for n, part in enumerate(split, start=1):
        name = f"model-{n:05d}-of-00003.safetensors"
        save_file({k: state[k] for k in part}, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    # A config in the style of the released one, including fields exitbench does not use.
    config = {
        "architectures": ["RavenForCausalLM"],
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig"},
        "model_type": "huginn_raven",
        "n_embd": c.n_embd, "n_heads": c.n_heads, "n_layers": 8, "vocab_size": c.vocab_size,
        "padded_vocab_size": c.vocab_size, "padding_multiple": 4, "intermediate_size": c.intermediate_size,
        "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
        "block_size": c.block_size, "rope_base": 50000, "norm_eps": 1e-6, "norm_class_name": "RMSNorm_llama",
        "bias": False, "qk_bias": True, "tie_embeddings": True, "init_strategy": "takase",
        "mean_recurrence": 4, "mean_backprop_depth": 2, "state_init": "like-init",
        "injection_type": "linear", "torch_dtype": "float32", "init_scale": 0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))

    ck = load_checkpoint(path)
    assert ck.files == sorted(set(weight_map.values()))
    assert ck.tokenizer is None
    assert ck.model.config.extra["state_init"] == "like-init"
    ids = random_ids(2, 9, seed=5)
    for r in (1, 3):
        torch.testing.assert_close(logits(ck.model, ids, r), logits(tiny_raven, ids, r), atol=1e-6, rtol=0)
    torch.testing.assert_close(ck.model.freqs_cis, tiny_raven.freqs_cis, atol=1e-6, rtol=0)


# ---- dtypes ----------------------------------------------------------------------------------------------

def test_bfloat16_load(tiny_checkpoint, tiny_raven):
    ck = load_checkpoint(tiny_checkpoint, dtype="bfloat16")
    assert ck.dtype == "bfloat16"
    params = dict(ck.model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    assert ck.model.lm_head.weight is ck.model.transformer.wte.weight
    assert ck.model.lm_head.weight.dtype == torch.bfloat16
    ids = random_ids(2, 8)
    out = logits(ck.model, ids, 2)
    ref = logits(tiny_raven, ids, 2)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert not torch.equal(out, ref)  # it really ran in bf16 ...
    torch.testing.assert_close(out, ref, atol=0.25, rtol=0.05)  # ... and still computes the same function
    # Incremental decoding works in bf16 too (the cache takes the model's dtype).
    cache = ck.model.new_cache(2, 8)
    assert cache.dtype == torch.bfloat16
    with torch.no_grad():
        first = ck.model(ids[:, :5], 2, cache=cache)
        rest = ck.model(ids[:, 5:], 2, cache=cache, start=5)
    torch.testing.assert_close(torch.cat([first, rest], 1), out, atol=0.1, rtol=0.05)


def test_unknown_dtype(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(tiny_checkpoint, dtype="int8")


# ---- atomic save -----------------------------------------------------------------------------------------

def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_save_into_non_empty_dir_raises_and_leaves_it(tmp_path, tiny_raven, tiny_checkpoint):
    before = snapshot(tiny_checkpoint)
    parent_before = listing(tiny_checkpoint.parent)
    other = make_tiny_raven(seed=3)
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(other, tiny_checkpoint)
    assert snapshot(tiny_checkpoint) == before
    assert listing(tiny_checkpoint.parent) == parent_before  # no temporary sibling left behind

    # A directory with one unrelated file counts as non-empty too.
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError):
        save_checkpoint(tiny_raven, target)
    assert snapshot(target) == {"notes.txt": b"mine"}


def test_save_into_empty_dir_and_overwrite(tmp_path, tiny_raven):
    target = tmp_path / "empty"
    target.mkdir()
    save_checkpoint(tiny_raven, target)
    other = make_tiny_raven(seed=4)
    save_checkpoint(other, target, overwrite=True)
    ids = random_ids(1, 6)
    assert torch.equal(logits(load_checkpoint(target).model, ids), logits(other, ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_failed_save_leaves_nothing(tmp_path, tiny_raven):
    class BrokenTokenizer:
        def save(self, path):
            (Path(path) / "tokenizer.json").write_text("{")
            raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tiny_raven, tmp_path / "new", tokenizer=BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []

    # A failed overwrite keeps the old checkpoint intact.
    path = save_checkpoint(tiny_raven, tmp_path / "old")
    before = snapshot(path)
    with pytest.raises(OSError):
        save_checkpoint(make_tiny_raven(seed=2), path, tokenizer=BrokenTokenizer(), overwrite=True)
    assert snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


# ---- dtype auto: the checkpoint's own ------------------------------------------------------------------------

def test_auto_dtype_is_the_checkpoints_own(tmp_path, tiny_raven):
    """A bf16 checkpoint (torch_dtype bfloat16) loads in bf16 by default and in float32 only on request, with
    the same values either way (bf16 → float32 is exact)."""
    path = save_checkpoint(tiny_raven.to(torch.bfloat16), tmp_path / "bf16", max_shard_bytes=SHARD_BYTES // 2)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    auto = load_checkpoint(path)
    assert auto.dtype == "bfloat16" and auto.model.dtype == torch.bfloat16
    wide = load_checkpoint(path, dtype="float32")
    assert wide.dtype == "float32" and wide.model.dtype == torch.float32
    for (k, a), (_, w) in zip(auto.model.state_dict().items(), wide.model.state_dict().items()):
        assert torch.equal(a.float(), w), k


def test_auto_dtype_without_torch_dtype_is_the_files(tmp_path, tiny_raven):
    """No torch_dtype in config.json (nor transformers 5's `dtype`): the dtype the weights are stored in."""
    path = save_checkpoint(tiny_raven.to(torch.float16), tmp_path / "f16")
    config = json.loads((path / "config.json").read_text())
    del config["torch_dtype"]
    (path / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(path).dtype == "float16"
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(path).dtype == "bfloat16"


def test_auto_dtype_refuses_a_dtype_it_cannot_run(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["torch_dtype"] = "float8_e4m3fn"
    (tiny_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="torch_dtype 'float8_e4m3fn'.*--dtype"):
        load_checkpoint(tiny_checkpoint)
    assert load_checkpoint(tiny_checkpoint, dtype="float32").dtype == "float32"


def test_conversion_goes_through_a_small_scratch_buffer(tiny_checkpoint, tiny_raven, monkeypatch):
    """A dtype conversion reads a tensor in pieces of SCRATCH_BYTES (so converting a 1.4 GB fp32 embedding to
    bf16 never holds it in fp32); pieces that split tensors anywhere give the same weights."""
    import exitbench.models.shards as shards

    monkeypatch.setattr(shards, "SCRATCH_BYTES", 24)  # 6 floats: every tensor splits, most unevenly
    ck = load_checkpoint(tiny_checkpoint, dtype="bfloat16")
    for key, t in tiny_raven.state_dict().items():
        assert torch.equal(ck.model.state_dict()[key], t.to(torch.bfloat16)), key


def test_loading_reads_each_kept_tensor_once_and_skips_the_rest(tmp_path, tiny_raven, monkeypatch):
    """The tied lm_head copy and freqs_cis that Huginn's files carry are checked by shape, never read: the reads
    add up to the model's own tensors' bytes."""
    import exitbench.models.shards as shards

    path = save_checkpoint(tiny_raven, tmp_path / "ck")
    read: list[int] = []
    original = shards._fill
    monkeypatch.setattr(shards, "_fill", lambda fh, f, k, o, dst: (read.append(dst.numel() * dst.element_size()),
                                                                   original(fh, f, k, o, dst)))
    ck = load_checkpoint(path)
    unique = {id(p): p for p in ck.model.parameters()}.values()
    assert sum(read) == sum(p.numel() * p.element_size() for p in unique)
