"""Safetensors files read by hand: what a shard holds from its header alone, and each tensor read straight into
the one buffer the model will keep.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. Reading the header is enough to describe a checkpoint (`exitbench info` on a
15 GB model reads kilobytes) and to check it against the config before any weight is touched. The weights are
then read with plain file reads into tensors allocated at their final dtype: no memory map whose touched pages
count as a second copy, and a dtype conversion goes through a bounded scratch buffer, so loading a checkpoint
peaks at about its weights' bytes in the dtype the run uses.

Since nothing else parses the header, it is checked here as strictly as the `safetensors` library checks it:
integer offsets in bounds, byte lengths equal to shape × dtype size, and tensors that tile the data section
with no byte shared or unclaimed. All of it is arithmetic on the header and the file's length; a header that
lies would otherwise load one tensor's bytes as another's, and the model would run, wrongly.

A tensor stored block-quantised (NVFP4, MXFP8: models/quantized.py) is several tensors in the file; its parts are
grouped into one logical entry (`group_quantized`), read as stored and dequantised to the run's dtype.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .quantized import MXFP8_BLOCK, NVFP4_BLOCK, dequantize

# safetensors' dtype codes (https://github.com/huggingface/safetensors, format.md) that torch can hold.
DTYPE_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
               "F8_E8M0": torch.float8_e8m0fnu}
DTYPE_NAMES = {dtype: code for code, dtype in DTYPE_CODES.items()}
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
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class QuantizedEntry:
    """A tensor stored as block-quantised parts (models/quantized.py): its logical (dequantised) shape, and where
    its parts lie."""

    format: str  # "nvfp4" or "mxfp8"
    shape: tuple[int, ...]
    parts: dict[str, TensorEntry]  # "weight", "scale", and for NVFP4 "amax", "denominator"

    dtype = torch.float32  # what it holds once read: floating, converted to the run's dtype like any weight

    @property
    def shard(self) -> str:
        return self.parts["weight"].shard

    @property
    def start(self) -> int:
        return self.parts["weight"].start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on disk, every part included."""
        return sum(p.nbytes for p in self.parts.values())


QUANTIZED_SUFFIXES = ("_scale", "_amax", "_outer_scale_denominator")


def group_quantized(entries: dict[str, TensorEntry]) -> dict[str, TensorEntry | QuantizedEntry]:
    """`entries` with every quantised tensor's parts (`K`, `K_scale`, and for NVFP4 `K_amax`,
    `K_outer_scale_denominator`) replaced by one QuantizedEntry under `K`; every other entry as it is."""
    out: dict[str, TensorEntry | QuantizedEntry] = {}
    taken = set()
    for key, entry in entries.items():
        scale = entries.get(key + "_scale")
        if scale is None or key.endswith(QUANTIZED_SUFFIXES):
            continue
        amax, denominator = entries.get(key + "_amax"), entries.get(key + "_outer_scale_denominator")
        out[key] = quantized_entry(key, entry, scale, amax, denominator)
        taken |= {key, key + "_scale", key + "_amax", key + "_outer_scale_denominator"}
    out.update({k: v for k, v in entries.items() if k not in taken})
    return out


