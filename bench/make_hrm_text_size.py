"""Write a random checkpoint in HRM-Text-1B's published layout: what a user who downloads sapientinc/HRM-Text-1B
points exitbench at, minus the training.

    python bench/make_hrm_text_size.py /tmp/hrm-text-1b [--dtype bfloat16]

- config.json as transformers saves the released one (shared/reference/hrm-text.md: hidden 1536, intermediate
  4096, 12 heads of 128, 16 layers per stack, 2 H cycles of 3 L cycles, vocabulary 65,536, 4,096 positions, RoPE
  base 1e4, initializer_range 1/√1536 and embedding_scale √1536, prefix_lm, untied head), with the pair
  num_hidden_layers 128 / num_layers_per_stack 16 that transformers writes, and the ids bos 6, eos 11, pad 5;
- the published keys, written from that reference's list and not from exitbench's module tree (so loading it
  tests exitbench's reading of the layout): `model.embed_tokens`, `model.z_L_init`, per stack and layer the fused
  `attn.gqkv_proj` (gate, q, k, v rows) and `attn.o_proj`, the fused `mlp.gate_up_proj` and `mlp.down_proj`, no
  norm keys, an untied `lm_head`, in one `model.safetensors` as the hub has;
- a byte-level BPE tokenizer.json of the vocabulary whose first fourteen tokens are the fixture's special ones
  (tests/fixtures/make_hrm_text_tiny.py: <|im_start|> 6, <|box_end|> 11, …).

Weights N(0, 0.02), z_L_init N(0, 1). 1,182,795,264 parameters, 2.37 GB in bfloat16; at most two tensors in memory
(`sizes.write_weights` streams them). Why here and not in the package: no user needs a random HRM-Text. It is the
fixture of the slow full-size test (tests/test_full_size.py, its hrm_text row).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, size_main, write_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=1536, intermediate_size=4096, num_attention_heads=12, head_dim=128, num_layers_per_stack=16,
             H_cycles=2, L_cycles=3, vocab_size=65536, max_position_embeddings=4096)
SPECIAL = ["<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>", "<|reserved_3|>", "<|reserved_4|>", "<|pad|>",
           "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
           "<|box_end|>", "<|quad_start|>", "<|quad_end|>"]


def config_json(dtype: torch.dtype) -> dict:
    c = SHAPE
    return {**c, "model_type": "hrm_text", "architectures": ["HrmTextForCausalLM"],
            "num_hidden_layers": c["num_layers_per_stack"] * c["H_cycles"] * (c["L_cycles"] + 1),
            "num_key_value_heads": c["num_attention_heads"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "initializer_range": 1536 ** -0.5, "embedding_scale": 1536 ** 0.5,
            "L_bp_cycles": [2], "prefix_lm": True, "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 6, "eos_token_id": 11, "pad_token_id": 5,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def layout() -> list[tuple[str, tuple[int, ...]]]:
    c = SHAPE
    H, inter, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    width = c["num_attention_heads"] * c["head_dim"]
    keys = [("model.embed_tokens.weight", (V, H)), ("model.z_L_init", (H,))]
    for stack in ("H_module", "L_module"):
        for i in range(c["num_layers_per_stack"]):
            p = f"model.{stack}.layers.{i}"
            keys += [(f"{p}.attn.gqkv_proj.weight", (4 * width, H)), (f"{p}.attn.o_proj.weight", (H, width)),
                     (f"{p}.mlp.gate_up_proj.weight", (2 * inter, H)), (f"{p}.mlp.down_proj.weight", (H, inter))]
    return keys + [("lm_head.weight", (V, H))]


def write(out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, log=print) -> Path:
    normal = Normals(torch.Generator().manual_seed(seed))

    def make(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        std = 1.0 if key.endswith("z_L_init") else 0.02
        return normal(torch.empty(shape, dtype=torch.float32), 0.0, std).to(dtype)

    return write_checkpoint(out, layout(), make, dtype, SPECIAL, config_json(dtype), log)


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv)


if __name__ == "__main__":
    sys.exit(main())
