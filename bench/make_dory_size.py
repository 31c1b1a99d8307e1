"""Write a random checkpoint in Dory1.0-4B's released layout: what a user who downloads
nvidia/NVIDIA-Nemotron-Labs-Dory1.0-4B-BF16 points exitbench at, minus the training.

    python bench/make_dory_size.py /tmp/dory-4b [--dtype bfloat16]

- config.json with the fields vLLM's Dory config class reads (shared/reference/dory.md: hidden 2560, MLP 7168, 16
  query and 4 key/value heads of 256, vocabulary 131,072, 72 sublayers in the default "S-S-S-*-" pattern split
  16 input / 40 recurrent / 16 output, 4 loops, per_loop KV, a 1,024-key sliding window, 8,192 positions, untied);
- the released keys, written from vLLM's loader and not from exitbench's module tree (so loading it tests
  exitbench's reading of the layout): `backbone.embeddings`, per attention sublayer q/k/v/g/o projections, `sqk`,
  `s_gate` and `attn_alpha`, per MLP sublayer gate/up/down, `suv_gate`, `suv_up` and `mlp_alpha`, then `lm_head`
  with its `logit_scale`, in one `model.safetensors` of 7.95 GB in bfloat16 as the hub has;
- a byte-level BPE tokenizer.json of the vocabulary with Nemotron's `<unk>`, `<s>`, `</s>` first.

Matrices N(0, 0.02), the embeddings' rows about unit norm, each learned scale constant at the centre
`Dory.init_weights` draws it around (the large matrices from one pool of normals, `sizes.Normals`).
3,975,229,440 parameters, streamed to disk a tensor at a time while the next is made (`sizes.write_weights`; 15 s
and 2.3 GB peak on two idle cores, where drawing every value took 28 s, and a file made whole in memory 55 s and
9.3 GB: bench/RESULTS.md). Why here and not in the package: no user needs a random Dory. It is the fixture
of the slow full-size test (tests/test_full_size.py, its dory row).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, size_main, write_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=2560, intermediate_size=7168, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
             num_hidden_layers=72, vocab_size=131072, max_position_embeddings=8192)
SPECIAL = ["<unk>", "<s>", "</s>"]
# The learned per-channel scales, near where Dory.init_weights centres them (initializer_range 0.02, hidden 2560).
SCALES = {"alpha": 0.08, "sqk": 0.02, "s_gate": 0.02, "suv_gate": 2560 ** -0.5, "suv_up": 2560 ** -0.5,
          "logit_scale": 0.4}


def config_json(dtype: torch.dtype) -> dict:
    return {**SHAPE, "model_type": "dory", "architectures": ["DoryForCausalLM"], "hidden_act": "silu",
            "tie_word_embeddings": False, "initializer_range": 0.02, "ngpt_alpha_init": 0.05, "sliding_window": 1024,
            "n_input_layers": 16, "n_recurrent_layers": 40, "n_output_layers": 16, "n_recurrent_loops": 4,
            "recurrent_kv_cache_mode": "per_loop", "mlp_bias": False, "attention_bias": False,
            "rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
                                for kind in ("sliding_attention", "full_attention")},
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch.")}


def layout() -> list[tuple[str, tuple[int, ...]]]:
    c = SHAPE
    H, inter, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    keys = [("backbone.embeddings.weight", (V, H))]
    for i in range(c["num_hidden_layers"]):
        p = f"backbone.layers.{i}"
        if i % 2:  # vLLM's default pattern: odd sublayers are MLPs
            keys += [(f"{p}.mixer.gate_proj.weight", (inter, H)), (f"{p}.mixer.up_proj.weight", (inter, H)),
                     (f"{p}.mixer.down_proj.weight", (H, inter)), (f"{p}.mixer.suv_gate", (inter,)),
                     (f"{p}.mixer.suv_up", (inter,)), (f"{p}.mlp_alpha", (H,))]
        else:
            keys += [(f"{p}.mixer.q_proj.weight", (q, H)), (f"{p}.mixer.k_proj.weight", (kv, H)),
                     (f"{p}.mixer.v_proj.weight", (kv, H)), (f"{p}.mixer.g_proj.weight", (q, H)),
                     (f"{p}.mixer.o_proj.weight", (H, q)), (f"{p}.mixer.sqk", (q,)), (f"{p}.mixer.s_gate", (q,)),
                     (f"{p}.attn_alpha", (H,))]
    return keys + [("lm_head.weight", (V, H)), ("lm_head.logit_scale", (V,))]


def write(out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, log=print) -> Path:
    normal = Normals(torch.Generator().manual_seed(seed))

    def make(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        scale = next((v for k, v in SCALES.items() if key.endswith(k)), None)
        if scale is not None:
            t.fill_(scale)
        else:
            rows = key in ("backbone.embeddings.weight", "lm_head.weight")
            normal(t, 0.0, SHAPE["hidden_size"] ** -0.5 if rows else 0.02)
        return t.to(dtype)

    return write_checkpoint(out, layout(), make, dtype, SPECIAL, config_json(dtype), log)


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv)


if __name__ == "__main__":
    sys.exit(main())
