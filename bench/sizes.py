"""What the make_*_size.py scripts share: their command line (a new directory, the script's own options, the
dtype, a seed), the key names of a Llama-style layer, a byte-level tokenizer of any size, the sharded weight
writer and the one-file checkpoint writer, so each script says only its family's layout."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
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
    several. Returns the bytes written.

    Streamed: each file's header is written from the layout before its first tensor is made, then each tensor as
    it comes, by a thread that writes one while the next is drawn. Drawing a real-size model's random numbers and
    writing them to disk take about as long each (measured on the CI machine: 22 s and 24 s of Huginn's 53 s), and
    the write releases the GIL, so the two overlap; and no more than two tensors are ever in memory, where a
    whole shard was (8 GB for the one-file families)."""
    nbytes = {k: math.prod(s) * dtype.itemsize for k, s in keys}
    total = sum(nbytes.values())
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    done = 0
    for key, shape in keys:
        if groups[-1] and len(groups) < shards and done + nbytes[key] / 2 > total * len(groups) / shards:
            groups.append([])
        groups[-1].append((key, shape))
        done += nbytes[key]
    weight_map = {}
    with ThreadPoolExecutor(max_workers=1) as writer:
        for index, group in enumerate(groups, start=1):
            name = "model.safetensors" if shards == 1 else f"model-{index:05d}-of-{shards:05d}.safetensors"
            with open(out / name, "wb") as f:
                f.write(safetensors_header(group, dtype))
                pending = None
                for key, shape in group:
                    t = make(key, shape)
                    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                        raise SystemExit(f"error: {key} was made as {t.dtype} {tuple(t.shape)}; its layout says "
                                         f"{dtype} {tuple(shape)}")
                    if pending is not None:
                        pending.result()
                    pending = writer.submit(f.write, t.contiguous().reshape(-1).view(torch.uint8).numpy())
                if pending is not None:
                    pending.result()
            weight_map.update({k: name for k, _ in group})
            log(f"  {name}: {len(group)} tensors")
    if shards > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return total


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def safetensors_header(keys: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """A safetensors file's length prefix and JSON header for `keys` of `dtype`, stored in the order given (the
    format asks only that each tensor's bytes follow the last one's), padded to 8 bytes as the format's writer pads
    it, with save_pretrained's metadata."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in keys:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
