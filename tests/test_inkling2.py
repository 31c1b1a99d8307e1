"""Inkling 2 Mini's text model read from the release's layout and formats, held to transformers' in-tree reference.

tests/fixtures/inkling2-tiny is a random Inkling 2 text model at toy widths with every mechanism of the release
(sliding and full layers, relative bias, sinks, log scaling within the fixture's positions, static and dynamic
short convolutions, block attention residuals, 3 passes with messages and their gates, routed experts, a padded
head), its experts stored as shipped (NVFP4 in layers 0-5, MXFP8 in 6-7) and its zero-initialised reference
parameters drawn random: tests/fixtures/make_inkling2_tiny.py made it with exitbench alone.
tests/fixtures/inkling2-tiny-reference.safetensors holds what transformers 5.24.0's `inkling2_loop` computed on it
after dequantising the experts itself (tests/fixtures/make_inkling2_reference.py, in a scratch environment).

The engine holds its caches: keys and values per layer visit and pass, and beside them each visit's four
convolution inputs (`state_layers`), so exits after pass 1 or 2 run physically (later tokens read an exited token's
exit pass) or by `select`. Scoring runs token-major (waves do not gather the convolution states).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError
from exitbench.models.checkpoint import inspect_checkpoint, load_checkpoint
from exitbench.models.inkling2 import Inkling2
from exitbench.models.shards import QuantizedEntry

from helpers.files import fixture_and_reference, fixture_copy

FIXTURES = Path(__file__).parent / "fixtures"
# The reference's own float32 logits sit 1.2e-5 from its float64 ones after 3 passes (magnitudes up to 2.5): that
# is the rounding a float32 implementation may differ by. exitbench's float32 logits are 1.8e-5 from the reference's
# float32 ones and 1.0e-5 from its float64 ones (its experts run as one grouped matmul, exitbench's one expert at a
# time; the depth attentions broadcast their queries): within the reference's own gap. 1e-4 is 8 times that gap.
ATOL = 1e-4


ck, ref = fixture_and_reference("inkling2-tiny")  # module fixtures: the checkpoint and its reference outputs


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
    path = fixture_copy(tmp_path, "inkling2-tiny")
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


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("passes", [pytest.param(p, marks=pytest.mark.slow) for p in (1, 2)] + [3])
def test_the_engine_scores_through_its_caches_as_the_reference_at_every_pass_count(ck, ref, passes):
    """Keys and values per layer visit and pass, and the four convolution inputs beside them (their `state_layers`),
    one slot per pass: cached equals the reference's uncached logits; one and two passes are the exits after pass 1
    and 2 of every token."""
    ids = ref["input_ids"]
    engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=passes, max_steps=3))
    for b, res in enumerate(engine.score([(row.tolist(), 1) for row in ids], batch_size=2)):
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64),
                                   logprobs_of(ref[f"logits_{passes}"][b], ids[b]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("passes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_select_equals_the_reference_at_every_pass_count(ck, ref, passes):
    """Exit mode select: every token runs all three passes and the rule only picks which pass's readout is its
    output; picking pass p for every token is the reference run at p passes."""
    ids = ref["input_ids"]
    engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=passes, max_steps=3, exit_mode="select"))
    for b, res in enumerate(engine.score([(row.tolist(), 1) for row in ids], batch_size=3)):
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64),
                                   logprobs_of(ref[f"logits_{passes}"][b], ids[b]), atol=ATOL, rtol=0)


def test_scoring_runs_token_major_for_its_convolutions(ck):
    """Its short convolutions read the inputs of the tokens before: depth-major waves would not be exact, so
    scoring runs token by token and says why (its exits batched as alone: tests/test_families.py)."""
    engine = ExitEngine(ck.model, ExitConfig("kl", threshold=0.1))
    assert engine.scoring_schedule == "token_major" and "convolutions" in engine.schedule_note


@pytest.mark.slow  # 3 s
def test_physical_and_select_differ_where_a_token_stopped_early(ck, ref):
    """The two semantics agree on tokens that ran all passes before any earlier token stopped, and part where a
    later token read an exited token's exit-pass entries (physical) instead of its own later passes' (select)."""
    requests = [(row.tolist(), 1) for row in ref["input_ids"]]
    physical, select = (ExitEngine(ck.model, ExitConfig("confidence", threshold=0.017, exit_mode=mode))
                        .score(requests, batch_size=3) for mode in (None, "select"))
    differ = [abs(x - y) > 1e-5 for p, s in zip(physical, select) for x, y in zip(p.logprobs, s.logprobs)]
    assert any(differ) and not all(differ)


@pytest.mark.slow  # 60 s: the commands as a user types them; the engine's parts are checked fast above
def test_every_command_runs_on_an_inkling2_checkpoint(tmp_path):
    """run with every policy exactly and by replay, calibrate, fit-exit and the learned rule, trace, geometry,
    report and info --plan (its KV cache counting the convolution states)."""
    from helpers.commands import run_every_command

    out = run_every_command(str(FIXTURES / "inkling2-tiny"), tmp_path, calibrate="0.015,0.02", steps=3,
                            sentence="Natalia sold clips to her friends and then she sold half as many")
    cells = out["cells"]
    ran = {c["policy"]["policy"] for c in cells}
    # three passes: contraction can exit after pass 2, second_order (from 2, patience 2) never before the last
    assert {"fixed", "kl", "contraction", "oracle", "learned", "confidence"} <= ran and "second_order" not in ran
    assert all(c["model"]["architecture"] == "inkling2_loop_text" and c["iterations"]["max"] <= 3 for c in cells)
    layout = out["info"]["plan"]["kv_layout"]
    assert out["replayed"] > 10 and layout["slots_per_loop_layer"] == [3] and layout["state_layers"] == 4 * 8


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
    # the run's dtype is the embedding's, and the engine's caches hold it
    assert model.dtype == torch.bfloat16
    (res,) = ExitEngine(model, ExitConfig("confidence", threshold=0.017)).score([(list(range(3, 23)), 2)])
    assert len(res.logprobs) == 18 and all(math.isfinite(x) for x in res.logprobs)


def test_info_says_what_a_device_of_a_given_size_holds():
    """`info --plan --memory-gb N`: the plan against a device this machine does not have, from the headers, and the
    most rows that fit in it at the context and depth asked; the next row would not."""
    from exitbench.cli import app
    from exitbench.engine.memory import plan

    from helpers.cli import explain, runner

    ck = FIXTURES / "inkling2-tiny"
    res = runner.invoke(app, ["info", "-c", str(ck), "--plan", "--memory-gb", "0.5", "--context", "256", "--json"])
    assert res.exit_code == 0, explain(res)
    report = json.loads(res.stdout)["plan"]
    rows = report["largest_batch"]
    assert report["device"] == "0.5 GB (--memory-gb)" and report["available"] == 500_000_000 and rows > 1
    assert report["kv_layout"]["state_layers"] == 32  # (the convolution inputs count)
    model = inspect_checkpoint(ck).model
    total = lambda b: plan(model, torch.float32, b, 256)["total"]  # noqa: E731
    assert total(rows) <= 500_000_000 < total(rows + 1)
    bad = runner.invoke(app, ["info", "-c", str(ck), "--plan", "--memory-gb", "0"])
    assert bad.exit_code == 2 and "--memory-gb" in bad.stderr and "\n" not in bad.stderr.strip()


def test_a_tokens_flops_count_its_chosen_experts_and_the_coda_probe(ck):
    """The experts are bare parameters, not linear layers: a token pays the router and its k chosen experts, and
    the message gates and dynamic taps that multiply by parameters too; a readout after pass p runs the coda."""
    from exitbench.engine.flops import FlopModel

    c = ck.model.config
    fm = FlopModel(ck.model)
    one, three = fm.token(10, [1], [0]), fm.token(10, [3], [0])
    experts = 2 * c.num_experts_per_tok * 3 * c.moe_intermediate_size * c.hidden_size
    per_pass = three["core"] - one["core"]
    assert per_pass / 2 > (c.loop_layer_index_end - c.loop_layer_index_start) * experts  # the experts are in
    assert fm.token(10, [3], [2])["probe"] == 2 * (fm.token(10, [3], [1])["probe"]) > 0
    assert fm.token(10, [3], [1])["probe"] >= (c.num_hidden_layers - c.loop_layer_index_end) * experts
