"""Inkling 2 Mini's text model read from the release's layout and formats, held to transformers' in-tree reference.

tests/fixtures/inkling2-tiny is a random Inkling 2 text model at toy widths with every mechanism of the release
(sliding and full layers, relative bias, sinks, log scaling within the fixture's positions, static and dynamic
short convolutions, block attention residuals, 3 passes with messages and their gates, routed experts, a padded
head), its experts stored as shipped (NVFP4 in layers 0-5, MXFP8 in 6-7) and its zero-initialised reference
parameters drawn random: tests/fixtures/make_inkling2_tiny.py made it with exitbench alone.
tests/fixtures/inkling2-tiny-reference.safetensors holds what transformers 5.24.0's `inkling2_loop` computed on it
after dequantising the experts itself (tests/fixtures/make_inkling2_reference.py, in a scratch environment).

What is here is the model: its uncached forward at every pass count. The exit engine does not hold its caches yet
(keys and values per layer visit and pass, and four convolution states per visit), and refuses it in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError, ExitbenchError
from exitbench.models.checkpoint import inspect_checkpoint, load_checkpoint
from exitbench.models.inkling2 import Inkling2
from exitbench.models.shards import QuantizedEntry

FIXTURES = Path(__file__).parent / "fixtures"
# The reference's own float32 logits sit 1.2e-5 from its float64 ones after 3 passes (magnitudes up to 2.5): that
# is the rounding a float32 implementation may differ by. exitbench's float32 logits are 1.5e-5 from the reference's
# float32 ones and 1.0e-5 from its float64 ones (its experts run as one grouped matmul, exitbench's one expert at a
# time; the depth attentions broadcast their queries): within the reference's own gap. 1e-4 is 8 times that gap.
ATOL = 1e-4


@pytest.fixture(scope="module")
def ck():
    return load_checkpoint(FIXTURES / "inkling2-tiny")


@pytest.fixture(scope="module")
def ref():
    return load_file(str(FIXTURES / "inkling2-tiny-reference.safetensors"))


def test_the_release_layout_loads_with_its_names_and_quantised_experts(ck):
    model = ck.model
    assert isinstance(model, Inkling2) and model.architecture == "inkling2_loop_text"
    keys = set(model.state_dict())
    assert {"model.llm.embed.weight", "model.llm.embed_norm.weight", "model.llm.unembed.weight",
            "model.llm.attn_res.attn_queries.0", "model.llm.attn_res.output_query",
            "model.llm.middle_cycle_cross_pass_queries", "model.llm.layers.1.attn.k_sconv.static_w",
            "model.llm.layers.2.controllers.attn.gain_weight", "model.llm.layers.3.mlp.experts.w13_weight",
            "model.llm.layers.0.attn.rel_logits_proj.proj", "model.llm.layers.0.mlp.gate.bias"} <= keys
    layout = inspect_checkpoint(FIXTURES / "inkling2-tiny")
    nv, mx = layout.entries["model.llm.layers.0.mlp.experts.w13_weight"], \
        layout.entries["model.llm.layers.7.mlp.experts.w2_weight"]
    assert isinstance(nv, QuantizedEntry) and nv.format == "nvfp4" and nv.shape == (4, 64, 64)
    assert isinstance(mx, QuantizedEntry) and mx.format == "mxfp8" and mx.shape == (4, 64, 32)
    (group,) = model.loop_groups()
    assert (group.default_steps, group.max_steps, group.n_layers) == (3, 3, 4)
    assert model.output_size == 300 and model.llm.unembed.weight.shape[0] == 320  # the padded head, read to 300


@torch.no_grad()
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_logits_after_every_pass_count_match_the_reference(ck, ref, passes):
    """One pass is the exit after pass 1 (the coda on its blocks), two after pass 2; three are the trained depth.
    The reference sets loop_num_passes before it builds the model; exitbench runs the loop group that many steps."""
    torch.testing.assert_close(ck.model(ref["input_ids"], passes), ref[f"logits_{passes}"], atol=ATOL, rtol=0)


@torch.no_grad()
def test_greedy_generation_at_three_passes_matches_the_reference(ck, ref):
    """Uncached, token by token: the reference decoded with its cache (which equalled its uncached forwards)."""
    for row, n, want in zip(ref["input_ids"], ref["greedy_prompt_lengths"].tolist(), ref["greedy_tokens"].tolist()):
        seq = row[:n].tolist()
        for _ in range(5):
            seq.append(int(ck.model(torch.tensor([seq]), 3)[0, -1].argmax()))
        assert seq[n:] == want


@torch.no_grad()
def test_a_batch_gives_each_row_what_it_gives_alone(ck, ref):
    """Rows never mix (the router, the convolutions and the attention are per row); the batch shape moves float32
    rounding only (1.5e-5 measured: the size of the reference's own float32 gap, so ATOL again)."""
    ids = ref["input_ids"]
    together = ck.model(ids, 3)
    for b in range(len(ids)):
        alone = ck.model(ids[b:b + 1], 3)[0]
        torch.testing.assert_close(alone, together[b], atol=ATOL, rtol=0)
        assert torch.equal(alone.argmax(-1), together[b].argmax(-1))


def release(tmp_path: Path, **text_fields) -> Path:
    """The fixture as the multimodal release packs it: model_type inkling2_loop, the text config under text_config
    with its loop under loop_config, a vision tower beside the text model's weights."""
    path = tmp_path / "release"
    shutil.copytree(FIXTURES / "inkling2-tiny", path)
    text = json.loads((path / "config.json").read_text())
    loop = {"core_start": text.pop("loop_layer_index_start"), "core_end": text.pop("loop_layer_index_end"),
            "num_passes": text.pop("loop_num_passes"), "gate_rank": text.pop("loop_gate_rank")}
    text.update({"loop_config": loop, **text_fields})
    (path / "config.json").write_text(json.dumps({"model_type": "inkling2_loop", "text_config": text,
                                                  "architectures": ["Inkling2LoopForConditionalGeneration"]}))
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.visual.backbone.ln_pre.weight"] = torch.ones(8)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@torch.no_grad()
def test_the_multimodal_release_loads_as_its_text_model(tmp_path, ck, ref):
    model = load_checkpoint(release(tmp_path)).model
    assert model.config.loop_layer_index_start == 2 and model.config.loop_num_passes == 3
    torch.testing.assert_close(model(ref["input_ids"], 3), ck.model(ref["input_ids"], 3), atol=0, rtol=0)


@pytest.mark.parametrize("fields,named", [
    ({"layer_types": ["hybrid"] * 7}, "layer_types"),
    ({"loop_config": {"core_start": 3, "core_end": 6, "num_passes": 3, "gate_rank": 8}}, "loop layers"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"unpadded_vocab_size": 400}, "unpadded_vocab_size"),
])
def test_what_it_does_not_implement_is_refused_in_one_line(tmp_path, fields, named):
    with pytest.raises(CheckpointError, match=named) as err:
        load_checkpoint(release(tmp_path, **fields))
    assert "\n" not in str(err.value)