def quantized_entry(key: str, weight: TensorEntry, scale: TensorEntry, amax: TensorEntry | None,
                    denominator: TensorEntry | None) -> QuantizedEntry:
    """The logical entry of one quantised tensor, its parts' dtypes and shapes checked against each other."""
    if (amax is None) != (denominator is None):
        has, lacks = ("_amax", "_outer_scale_denominator") if amax else ("_outer_scale_denominator", "_amax")
        raise CheckpointError(f"{weight.shard}: {key}{has} is there but {key}{lacks} is not; NVFP4 needs both "
                              "(MXFP8 neither)")
    lead, last = weight.shape[:-1], weight.shape[-1] if weight.shape else 0
    if amax is not None:
        fmt, shape, block = "nvfp4", (*lead, 2 * last), NVFP4_BLOCK
        if len(shape) != 3:
            raise CheckpointError(f"{weight.shard}: {key} is NVFP4 of shape {shape}; exitbench reads NVFP4 as a stack "
                                  "of expert matrices (3 axes, one amax per expert), as Inkling 2 Mini ships it")
        if weight.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{weight.shard}: {key} is NVFP4 (it has an _amax) but is stored as {weight.dtype} "
                                  f"with {scale.dtype} scales; NVFP4 stores U8 codes and F8_E4M3 scales")
        experts = weight.shape[0] if weight.shape else 0
        for name, part in (("_amax", amax), ("_outer_scale_denominator", denominator)):
            if part.numel != experts:
                raise CheckpointError(f"{weight.shard}: {key}{name} holds {part.numel} values; NVFP4 needs one per "
                                      f"slice of the leading axis ({experts})")
    else:
        fmt, shape, block = "mxfp8", tuple(weight.shape), MXFP8_BLOCK
        if weight.dtype != torch.float8_e4m3fn or scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
            raise CheckpointError(f"{weight.shard}: {key} has a _scale and no _amax, so MXFP8, but is stored as "
                                  f"{weight.dtype} with {scale.dtype} scales; MXFP8 stores F8_E4M3 values and U8 or "
                                  "F8_E8M0 scales")
    if not shape or shape[-1] % block or tuple(scale.shape) != (*shape[:-1], shape[-1] // block):
        raise CheckpointError(f"{weight.shard}: {key}_scale has shape {tuple(scale.shape)}; {fmt} values of shape "
                              f"{shape} need one scale per {block}: {(*shape[:-1], shape[-1] // block)}")
    parts = {"weight": weight, "scale": scale}
    if amax is not None:
        parts.update(amax=amax, denominator=denominator)
    return QuantizedEntry(fmt, shape, parts)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor entry of one safetensors file, checked as strictly as the format (and the `safetensors`
    library) checks it, from the header and the file's length alone: offsets and shape dimensions are
    non-negative integers, each tensor's byte length is its shape times its dtype's size, and the tensors,
    in file order, tile the data section exactly. A file cut short is named as truncated; two tensors sharing
    bytes, or bytes no tensor claims, as corrupt: either way before anything is read."""
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
    metadata = header.get("__metadata__") or {}  # absent and null alike: the format's metadata is optional
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file} is corrupt: its __metadata__ must map names to strings, got "
                              f"{_shown(metadata)}")
    base, data_bytes = 8 + n, size - 8 - n
    out: dict[str, TensorEntry] = {}
    for key, spec in header.items():
        if key != "__metadata__":
            out[key] = _entry(file, key, spec, base, size)
    _check_tiling(file, out, base, data_bytes)
    return out


def _entry(file: Path, key: str, spec: Any, base: int, size: int) -> TensorEntry:
    """One header entry as a TensorEntry, or one line saying which of its fields is wrong and how."""
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} has no dtype, shape and "
                              "data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    # Strict like the format's own parser: "512" or 512.0 is not an offset and true is not a dimension,
    # though Python's int() would take all three.
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{file} is corrupt: tensor {key} has shape {_shown(shape)}; a shape is a list of "
                              "non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{file} is corrupt: tensor {key} has data_offsets {_shown(offsets)}; they must be "
                              "two integers, begin and end, with 0 ≤ begin ≤ end")
    if not isinstance(code, str) or code not in DTYPE_CODES:
        raise CheckpointError(f"{file}: tensor {key} has dtype {_shown(code)}, which exitbench cannot load; "
                              f"known: {', '.join(DTYPE_CODES)}")
    begin, end = offsets
    entry = TensorEntry(file.name, DTYPE_CODES[code], tuple(shape), base + begin, base + end)
    if entry.nbytes != entry.numel * entry.dtype.itemsize:
        raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} spans {entry.nbytes} bytes, its "
                              f"shape {shape} in {code} needs {entry.numel * entry.dtype.itemsize}")
    if entry.end > size:
        raise CheckpointError(f"{file} is truncated or corrupt: tensor {key} ends at byte {entry.end:,}, the "
                              f"file has {size:,}")
    return entry


def _check_tiling(file: Path, entries: dict[str, TensorEntry], base: int, data_bytes: int) -> None:
    """The tensors, by start offset, must cover the data section end to end with no byte shared or left over.

    Two tensors sharing bytes would each load the other's values (the format has no aliasing), and bytes no
    tensor claims mean the header and the data disagree about where tensors lie; `safetensors` refuses both.
    Zero-size tensors take no bytes, so they may sit at any boundary."""
    at, previous = base, None
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end, kv[0])):
        if e.start < at:
            raise CheckpointError(f"{file} is corrupt: tensor {key} (data bytes {e.start - base:,}–{e.end - base:,}) "
                                  f"overlaps tensor {previous} (data bytes up to {at - base:,}); each tensor needs "
                                  "bytes of its own")
        if e.start > at:
            where = f"after tensor {previous}" if previous else "at the start of the data"
            raise CheckpointError(f"{file} is corrupt: {e.start - at:,} bytes {where}, before tensor {key}, "
                                  "belong to no tensor; the header's data_offsets must tile the data exactly")
        at, previous = e.end, key
    if at - base < data_bytes:  # never more: each tensor's end was checked against the file's length
        where = f"after the last tensor ({previous})" if previous else "of data (the header names no tensor)"
        raise CheckpointError(f"{file} is corrupt: {data_bytes - (at - base):,} bytes {where} belong to no "
                              "tensor; the header's data_offsets must tile the data exactly")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "…"


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


def read_tensors(path: Path, wanted: dict[str, TensorEntry | QuantizedEntry], dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """The `wanted` tensors, floating ones at `dtype` (others as stored), shard by shard in file order; a quantised
    one read as its parts, as stored, and dequantised to `dtype` (models/quantized.py)."""
    quantized = {key: entry for key, entry in wanted.items() if isinstance(entry, QuantizedEntry)}
    out: dict[str, torch.Tensor] = {}
    for key, entry in quantized.items():
        parts = {name: _read_one_file(path, f"{key}:{name}", part) for name, part in entry.parts.items()}
        out[key] = dequantize(entry.format, parts, dtype)
    by_shard: dict[str, list[tuple[str, TensorEntry]]] = {}
    for key, entry in wanted.items():
        if key not in quantized:
            by_shard.setdefault(entry.shard, []).append((key, entry))
    for shard, items in by_shard.items():
        # Unbuffered: readinto then fills the tensor from the kernel's page cache with no Python-side copy.
        with open(path / shard, "rb", buffering=0) as fh:
            for key, entry in sorted(items, key=lambda kv: kv[1].start):
                target = dtype if entry.dtype.is_floating_point else entry.dtype
                out[key] = _read_one(fh, path / shard, key, entry, target)
    return out


def _read_one_file(path: Path, key: str, entry: TensorEntry) -> torch.Tensor:
    """One tensor as stored, opening its shard for it (a quantised tensor's parts)."""
    with open(path / entry.shard, "rb", buffering=0) as fh:
        return _read_one(fh, path / entry.shard, key, entry, entry.dtype)


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

