"""Safetensors files read by hand: what a shard holds from its header alone, and each tensor read straight into
the one buffer the model will keep.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. Reading the header is enough to describe a checkpoint (`exitbench info` on a
15 GB model reads kilobytes) and to check it against the config before any weight is touched. The weights are
then read with plain file reads into tensors allocated at their final dtype: no memory map whose touched pages
count as a second copy, and a dtype conversion goes through a bounded scratch buffer, so loading a checkpoint
peaks at about its weights' bytes in the dtype the run uses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

# safetensors' dtype codes (https://github.com/huggingface/safetensors, format.md) that torch can hold.
DTYPE_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}
# A header larger than this is not a header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
# Converting dtypes goes through a scratch buffer of this size: 64 MiB bounds the extra memory of a conversion
# while keeping reads large enough to run at disk speed.
SCRATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its shard file, stored dtype and shape, and absolute byte range in the file."""

    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor entry of one safetensors file, checked against the file's length (a file cut short is named
    as truncated here, before anything is read)."""
    name = file.name
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated or corrupt: {size} bytes, shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{file} is truncated or corrupt: its header claims {n:,} bytes, the file has "
                                  f"{size:,}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is truncated or corrupt: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is truncated or corrupt: its header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} has no dtype, shape and "
                                  "data_offsets") from None
        if code not in DTYPE_CODES:
            raise CheckpointError(f"{file}: tensor {key} has dtype {code}, which exitbench cannot load; "
                                  f"known: {', '.join(DTYPE_CODES)}")
        entry = TensorEntry(name, DTYPE_CODES[code], shape, base + int(begin), base + int(end))
        if entry.nbytes != entry.numel * entry.dtype.itemsize or entry.nbytes < 0:
            raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} spans {entry.nbytes} bytes, its "
                                  f"shape {list(shape)} in {code} needs {entry.numel * entry.dtype.itemsize}")
        if entry.end > size:
            raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} ends at byte {entry.end:,}, the "
                                  f"file has {size:,}")
        out[key] = entry
    return out


def scan(path: Path, shards: dict[str, list[str]], index_name: str) -> dict[str, TensorEntry]:
    """The entries of every shard, checked against the index: each indexed key is in its shard, no key is in two."""
    entries: dict[str, TensorEntry] = {}
    for shard, indexed_keys in shards.items():
        found = read_header(path / shard)
        for key in indexed_keys:
            if key not in found:
                raise CheckpointError(f"key {key} is in {index_name} but not in shard {shard}")
        for key, entry in found.items():
            if key in entries:
                raise CheckpointError(f"key {key} appears in more than one shard ({shard})")
            entries[key] = entry
    return entries


def read_tensors(path: Path, wanted: dict[str, TensorEntry], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The `wanted` tensors, floating ones at `dtype` (others as stored), shard by shard in file order."""
    out: dict[str, torch.Tensor] = {}
    by_shard: dict[str, list[tuple[str, TensorEntry]]] = {}
    for key, entry in wanted.items():
        by_shard.setdefault(entry.shard, []).append((key, entry))
    for shard, items in by_shard.items():
        # Unbuffered: readinto then fills the tensor from the kernel's page cache with no Python-side copy.
        with open(path / shard, "rb", buffering=0) as fh:
            for key, entry in sorted(items, key=lambda kv: kv[1].start):
                target = dtype if entry.dtype.is_floating_point else entry.dtype
                out[key] = _read_one(fh, path / shard, key, entry, target)
    return out


def _read_one(fh, file: Path, key: str, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=dtype)
    if entry.numel == 0:
        return out
    flat = out.view(-1)
    if dtype == entry.dtype:
        _fill(fh, file, key, entry.start, flat)
        return out
    step = max(1, SCRATCH_BYTES // entry.dtype.itemsize)
    scratch = torch.empty(min(step, entry.numel), dtype=entry.dtype)
    for i in range(0, entry.numel, step):
        m = min(step, entry.numel - i)
        _fill(fh, file, key, entry.start + i * entry.dtype.itemsize, scratch[:m])
        flat[i:i + m].copy_(scratch[:m])
    return out


def _fill(fh, file: Path, key: str, offset: int, dst: torch.Tensor) -> None:
    """Read dst's bytes from `offset` of the open file into dst (a contiguous 1-d tensor)."""
    view = memoryview(dst.view(torch.uint8).numpy()).cast("B")
    fh.seek(offset)
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} ends early (file changed while "
                                  "it was read?)")
        got += n

