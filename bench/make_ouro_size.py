"""Write a random checkpoint in Ouro's published layout: what a user who downloads ByteDance/Ouro-1.4B or -2.6B
points exitbench at, minus the training.

    python bench/make_ouro_size.py /tmp/ouro-1.4b --size 1.4b [--dtype bfloat16] [--shards 2]
    python bench/make_ouro_size.py tests/fixtures/ouro-tiny --size tiny --dtype float32 --shards 1 --seed 25

- config.json with the hub config's fields (shared/reference/ouro.md: Qwen2's names, `total_ut_steps` 4,
  `early_exit_threshold` 1.0, `layer_types` all full_attention, `auto_map` naming the remote-code files, bos =
  eos = pad = 0), torch_dtype as written;
- the published keys, written from that reference's list and not from exitbench's module tree (so loading
  it tests exitbench's reading of the layout): `model.embed_tokens`, per layer q/k/v/o projections without
  biases, gate/up/down MLP and four RMSNorms, `model.norm`, `model.early_exit_gate` (weight and bias) and an
  untied `lm_head`; in `--shards` files `model-0000i-of-0000n.safetensors` with an index (one shard: a single
  `model.safetensors`). How many shards the hub uses is not in the reference; the count is a choice;
- a byte-level BPE tokenizer.json of the model's vocabulary (49,152 at real size): `<|endoftext|>` 0,
  `<|im_start|>` 1, `<|im_end|>` 2 (ChatML's ids, which the shipped config.json does not name), the 256 byte
  symbols, then made-up two-symbol merges.

Weights are N(0, 0.02) (Qwen2's init; `tiny` draws 0.2 so its 2 layers move the state), norms 1 (`tiny`: 1 plus
a little noise), gate bias 0 (`tiny`: −1 with a spread-out gate, so Q-exit lands on every step). Ouro-1.4B:
1,434,652,673 parameters, 2.87 GB in bfloat16; 2.6B: 2,667,974,657, 5.34 GB. At most two tensors are in memory.
Why here and not in the package: no user needs a random Ouro. It is the fixture for the slow full-size test and
for tests/fixtures/ouro-tiny, whose reference outputs tests/test_ouro.py holds exitbench to.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, byte_level_bpe, llama_layer_keys, size_main, write_weights  # noqa: E402

SIZES = {
    "1.4b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
                 head_dim=128, num_hidden_layers=24, vocab_size=49152, max_position_embeddings=65536, rope_theta=1e6),
    "2.6b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
                 head_dim=128, num_hidden_layers=48, vocab_size=49152, max_position_embeddings=65536, rope_theta=1e6),
    # 2 layers, grouped-query heads (4 / 2): the parity fixture.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 num_hidden_layers=2, vocab_size=320, max_position_embeddings=512, rope_theta=10000.0),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def config_json(size: str, dtype: torch.dtype) -> dict:
    shape = SIZES[size]
    return {**shape, "model_type": "ouro", "architectures": ["OuroForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                         "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_scaling": None, "tie_word_embeddings": False,
            "total_ut_steps": 4, "early_exit_threshold": 1.0, "use_cache": True, "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * shape["num_hidden_layers"], "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": shape["num_hidden_layers"], "initializer_range": 0.02,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": str(dtype).removeprefix("torch.")}


def layout(size: str) -> list[tuple[str, tuple[int, ...]]]:
    c = SIZES[size]
    H, inter, hd, V = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    keys = [("model.embed_tokens.weight", (V, H))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys += llama_layer_keys(p, H, inter, q, kv)
        keys += [(f"{p}.{n}.weight", (H,)) for n in ("input_layernorm", "input_layernorm_2",
                                                      "post_attention_layernorm", "post_attention_layernorm_2")]
    keys += [("model.norm.weight", (H,)), ("model.early_exit_gate.weight", (1, H)),
             ("model.early_exit_gate.bias", (1,)), ("lm_head.weight", (V, H))]
    return keys


def make_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, normal: Normals, tiny: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if key.endswith("norm.weight") or "layernorm" in key:
        t.fill_(1.0)
        if tiny:
            t.add_(0.1 * torch.randn(shape, generator=normal.g))
    elif key.endswith("early_exit_gate.bias"):
        t.fill_(-1.0 if tiny else 0.0)
    elif key.endswith("early_exit_gate.weight"):
        normal(t, 0.0, 0.6 if tiny else 0.02)
    else:
        normal(t, 0.0, 0.2 if tiny else 0.02)
    return t.to(dtype)


def make_tokenizer(vocab_size: int) -> Tokenizer:
    tok = byte_level_bpe(vocab_size, SPECIAL)
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size and tok.token_to_id("<|im_end|>") == 2
    return tok


def write(out: Path, size: str = "1.4b", dtype: torch.dtype = torch.bfloat16, shards: int = 2, seed: int = 0,
          log=print) -> Path:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    keys = layout(size)
    normal = Normals(torch.Generator().manual_seed(seed))
    total = write_weights(out, keys, lambda key, shape: make_tensor(key, shape, dtype, normal, size == "tiny"), dtype,
                          shards, log)
    make_tokenizer(SIZES[size]["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config_json(size, dtype), indent=2, sort_keys=True) + "\n")
    log(f"wrote {out}: {len(keys)} keys, {total:,} bytes of weights")
    return out


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv, ("--size", dict(default="1.4b", choices=sorted(SIZES))), ("--shards", dict(type=int, default=2)))


if __name__ == "__main__":
    sys.exit(main())
