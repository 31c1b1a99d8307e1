"""Write a random checkpoint in the layout of the retrofitted-recurrence conversions (McLeish et al. 2025,
`smcleish/Recurrent-*`): what a user who downloads one points exitbench at, minus the training.

    python bench/make_retrofit_size.py /tmp/tinyllama --size tinyllama-4-8-4      # 1.69 GB, bf16
    python bench/make_retrofit_size.py /tmp/olmo --size olmo2-4-6-4               # 2.72 GB, bf16
    python bench/make_retrofit_size.py tests/fixtures/retrofit-llama-tiny --size llama-tiny --dtype float32 --seed 26
    python bench/make_retrofit_size.py tests/fixtures/retrofit-olmo-tiny --size olmo-tiny --dtype float32 --seed 26

What each file holds, written from the public conversion code's behaviour (shared/reference/
retrofitted-recurrence.md) and not from exitbench's module tree, so loading it tests exitbench's reading:
- config.json as the conversion leaves it: Huginn-0125's fields, stale ones included (`block_class_name`
  "SandwichBlock", `mean_recurrence` 32, `effective_expected_depth` 132, `init_values` computed for width 5280
  with `embed_scale` 1.0, and for the Llama kind Huginn's special ids 65504/65505/65509, far outside a
  32,000-token vocabulary), overwritten with the source model's widths, `num_key_value_heads`, `head_dim`,
  `rope_theta`, `max_position_embeddings`, `tie_embeddings` false, `qk_bias` false; `rope_scaling` llama3 where
  the source has it (Llama-3.2 and the llama-tiny fixture; TinyLlama has none);
- the keys: `transformer.wte`, per block `norm_1`, `attn.Wqkv` (q rows, then k, then v of the grouped heads),
  `attn.proj`, `norm_2`, `mlp.fc` (gate rows, then up), `mlp.proj`, and for OLMo `attn.q_norm` /
  `attn.k_norm`; `transformer.adapter`, `transformer.ln_f`, an untied `lm_head`; no `freqs_cis`;
- in as many shards as save_pretrained's 5 GB default makes (one file for both real sizes in bf16), or
  `--shards`;
- a byte-level BPE tokenizer.json of the tokenizer's size (TinyLlama 32,000 with <unk> <s> </s> at 0-2 and a
  "<s> $A" post-processor; OLMo-2 100,278 with <|endoftext|> at 100257 and <|pad|> at 100277, inside a
  100,352-row embedding) and a tokenizer_config.json naming the special tokens.

Weights are N(0, 0.02), norms 1 (the tiny fixtures: N(0, 0.2), norms 1 plus noise, so their layers move the
state). TinyLlama 4/8/4: 844,171,264 parameters (1.69 GB in bf16); OLMo-2 4/6/4: 1,359,071,232 (2.72 GB).
At most two tensors are in memory.
Why here and not in the package: no user needs a random retrofit. It is the fixture for the slow full-size test
and for tests/fixtures/retrofit-*-tiny, whose reference outputs tests/test_retrofit.py holds exitbench to.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from tokenizers import AddedToken, processors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, byte_level_bpe, size_main, write_weights  # noqa: E402

LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
SIZES = {
    # TinyLlama-1.1B-intermediate-step-1431k-3T, layers [0-3] / [10-17] / [18-21].
    "tinyllama-4-8-4": dict(kind="llama", n_embd=2048, n_heads=32, kv=4, inter=5632, vocab=32000, tokens=32000,
                            theta=10000.0, context=2048, eps=1e-5, split=(4, 8, 4), scaling=None),
    # OLMo-2-0425-1B, layers [0-3] / [6-11] / [12-15].
    "olmo2-4-6-4": dict(kind="olmo", n_embd=2048, n_heads=16, kv=16, inter=8192, vocab=100352, tokens=100278,
                        theta=500000.0, context=4096, eps=1e-6, split=(4, 6, 4), scaling=None),
    # The parity fixtures: grouped heads (4 / 2), and for Llama the llama3 scaling, whose three frequency
    # bands all occur at head_dim 8 and base 200000 (wavelengths 6, 133, 2810 and 59,400 against 2048 / 8192),
    # a base that differs from the 500000 the conversion writes as rope_base, as TinyLlama's 10000 does.
    "llama-tiny": dict(kind="llama", n_embd=32, n_heads=4, kv=2, inter=64, vocab=320, tokens=320,
                       theta=200000.0, context=512, eps=1e-5, split=(2, 2, 2), scaling=LLAMA3_SCALING),
    "olmo-tiny": dict(kind="olmo", n_embd=32, n_heads=4, kv=2, inter=64, vocab=352, tokens=320,
                      theta=500000.0, context=512, eps=1e-6, split=(2, 2, 2), scaling=None),
}
HUGINN_WIDTH = 5280  # the width Huginn-0125's init_values were computed for, which the conversion keeps
SAVE_PRETRAINED_SHARD = 5 * 10**9  # transformers' default max_shard_size, "5GB"


def config_json(size: str, dtype: torch.dtype) -> dict:
    c = SIZES[size]
    pre, core, coda = c["split"]
    std = math.sqrt(2 / (5 * HUGINN_WIDTH))
    config = {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "init_strategy": "takase", "init_orthogonal": False, "state_init": "like-init", "injection_type": "linear",
        "sampling_scheme": "poisson-lognormal-filling", "activation_checkpoint_impl": "per-iteration",
        "mean_recurrence": 32, "mean_backprop_depth": 8, "effective_expected_depth": 132, "block_size": 4096,
        "padding_multiple": 4096, "bias": False, "test_time_noise": 0, "test_time_noise_type": "fixed",
        "init_values": {"std": std, "out_proj": std / math.sqrt(2 * 132), "embedding": std, "embed_scale": 1.0},
        # The source model's, as the conversion's update_dict writes them.
        "n_embd": c["n_embd"], "n_heads": c["n_heads"], "num_key_value_heads": c["kv"],
        "head_dim": c["n_embd"] // c["n_heads"], "intermediate_size": c["inter"], "n_layers": pre + core + coda,
        "n_layers_in_prelude": pre, "n_layers_in_recurrent_block": core, "n_layers_in_coda": coda,
        "norm_eps": c["eps"], "vocab_size": c["vocab"], "padded_vocab_size": c["vocab"],
        "rope_base": 500000.0 if c["kind"] == "llama" else c["theta"], "rope_theta": c["theta"],
        "tie_embeddings": False, "tie_word_embeddings": False, "qk_bias": False,
        "max_position_embeddings": c["context"], "torch_dtype": str(dtype).removeprefix("torch."),
        "transformers_version": "4.51.0",
    }
    if c["scaling"]:
        config["rope_scaling"] = c["scaling"]
    if c["kind"] == "llama":  # started from Huginn-0125's config.json, whose ids it keeps
        config.update(bos_token_id=65504, eos_token_id=65505, pad_token_id=65509)
    else:
        config["initial_state_mode"] = "random"
    return config


def layout(size: str) -> list[tuple[str, tuple[int, ...]]]:
    c = SIZES[size]
    H, hd = c["n_embd"], c["n_embd"] // c["n_heads"]
    q, kv = c["n_heads"] * hd, c["kv"] * hd

    def block(prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        keys = [(f"{prefix}.norm_1.weight", (H,)), (f"{prefix}.attn.Wqkv.weight", (q + 2 * kv, H)),
                (f"{prefix}.attn.proj.weight", (H, q)), (f"{prefix}.norm_2.weight", (H,)),
                (f"{prefix}.mlp.fc.weight", (2 * c["inter"], H)), (f"{prefix}.mlp.proj.weight", (H, c["inter"]))]
        if c["kind"] == "olmo":
            keys += [(f"{prefix}.attn.q_norm.weight", (q,)), (f"{prefix}.attn.k_norm.weight", (kv,))]
        return keys

    pre, core, coda = c["split"]
    keys = [("transformer.wte.weight", (c["vocab"], H))]
    keys += [k for j in range(pre) for k in block(f"transformer.prelude.{j}")]
    keys += [("transformer.adapter.weight", (H, 2 * H))]
    keys += [k for j in range(core) for k in block(f"transformer.core_block.{j}")]
    keys += [k for j in range(coda) for k in block(f"transformer.coda.{j}")]
    return keys + [("transformer.ln_f.weight", (H,)), ("lm_head.weight", (c["vocab"], H))]


def make_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, normal: Normals, tiny: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if "norm" in key or key.endswith("ln_f.weight"):
        t.fill_(1.0)
        if tiny:
            t.add_(0.1 * torch.randn(shape, generator=normal.g))
    else:
        normal(t, 0.0, 0.2 if tiny else 0.02)
    return t.to(dtype)


def tokenizer_files(size: str) -> tuple:
    """tokenizer.json and tokenizer_config.json of the source model's special tokens at their ids."""
    c = SIZES[size]
    if c["kind"] == "llama":
        tok = byte_level_bpe(c["tokens"], ["<unk>", "<s>", "</s>"])
        tok.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
        named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
        assert tok.token_to_id("</s>") == 2
    else:
        first = c["tokens"] - 21  # <|endoftext|> then 19 reserved tokens, then <|pad|> last
        special = ["<|endoftext|>"] + [f"<|extra_id_{i}|>" for i in range(19)] + ["<|pad|>"]
        tok = byte_level_bpe(first)
        tok.add_special_tokens([AddedToken(s, special=True) for s in special])
        named = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
        assert tok.token_to_id("<|pad|>") == c["tokens"] - 1
    assert tok.get_vocab_size(with_added_tokens=True) == c["tokens"]
    return tok, {**named, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c["context"]}


def write(out: Path, size: str = "tinyllama-4-8-4", dtype: torch.dtype = torch.bfloat16, shards: int | None = None,
          seed: int = 0, log=print) -> Path:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    keys = layout(size)
    if shards is None:
        shards = math.ceil(sum(math.prod(s) for _, s in keys) * dtype.itemsize / SAVE_PRETRAINED_SHARD)
    normal = Normals(torch.Generator().manual_seed(seed))
    tiny = size.endswith("tiny")
    total = write_weights(out, keys, lambda key, shape: make_tensor(key, shape, dtype, normal, tiny), dtype, shards,
                          log)
    tok, tok_config = tokenizer_files(size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    # config.json last: a directory is a checkpoint only once everything else is there.
    (out / "config.json").write_text(json.dumps(config_json(size, dtype), indent=2, sort_keys=True) + "\n")
    log(f"wrote {out}: {len(keys)} keys, {total:,} bytes of weights in {shards} file(s)")
    return out


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv, ("--size", dict(default="tinyllama-4-8-4", choices=sorted(SIZES))), ("--shards", dict(type=int, default=None, help="[as save_pretrained's 5 GB default splits]")))


if __name__ == "__main__":
    sys.exit(main())