def test_the_engine_refuses_it_in_one_line_until_it_holds_its_caches(ck):
    with pytest.raises(ExitbenchError, match="inkling2_loop_text: the exit engine does not hold") as err:
        ExitEngine(ck.model, ExitConfig("fixed"))
    assert "\n" not in str(err.value)


def test_what_the_reference_pins_stays_float32_in_a_bfloat16_run():
    """Routers, small convolutions, depth queries and message-gate outputs load in float32 under --dtype bfloat16,
    as the reference keeps them; the rest at the run's dtype. (The random fixture's bfloat16 logits are not compared:
    its three passes of random experts amplify bfloat16 rounding to the logits' own size, in the reference too.)"""
    model = load_checkpoint(FIXTURES / "inkling2-tiny", dtype="bfloat16").model
    state = model.state_dict()
    pinned = {k for k, v in state.items() if v.dtype == torch.float32}
    assert pinned == model.float32_keys()
    assert {"model.llm.layers.3.mlp.gate.bias", "model.llm.layers.0.attn.k_sconv.weight",
            "model.llm.attn_res.output_query", "model.llm.layers.2.controllers.mlp.gain_weight"} <= pinned
    assert state["model.llm.layers.1.attn.k_sconv.static_w"].dtype == torch.bfloat16  # (the dynamic taps are not)
    assert state["model.llm.layers.3.mlp.experts.w13_weight"].dtype == torch.bfloat16
