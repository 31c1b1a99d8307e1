"""Quantised weights read from their safetensors parts and dequantised at load (exitbench/models/quantized.py),
held to transformers' own loader op on random NVFP4 and MXFP8 expert tensors
(tests/fixtures/quantized-experts.safetensors; tests/fixtures/make_quantized_reference.py is how)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitbench.errors import CheckpointError
from exitbench.models.checkpoint import load_checkpoint
from exitbench.models.quantized import quantize_mxfp8, quantize_nvfp4
from exitbench.models.shards import QuantizedEntry, group_quantized, read_header, read_tensors

from helpers.files import fixture_copy

FIXTURES = Path(__file__).parent / "fixtures"
FILE = "quantized-experts.safetensors"


@pytest.fixture(scope="module")
def grouped():
    return group_quantized(read_header(FIXTURES / FILE))


def test_parts_are_grouped_under_the_logical_key_with_its_logical_shape(grouped):
    nv, mx, e8 = grouped["nvfp4.w13_weight"], grouped["mxfp8.w2_weight"], grouped["mxfp8e8m0.w2_weight"]
    assert isinstance(nv, QuantizedEntry) and nv.format == "nvfp4" and nv.shape == (11, 6, 64)
    assert set(nv.parts) == {"weight", "scale", "amax", "denominator"} and nv.numel == 11 * 6 * 64
    assert nv.nbytes == 11 * 6 * 32 + 11 * 6 * 4 + 2 * 11 * 4  # codes, one scale byte per 16, two floats per expert
    assert (mx.format, mx.shape, e8.format) == ("mxfp8", (11, 64, 96), "mxfp8")
    assert not any(k.endswith(("_scale", "_amax", "_outer_scale_denominator")) for k in grouped)
    assert not isinstance(grouped["reference.nvfp4.float32"], QuantizedEntry)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantised_equals_the_reference_loader_bit_for_bit(grouped, dtype):
    """Eleven experts: the reference dequantises eight at a time, and so does exitbench; both cast once."""
    name = str(dtype).removeprefix("torch.")
    keys = ["nvfp4.w13_weight", "mxfp8.w2_weight", "mxfp8e8m0.w2_weight",
            f"reference.nvfp4.{name}", f"reference.mxfp8.{name}"]
    got = read_tensors(FIXTURES, {k: grouped[k] for k in keys}, dtype)
    assert got["nvfp4.w13_weight"].dtype == dtype
    assert torch.equal(got["nvfp4.w13_weight"], got[f"reference.nvfp4.{name}"])
    assert torch.equal(got["mxfp8.w2_weight"], got[f"reference.mxfp8.{name}"])
    # an E8M0 scale holds the power of two itself: the same weights as its exponent byte
    assert torch.equal(got["mxfp8e8m0.w2_weight"], got["mxfp8.w2_weight"])


def test_an_nvfp4_byte_holds_the_even_element_in_its_low_nibble(tmp_path):
    """0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second; 0xF9: -0.5 then -6; scale 2, amax/denominator 3."""
    parts = {"w": torch.tensor([[[0x21, 0xF9] * 8]], dtype=torch.uint8),
             "w_scale": torch.full((1, 1, 2), 2.0).to(torch.float8_e4m3fn),
             "w_amax": torch.tensor([6.0]), "w_outer_scale_denominator": torch.tensor([2.0])}
    save_file(parts, str(tmp_path / "q.safetensors"))
    grouped = group_quantized(read_header(tmp_path / "q.safetensors"))
    (w,) = read_tensors(tmp_path, grouped, torch.float32).values()
    assert w[0, 0, :4].tolist() == [0.5 * 6, 1.0 * 6, -0.5 * 6, -6.0 * 6]


@pytest.mark.parametrize("case,named", [
    ("amax without denominator", "_outer_scale_denominator"),
    ("scale of the wrong shape", "_scale has shape"),
    ("nvfp4 codes stored as floats", "U8 codes"),
])
def test_inconsistent_parts_are_refused_in_one_line(tmp_path, case, named):
    w = torch.zeros(2, 3, 8, dtype=torch.uint8)
    parts = {"w": w, "w_scale": torch.ones(2, 3, 1).to(torch.float8_e4m3fn), "w_amax": torch.ones(2),
             "w_outer_scale_denominator": torch.ones(2)}
    if case == "amax without denominator":
        del parts["w_outer_scale_denominator"]
    elif case == "scale of the wrong shape":
        parts["w_scale"] = torch.ones(2, 3, 2).to(torch.float8_e4m3fn)
    else:
        parts["w"] = torch.zeros(2, 3, 8)
    save_file(parts, str(tmp_path / "q.safetensors"))
    with pytest.raises(CheckpointError, match=named) as err:
        group_quantized(read_header(tmp_path / "q.safetensors"))
    assert "\n" not in str(err.value)


def test_a_float8_weight_without_scales_is_refused(tmp_path):
    """Float8 values mean something only with their block scales: a bare one is not cast and used."""
    path = fixture_copy(tmp_path, "hrm-text-tiny")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.z_L_init"] = tensors["model.z_L_init"].to(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.z_L_init.*F8_E4M3.*_scale"):
        load_checkpoint(path)


def test_any_checkpoint_may_store_a_weight_as_mxfp8(tmp_path):
    """The loader groups quantised parts for every family: HRM-Text's head stored as MXFP8 loads as its
    dequantised values, and the model computes with them."""
    path = fixture_copy(tmp_path, "hrm-text-tiny")
    tensors = load_file(str(path / "model.safetensors"))
    head = tensors.pop("lm_head.weight")  # (320, 64): two blocks of 32 per row
    # each block's power of two: the least that brings its largest value within float8's 448
    exponent = torch.ceil(torch.log2(head.view(320, 2, 32).abs().amax(-1) / 448)) + 127
    values = (head.view(320, 2, 32) / torch.exp2(exponent - 127)[..., None]).to(torch.float8_e4m3fn).view(320, 64)
    tensors.update({"lm_head.weight": values, "lm_head.weight_scale": exponent.to(torch.uint8)})
    save_file(tensors, str(path / "model.safetensors"))
    model = load_checkpoint(path).model
    want = values.float().view(320, 2, 32) * torch.exp2(exponent - 127)[..., None]
    assert torch.equal(model.lm_head.weight, want.view(320, 64))
    # float8 keeps 3 mantissa bits: each value within 2^-4 of itself, relative
    assert ((model.lm_head.weight - head).abs() <= head.abs() / 16 + 1e-12).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_quantising_rounds_to_the_nearest_code_and_decodes_back(tmp_path, fmt):
    """What random checkpoints in a quantised layout store: decoded, each value sits within half a code step of
    the original (E2M1's steps are 0.5 to 2 units of its block scale; float8's 3 mantissa bits, 1/16 relative)."""
    w = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(2))
    quantize = quantize_nvfp4 if fmt == "nvfp4" else quantize_mxfp8
    parts = quantize(w)
    save_file({"w" + suffix: t for suffix, t in parts.items()}, str(tmp_path / "q.safetensors"))
    (decoded,) = read_tensors(tmp_path, group_quantized(read_header(tmp_path / "q.safetensors")),
                              torch.float32).values()
    if fmt == "nvfp4":
        unit = parts["_scale"].float() * (parts["_amax"] / parts["_outer_scale_denominator"])[:, None, None]
        assert ((decoded - w).abs().view(3, 4, -1, 16) <= unit[..., None] + 1e-6).all()
    else:
        assert ((decoded - w).abs() <= w.abs() / 16 + 1e-6).all()


def test_the_nearest_code_is_the_argmin_over_all_sixteen():
    """nearest_e2m1 buckets magnitudes between the codes' midpoints; it must pick what measuring all 16 distances
    picks, ties (each midpoint, ±), the floats either side of each and signed zeros included."""
    from exitbench.models.quantized import E2M1_VALUES, nearest_e2m1

    values = torch.tensor(E2M1_VALUES)
    ties = (values[1:8] + values[:7]) / 2
    ties = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(9.0))])
    unit = torch.cat([torch.randn(100_000, generator=torch.Generator().manual_seed(3)) * 4, ties, -ties,
                      torch.tensor([0.0, -0.0, 6.5, -6.5, 40.0, -40.0])])  # past 6: a scale rounded down
    assert torch.equal(nearest_e2m1(unit), (unit[:, None] - values).abs().argmin(-1))
