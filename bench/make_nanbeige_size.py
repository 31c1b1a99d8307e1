"""Write a random checkpoint in Nanbeige4.2-3B's published layout: what a user who downloads Nanbeige/Nanbeige4.2-3B
points exitbench at, minus the training.

    python bench/make_nanbeige_size.py /tmp/nanbeige-3b [--dtype bfloat16]

- config.json with the hub config's fields (shared/reference/nanbeige.md: hidden 3072, intermediate 10752, 22
  physical layers, `num_loops` 2, 48 heads, 8 KV heads, `head_dim` 128, `rope_theta` 7e7, vocabulary 166,144,
  untied head, `skip_loop_final_norm` false, `loop_loss_weights` [], `auto_map` naming the remote code), as the
  Base model's ids (BOS `<s>` 1, EOS `</s>` 2, PAD `<unk>` 0);
- the published keys, written from that reference's list and not from exitbench's module tree (so loading it
  tests exitbench's reading of the layout): `model.embed_tokens`, per layer q/k/v/o projections without biases,
  gate/up/down MLP and two RMSNorms, `model.norm`, an untied `lm_head`, in one `model.safetensors` as the hub has;
- a byte-level BPE tokenizer.json of the vocabulary with `<unk>`, `<s>`, `</s>` first and `add_bos_token` (the
  hub's Base repo ships a SentencePiece `tokenizer.model` instead, which needs sentencepiece to read).

Weights N(0, 0.02), norms 1. 4,169,800,704 parameters, 8.34 GB in bfloat16; at most two tensors in memory
(`sizes.write_weights` streams them). Why here and not in the package: no user needs a random Nanbeige. It is the
fixture of the slow full-size test (tests/test_full_size.py, its nanbeige row).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, llama_layer_keys, size_main, write_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=3072, intermediate_size=10752, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=22, vocab_size=166144, max_position_embeddings=262144, rope_theta=7e7)
SPECIAL = ["<unk>", "<s>", "</s>"]


def config_json(dtype: torch.dtype) -> dict:
    return {**SHAPE, "model_type": "nanbeige", "architectures": ["NanbeigeForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                         "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_scaling": None, "tie_word_embeddings": False,
            "attention_bias": False, "kv_channels": 128, "pretraining_tp": 1, "num_loops": 2, "loop_loss_weights": [],
            "skip_loop_final_norm": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def layout() -> list[tuple[str, tuple[int, ...]]]:
    c = SHAPE
    H, inter, hd, V = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    keys = [("model.embed_tokens.weight", (V, H))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys += llama_layer_keys(p, H, inter, q, kv) + [(f"{p}.input_layernorm.weight", (H,)),
                                                        (f"{p}.post_attention_layernorm.weight", (H,))]
    return keys + [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]


def write(out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, log=print) -> Path:
    normal = Normals(torch.Generator().manual_seed(seed))

    def make(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        t.fill_(1.0) if key.endswith("norm.weight") else normal(t, 0.0, 0.02)
        return t.to(dtype)

    tokenizer_config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                        "tokenizer_class": "PreTrainedTokenizerFast"}
    return write_checkpoint(out, layout(), make, dtype, SPECIAL, config_json(dtype), log,
                            {"tokenizer_config.json": tokenizer_config})


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv)


if __name__ == "__main__":
    sys.exit(main())
