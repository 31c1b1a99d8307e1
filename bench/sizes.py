"""What the make_*_size.py scripts share: their command line (a new directory, the script's own options, the
dtype, a seed), the key names of a Llama-style layer, a byte-level tokenizer of any size, the sharded weight
writer and the one-file checkpoint writer, so each script says only its family's layout."""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

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


def byte_level_bpe(size: int, leading: list[str] = ()) -> Tokenizer:
    """Byte-level BPE of `size` entries: `leading` tokens first, the 256 byte symbols, then made-up two-symbol
    merges, and past the 65,536 of those (OLMo-2's 100k) three-symbol ones. Encodes any text (every byte has
    a symbol)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate([*leading, *alphabet])}
    merges = []
    pairs = itertools.chain(((a, b) for a in alphabet for b in alphabet),
                            ((a + b, c) for a in alphabet for b in alphabet for c in alphabet))
    while len(vocab) < size:
        a, b = next(pairs)
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_weights(out: Path, keys: list[tuple[str, tuple[int, ...]]], make, dtype: torch.dtype, shards: int,
                  log=print) -> int:
    """`make(key, shape)` for every key into `shards` safetensors files of about equal bytes (a tensor goes to
    the shard holding its middle byte), named as save_pretrained names them, with an index when there are
    several; one shard in memory at a time. Returns the bytes written."""
    nbytes = {k: math.prod(s) * dtype.itemsize for k, s in keys}
    total = sum(nbytes.values())
    weight_map, shard, index, done = {}, {}, 1, 0

    def flush() -> None:
        nonlocal shard, index
        name = "model.safetensors" if shards == 1 else f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        log(f"  {name}: {len(shard)} tensors")
        shard, index = {}, index + 1

    for key, shape in keys:
        if shard and index < shards and done + nbytes[key] / 2 > total * index / shards:
            flush()
        shard[key] = make(key, shape)
        done += nbytes[key]
    flush()
    if shards > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return total
