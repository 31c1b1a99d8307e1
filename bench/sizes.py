"""What the make_*_size.py scripts share: their command line (a new directory, the script's own options, the
dtype, a seed) and the key names of a Llama-style layer, so each script says only its family's layout."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DTYPES = ["bfloat16", "float32", "float16"]


def size_main(doc: str, write, argv: list[str] | None = None, *options: tuple[str, dict], dtype: bool = True) -> None:
    """Parse `out`, each (flag, argparse keywords) of `options`, --dtype (where the script takes one) and --seed,
    and call write(out=…, <option>=…, dtype=torch.<dtype>, seed=…)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", type=Path, help="new directory for the checkpoint")
    for flag, keywords in options:
        parser.add_argument(flag, **keywords)
    if dtype:
        parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    args = vars(parser.parse_args(argv))
    if dtype:
        args["dtype"] = getattr(torch, args["dtype"])
    write(**args)


def llama_layer_keys(prefix: str, hidden: int, inter: int, q: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-style layer's attention and MLP matrices (no norms): q is the query width, kv each of k's and v's."""
    return [(f"{prefix}.self_attn.q_proj.weight", (q, hidden)), (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)), (f"{prefix}.self_attn.o_proj.weight", (hidden, q)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)), (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter))]


def write_checkpoint(out: Path, keys: list[tuple[str, tuple[int, ...]]], make, dtype: torch.dtype, special: list[str],
                     config: dict, log=print, extra_files: dict[str, dict] | None = None) -> Path:
    """What a one-file size script writes once it has its layout: into a new (or empty) `out`, `make(key, shape)`
    for every key in one model.safetensors, a byte-level BPE tokenizer.json of config's vocab_size whose first ids
    are `special`, config.json, and each of `extra_files` (name → its JSON)."""
    from make_huginn_size import byte_level_bpe  # (siblings that import this module: imported when called)
    from make_ouro_size import write_weights
    from tokenizers import AddedToken

    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    total = write_weights(out, keys, make, dtype, 1, log)
    tok = byte_level_bpe(config["vocab_size"], special)
    tok.add_special_tokens([AddedToken(s, special=True) for s in special])
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    assert [tok.token_to_id(s) for s in special] == list(range(len(special)))
    tok.save(str(out / "tokenizer.json"))
    for name, content in {**(extra_files or {}), "config.json": config}.items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    log(f"wrote {out}: {len(keys)} keys, {total:,} bytes of weights")
    return out
