"""Write a random checkpoint with Huginn-0125's exact layout: what a user who downloads the real one points
exitbench at, minus the training.

    python bench/make_huginn_size.py /tmp/huginn-size [--dtype bfloat16] [--seed 0]

- config.json with the released config's fields (shared/reference/huginn-0125.md §1.1), torch_dtype bfloat16;
- the 77 published keys (§2): the layers, the tied embedding stored twice (transformer.wte and lm_head, as the
  hub copy has it) and the freqs_cis table, in 4 shards `model-0000{1..4}-of-00004.safetensors` with a
  `model.safetensors.index.json`;
- a byte-level BPE tokenizer.json of 65,536 entries: the 256 byte symbols, 65,248 made-up two-byte merges, and
  Huginn's 32 special tokens at their ids 65504–65535.

3,564,976,800 unique parameters: 7.8 GB in bfloat16 (15.6 GB in float32, the size of the hub's files).
Weights are normal draws clipped at ±3σ at Huginn's init scales ("takase", §1.3), so activations stay finite
through 32+ iterations. The key list and shapes are written from the reference, not from exitbench's module
tree, so loading this checkpoint tests exitbench's reading of the published layout.

Why here and not in the package: no user needs a random 3.5B model. It is a fixture for measuring exitbench
at full size (bench/RESULTS.md) and for the slow test that holds load and info to their memory bounds
(tests/test_full_size.py). It streams its tensors to disk while making the next (`sizes.write_weights`), the large
ones from one pool of normals (`sizes.Normals`): 14 s and 2.3 GB peak on two idle cores, where drawing every value
took 32 s, and writing a shard at a time 52 s and 3.3 GB (bench/RESULTS.md).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, processors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import Normals, byte_level_bpe, size_main, write_weights  # noqa: E402

H, HEADS, HEAD_DIM, INTER, VOCAB, CONTEXT = 5280, 55, 96, 17920, 65536, 4096
PRELUDE, CORE, CODA, MEAN_RECURRENCE = 2, 4, 2, 32
ROPE_BASE = 50000
SHARDS = 4

# The released config.json's fields (huginn-0125.md §1.1).
CONFIG = {
    "architectures": ["RavenForCausalLM"],
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    "model_type": "huginn_raven",
    "n_embd": H, "hidden_size": H, "n_heads": HEADS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "n_layers": PRELUDE + CORE + CODA, "n_layers_in_prelude": PRELUDE, "n_layers_in_recurrent_block": CORE,
    "n_layers_in_coda": CODA, "block_size": CONTEXT, "vocab_size": VOCAB, "padded_vocab_size": VOCAB,
    "padding_multiple": 4096, "intermediate_size": INTER, "bias": False, "qk_bias": True, "tie_embeddings": True,
    "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "rope_base": ROPE_BASE, "init_strategy": "takase",
    "init_orthogonal": False, "state_init": "like-init", "injection_type": "linear",
    "mean_recurrence": MEAN_RECURRENCE, "mean_backprop_depth": 8, "sampling_scheme": "poisson-lognormal-filling",
    "activation_checkpoint_impl": "per-iteration", "test_time_noise": 0, "test_time_noise_type": "fixed",
    "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509, "torch_dtype": "bfloat16",
}

SPECIAL = (["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>",
            "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|...|>", "<|del|>"]
           + [f"<|c_{i}|>" for i in range(10)]
           + ["<|?|>", "<|&|>", "<|!|>", "<|-|>", "<|+|>", "<|interrupt|>", "<|>>-|>", "<|-<<|>", "<|->>|>",
              "<|<<-|>"])
FIRST_SPECIAL = 65504


def layout() -> list[tuple[str, tuple[int, ...]]]:
    """The 77 keys and shapes of huginn-0125.md §2, in the order the modules are declared."""
    def block(prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{prefix}.norm_{i}.weight", (H,)) for i in (1, 2, 3, 4)] + [
            (f"{prefix}.attn.Wqkv.weight", (3 * H, H)), (f"{prefix}.attn.qk_bias", (2, 1, HEADS, HEAD_DIM)),
            (f"{prefix}.attn.proj.weight", (H, H)), (f"{prefix}.mlp.fc.weight", (2 * INTER, H)),
            (f"{prefix}.mlp.proj.weight", (H, INTER))]

    keys = [("transformer.wte.weight", (VOCAB, H))]
    keys += [kv for i in range(PRELUDE) for kv in block(f"transformer.prelude.{i}")]
    keys += [("transformer.adapter.weight", (H, 2 * H))]
    keys += [kv for i in range(CORE) for kv in block(f"transformer.core_block.{i}")]
    keys += [kv for i in range(CODA) for kv in block(f"transformer.coda.{i}")]
    keys += [("transformer.ln_f.weight", (H,)), ("lm_head.weight", (VOCAB, H)),
             ("freqs_cis", (1, CONTEXT, 1, HEAD_DIM // 2, 2))]
    return keys


def make_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, normal: Normals,
                embedding: torch.Tensor | None) -> torch.Tensor:
    """Huginn's init scales ("takase"): σ = sqrt(2/(5h)), σ/sqrt(2·132) on output projections, norms 1, qk_bias 0."""
    std = math.sqrt(2 / (5 * H))
    out_std = std / math.sqrt(2 * (PRELUDE + CODA + CORE * MEAN_RECURRENCE))
    if key == "lm_head.weight":
        return embedding.clone()  # the hub's second copy of the tied embedding
    if key == "freqs_cis":
        inv = 1.0 / (ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        angles = torch.outer(torch.arange(CONTEXT, dtype=torch.float32), inv)
        return torch.stack([angles.cos(), angles.sin()], -1).view(shape).to(dtype)
    if ".norm_" in key or key.endswith("ln_f.weight"):
        return torch.ones(shape, dtype=dtype)
    if key.endswith("qk_bias"):
        return torch.zeros(shape, dtype=dtype)
    t = torch.empty(shape, dtype=torch.float32)
    parts = [(t[:INTER], std), (t[INTER:], out_std)] if key.endswith("mlp.fc.weight") else \
        [(t, out_std if key.endswith(("attn.proj.weight", "mlp.proj.weight")) else std)]
    for part, s in parts:
        # A normal (sizes.Normals) clipped at ±3σ: far faster than torch's trunc_normal_ (inverse-CDF) at 3.6
        # billion values, and the 0.27% of values at the bounds change nothing a random fixture is for.
        normal(part, 0.0, s).clamp_(-3 * s, 3 * s)
    return t.to(dtype)


def make_tokenizer() -> Tokenizer:
    """65,536 entries: byte-level BPE, then the special tokens at Huginn's ids."""
    tok = byte_level_bpe(FIRST_SPECIAL)
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    # BOS first, as Huginn's pretraining documents start (huginn-0125.md §2.1).
    tok.post_processor = processors.TemplateProcessing(single="<|begin_text|> $A",
                                                       special_tokens=[("<|begin_text|>", FIRST_SPECIAL)])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    assert tok.token_to_id("<|begin_text|>") == FIRST_SPECIAL and tok.token_to_id("<|<<-|>") == VOCAB - 1
    return tok


def write(out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, log=print) -> Path:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    keys = layout()
    normal = Normals(torch.Generator().manual_seed(seed))
    embedding = None
    t0 = time.perf_counter()

    def make(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal embedding
        t = make_tensor(key, shape, dtype, normal, embedding)
        if key == "transformer.wte.weight":
            embedding = t  # (kept for lm_head, the hub's second copy of it)
        return t

    total = write_weights(out, keys, make, dtype, SHARDS, log)
    make_tokenizer().save(str(out / "tokenizer.json"))
    # config.json last: a directory is a checkpoint only once everything else is there.
    config = {**CONFIG, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log(f"wrote {out}: {len(keys)} keys, {total:,} bytes of weights in {SHARDS} shards "
        f"({time.perf_counter() - t0:.0f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    size_main(__doc__, write, argv)


if __name__ == "__main__":
    sys.exit(main())
