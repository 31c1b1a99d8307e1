"""What the make_*_size.py scripts share: their command line (a new directory, the script's own options, the
dtype, a seed), the key names of a Llama-style layer, a byte-level tokenizer of any size, the sharded weight
writer and the one-file checkpoint writer, so each script says only its family's layout."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
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


class Normals:
    """Fills tensors with N(mean, std²) values from generator `g`: `normal(t, mean, std)`, in place.

    A tensor of at most POOL values draws each one, exactly as `t.normal_(mean, std, generator=g)`, so the tiny
    fixtures these scripts wrote keep their bytes. A larger one, a real-size matrix, is laid end to end from one pool
    of POOL draws, made on the first such tensor and shared by the rest, each stretch from its own random start in
    the pool, scaled by ±std with a random sign: every value still N(mean, std²). Drawing each of billions was most
    of a real-size checkpoint's time (torch draws about 180M normals a second on one core: 21 of Huginn's 29 s), and
    what these weights are for (loading, memory, shapes, every command running) never reads them."""

    POOL = 1 << 22

    def __init__(self, g: torch.Generator):
        self.g = g
        self._pool: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor, mean: float, std: float) -> torch.Tensor:
        n = t.numel()
        if n <= self.POOL:
            return t.normal_(mean, std, generator=self.g)
        if self._pool is None:
            self._pool = torch.empty(2 * self.POOL)
            self._pool[:self.POOL].normal_(generator=self.g)
            self._pool[self.POOL:] = self._pool[:self.POOL]  # doubled: a stretch from any start is one slice
        stretches = -(-n // self.POOL)
        starts = torch.randint(0, self.POOL, (stretches,), generator=self.g).tolist()
        signs = torch.randint(0, 2, (stretches,), generator=self.g).tolist()
        flat = t.view(-1)
        for i, (start, sign) in enumerate(zip(starts, signs)):
            out = flat[i * self.POOL:(i + 1) * self.POOL]
            torch.mul(self._pool[start:start + out.numel()], std if sign else -std, out=out)
        return t.add_(mean) if mean else t


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

    Streamed (`write_shard`): each file's header is written from the layout before its first tensor is made, then
    each tensor as it comes, by a thread that writes one while the next is made. Making a real-size model's tensors
    (Normals, then the cast to the stored dtype) and writing them to disk both take seconds, and the write releases
    the GIL, so the two overlap; and no more than two tensors are ever in memory, where a whole shard was (8 GB for
    the one-file families)."""
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
    for index, group in enumerate(groups, start=1):
        name = "model.safetensors" if shards == 1 else f"model-{index:05d}-of-{shards:05d}.safetensors"
        write_shard(out / name, [(key, dtype, shape) for key, shape in group],
                    ((key, make(key, shape)) for key, shape in group))
        weight_map.update({k: name for k, _ in group})
        log(f"  {name}: {len(group)} tensors")
    if shards > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return total


def write_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors) -> int:
    """One safetensors file of `entries` (key, dtype, shape), laid out in their order, from `tensors`: (key, tensor)
    pairs in any order, each made only when the previous one is handed to the writer. The header is written first,
    then each tensor at its offset by a thread that writes it while the next is made (the write releases the GIL),
    so at most two are in memory. A tensor unlike its entry, or a key made twice, not in `entries` or never made:
    SystemExit. Returns the tensors' bytes."""
    header = safetensors_header(entries)
    layout, offset = {}, len(header)
    for key, dtype, shape in entries:
        layout[key] = (offset, dtype, tuple(shape))
        offset += math.prod(shape) * dtype.itemsize
    written = set()
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        f.write(header)
        f.flush()
        pending = None
        for key, t in tensors:
            if key not in layout or key in written:
                raise SystemExit(f"error: {key} was made twice" if key in written else
                                 f"error: {key} was made but is not in {path.name}'s layout")
            at, dtype, shape = layout[key]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise SystemExit(f"error: {key} was made as {t.dtype} {tuple(t.shape)}; its layout says "
                                 f"{dtype} {shape}")
            written.add(key)
            if pending is not None:
                pending.result()
            pending = writer.submit(_write_at, f.fileno(), t.contiguous().reshape(-1).view(torch.uint8).numpy(), at)
        if pending is not None:
            pending.result()
    if len(written) < len(layout):
        missing = [key for key in layout if key not in written]
        raise SystemExit(f"error: {len(missing)} tensors of {path.name}'s layout were never made ({missing[0]}, …)")
    return offset - len(header)


def _write_at(fd: int, data, offset: int) -> None:
    """All of `data` into file `fd` from byte `offset` (os.pwrite may write less than it is given)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# safetensors' dtypes in the order of its own enumeration: save_file lays a file's tensors out by it, the last first,
# then by name (safetensors_order).
SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.float32: "F32"}


def safetensors_order(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list:
    """`entries` (key, dtype, shape) in the order safetensors' save_file writes them, so that a file streamed in
    that order (write_shard) holds save_file's bytes: by dtype, the last of SAFETENSORS_DTYPES first, then by key."""
    rank = list(SAFETENSORS_DTYPES)
    return sorted(entries, key=lambda entry: (-rank.index(entry[1]), entry[0]))


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """A safetensors file's length prefix and JSON header for `entries` (key, dtype, shape), stored in the order
    given (the format asks only that each tensor's bytes follow the last one's), padded to 8 bytes as the format's
    writer pads it, with save_pretrained's metadata."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
