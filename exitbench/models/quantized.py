"""Weights a checkpoint ships quantised, read from their safetensors parts and dequantised at load: no quantisation
library, no quantised compute. Two block formats (Inkling 2 Mini's routed experts use both):

- NVFP4: a uint8 tensor of two E2M1 codes per byte (the even element in the low nibble, so its last axis is half the
  logical one), one float8 (E4M3) scale per 16 values in `_scale`, and a per-tensor-slice factor
  `_amax / _outer_scale_denominator` (one per expert: the leading axis). value = code × scale × amax / denominator.
- MXFP8: float8 (E4M3) values with one power-of-two scale per 32 in `_scale`, a byte s meaning 2^(s − 127) (stored as
  U8, or as F8_E8M0, whose value is that power already).

Both are dequantised in float32 and cast once to the run's dtype, in the order transformers' loader computes them
(transformers' `inkling2_loop` loader), so a dequantised weight equals the reference's bit for bit.
A checkpoint's parts are grouped under the logical key into one entry (`shards.group_quantized`), which
`shards.read_tensors` reads part by part and dequantises here, and which `info` counts from the headers alone.
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32
# Slices of the leading (expert) axis dequantised at a time: the float32 intermediates of a few experts, not of all.
CHUNK = 8


@torch.no_grad()
def dequantize(fmt: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The logical tensor of format `fmt` at `dtype`, from its parts as stored ("weight", "scale", and for NVFP4
    "amax", "denominator")."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(parts["weight"], parts["scale"], parts["amax"], parts["denominator"], dtype)
    return dequantize_mxfp8(parts["weight"], parts["scale"], dtype)


def dequantize_nvfp4(codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, denominator: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """(n, rows, cols / 2) bytes of E2M1 pairs → (n, rows, cols) at `dtype`."""
    n, rows = codes.shape[:2]
    out = torch.empty(n, rows, 2 * codes.shape[-1], dtype=dtype)
    table = torch.tensor(E2M1_VALUES)
    byte = torch.arange(256)
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)  # a byte's (low, high) values
    factor = amax.float().reshape(n) / denominator.float().reshape(n)
    for first in range(0, n, CHUNK):
        part = slice(first, first + CHUNK)
        block_scale = scale[part].float()
        values = pairs[codes[part].long()].view(*block_scale.shape, NVFP4_BLOCK) * block_scale[..., None]
        values = values * factor[part, None, None, None]
        out[part] = values.reshape(-1, rows, out.shape[-1]).to(dtype)
    return out


def dequantize_mxfp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 values (…, cols) with (…, cols / 32) exponent bytes → (…, cols) at `dtype` (any tensor: an expert
    stack or a plain matrix)."""
    out = torch.empty(values.shape, dtype=dtype)
    for first in range(0, values.shape[0], CHUNK):
        part = slice(first, first + CHUNK)
        block_scale = scale[part]
        # An E8M0 scale's value is the power of two itself; a byte is its biased exponent.
        power = block_scale.float() if block_scale.dtype == torch.float8_e8m0fnu else \
            torch.exp2(block_scale.float() - 127)
        blocks = values[part].float().view(*block_scale.shape, MXFP8_BLOCK) * power[..., None]
        out[part] = blocks.view(out[part].shape).to(dtype)
    return out


def _e2m1_table() -> tuple[int, torch.Tensor]:
    """nearest_e2m1's lookup: a float32's magnitude bits, less one, shifted right 21 (a key in the value's order) →
    its magnitude code (0-7), then the same keys of a negative value → its signed code (+8, but +0 for zero). Each
    midpoint between codes has two significant bits, so its low 21 bits are 0 and a magnitude lies above it exactly
    when its key is at least the midpoint's; the keys below the first midpoint's or past the last one's share a code."""
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    edges = ((magnitudes[1:] + magnitudes[:-1]) / 2).view(torch.int32) >> 21
    keys = torch.arange(int(edges[0]) - 1, int(edges[-1]) + 1, dtype=torch.int32)
    index = (keys[:, None] >= edges).sum(-1)
    return int(keys[0]), torch.cat([index, torch.where(index > 0, index + 8, index)])


E2M1_LOW, E2M1_TABLE = _e2m1_table()


def nearest_e2m1(unit: torch.Tensor) -> torch.Tensor:
    """The E2M1 code nearest each float32 value, a tie to the smaller magnitude and anything that rounds to zero to
    +0 (code 0): what an argmin over the 16 codes gives, found by looking up the magnitude's leading bits (the
    exponent and two mantissa bits, against the codes' midpoints) instead of measuring all 16 distances (16 times
    the weights' size, minutes on a real-size checkpoint). The same codes as bucketing the magnitude between the
    midpoints (torch.bucketize, checked over all 2^32 float32 bit patterns, NaN and infinities included), in less
    than half its time: a few in-place integer passes and a gather instead of a binary search per value."""
    size = len(E2M1_TABLE) // 2
    key = (unit.view(torch.int32) & 0x7FFFFFFF).sub_(1).bitwise_right_shift_(21).clamp_(E2M1_LOW, E2M1_LOW + size - 1)
    return E2M1_TABLE[key.sub_(E2M1_LOW).add_(unit < 0, alpha=size)]


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """(n, rows, cols) weights as NVFP4 parts, each value rounded to its nearest code under its block's scale: what
    random checkpoints in a quantised layout store (bench/, tests/fixtures/). Keys are the suffixes after `K`."""
    n = w.shape[0]
    w = w.float()
    amax = w.abs().flatten(1).amax(1).clamp(min=1e-12)
    denominator = torch.full((n,), 6.0 * 448.0)  # so that the largest block scale is float8's largest, 448
    factor = amax / denominator
    blocks = w.view(*w.shape[:-1], -1, NVFP4_BLOCK)
    scale = (blocks.abs().amax(-1) / 6 / factor[:, None, None]).to(torch.float8_e4m3fn)
    unit = blocks / (scale.float() * factor[:, None, None]).clamp(min=1e-30)[..., None]
    codes = nearest_e2m1(unit).view(*w.shape[:-1], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return {"": packed, "_scale": scale, "_amax": amax, "_outer_scale_denominator": denominator}


def quantize_mxfp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weights as MXFP8 parts: per block of 32 the least power of two that brings its largest value within float8's
    448, the values divided by it and rounded to float8."""
    blocks = w.float().view(*w.shape[:-1], -1, MXFP8_BLOCK)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-30) / 448)).clamp(-127, 127) + 127
    values = (blocks / torch.exp2(exponent - 127)[..., None]).to(torch.float8_e4m3fn).view(w.shape)
    return {"": values, "_scale": exponent.to(torch.uint8)}
