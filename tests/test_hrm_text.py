"""HRM-Text: the hierarchical looped LM read from its published layout, held to transformers' in-tree reference.

tests/fixtures/hrm-text-tiny is a random checkpoint in HRM-Text-1B's layout (fused gqkv_proj / gate_up_proj keys,
2 layers per stack, the released 2 H cycles of 3 L cycles, a random z_L_init, embedding_scale √hidden) with a
320-token byte-level tokenizer on HRM-Text-1B's special ids (pad 5, bos 6 = <|im_start|>, eos 11 = <|box_end|>):
tests/fixtures/make_hrm_text_tiny.py made both with exitbench alone. tests/fixtures/hrm-text-tiny-reference.safetensors
holds what transformers 5.24.0's `hrm_text` (torch 2.13.0 CPU, sdpa, float32, in a scratch environment) computed
on it: logits of 3 sequences of 12 tokens at 1-4 H cycles, causal and with a bidirectional prefix block
(token_type_ids), the same at 2 cycles in float64, and 5 greedy tokens after 3 prompts decoded with its cache from a
prefix-LM prefill (equal to its uncached forwards). tests/fixtures/make_hrm_text_reference.py is how (it imports
transformers; exitbench never does).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError, ExitbenchError
from exitbench.models.hrm_text import HrmText
from exitbench.models.checkpoint import load_checkpoint

from helpers.files import fixture_and_reference, fixture_copy

FIXTURES = Path(__file__).parent / "fixtures"
# The reference's own float32 logits sit 8.8e-7 from its float64 ones at 2 cycles (magnitudes up to 2.7): that is
# the rounding any float32 implementation may differ by. exitbench runs the same torch kernels in the same order
# and matches bit for bit here (0.0 measured at 1-4 cycles), but another CPU's kernels may sum differently, and the
# gap grows with depth; 1e-4 is the bound, about 100 times the reference's own float32 gap.
ATOL = 1e-4


ck, ref = fixture_and_reference("hrm-text-tiny")  # module fixtures: the checkpoint and its reference outputs


def variant(tmp_path: Path, **fields) -> Path:
    """The fixture with config fields changed (None removes one)."""
    return fixture_copy(tmp_path, "hrm-text-tiny", **fields)


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The log-probability of each token from position first + 1 on, under logits of one row."""
    return torch.log_softmax(logits.double(), -1)[first:-1].gather(-1, ids[first + 1:, None])[:, 0]


def test_the_published_layout_loads_with_its_fused_key_names(ck):
    model = ck.model
    assert isinstance(model, HrmText) and model.architecture == "hrm_text" and model.prefix_lm
    keys = model.state_dict()
    assert {"model.embed_tokens.weight", "model.z_L_init", "lm_head.weight",
            "model.H_module.layers.1.attn.gqkv_proj.weight", "model.L_module.layers.1.mlp.gate_up_proj.weight",
            "model.L_module.layers.0.attn.o_proj.weight", "model.H_module.layers.0.mlp.down_proj.weight"} <= set(keys)
    assert not any("norm" in k for k in keys)  # every norm is parameterless
    assert keys["model.H_module.layers.0.attn.gqkv_proj.weight"].shape == (4 * 4 * 16, 64)  # gate, q, k, v
    (group,) = model.loop_groups()
    # one step is one H cycle: 3 L-stack calls and the H stack, each call its own cache layers
    assert (group.default_steps, group.max_steps, len(group.attn_layers)) == (2, 8, 4 * 2)
    assert model.cache_slots()[7] == 8 and not model.tied_head


def test_the_layer_count_is_per_stack_not_transformers_slot_count(tmp_path):
    """A saved config carries num_hidden_layers = per_stack × H × (L + 1) (16 here, 128 at release) beside
    num_layers_per_stack; reading the former would build 8 times too many layers. A config without the split
    (written by hand, or before transformers' rewrite) names the per-stack count in num_hidden_layers."""
    assert json.loads((FIXTURES / "hrm-text-tiny" / "config.json").read_text())["num_hidden_layers"] == 16
    legacy = load_checkpoint(variant(tmp_path, num_hidden_layers=2, num_layers_per_stack=None)).model
    assert len(legacy.model.H_module.layers) == 2 and legacy.config.num_hidden_layers == 16


def test_a_hub_config_allows_twice_the_trained_cycles(tmp_path):
    assert load_checkpoint(variant(tmp_path, max_H_cycles=None)).model.loop_groups()[0].max_steps == 4


@torch.no_grad()
@pytest.mark.parametrize("cycles", [1, 2, 3, 4])
def test_logits_at_every_cycle_count_match_the_reference_causal_and_prefix(ck, ref, cycles):
    """Two cycles are the trained depth; one is the exit after cycle 1; three and four extrapolate."""
    ids = ref["input_ids"]
    torch.testing.assert_close(ck.model(ids, cycles), ref[f"logits_causal_{cycles}"], atol=ATOL, rtol=0)
    prefix = ck.model(ids, cycles, prefix=ref["prefix_lengths"])
    torch.testing.assert_close(prefix, ref[f"logits_prefix_{cycles}"], atol=ATOL, rtol=0)
    # (the block changes the numbers: the prefix path is not the causal one by accident)
    assert (prefix - ref[f"logits_causal_{cycles}"]).abs().max() > 0.1


@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
@pytest.mark.parametrize("cycles", [1, 2])
def test_scoring_reads_the_context_as_one_block_through_the_cache(ck, ref, schedule, cycles):
    """A scoring request's context is the prompt block (the reference's token_type_ids 1), the continuation causal:
    the engine prefills the block, then scores through its cache (one slot per cycle and stack-call layer), equal
    to the reference's uncached prefix-LM logits; one cycle is the per-token exit after cycle 1."""
    ids, prefix = ref["input_ids"], ref["prefix_lengths"].tolist()
    engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=cycles), schedule=schedule)
    results = engine.score([(row.tolist(), n) for row, n in zip(ids, prefix)], batch_size=2)
    for b, res in enumerate(results):
        want = logprobs_of(ref[f"logits_prefix_{cycles}"][b], ids[b], prefix[b] - 1)
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), want, atol=ATOL, rtol=0)


def test_a_causal_checkpoint_scores_causally(tmp_path, ref):
    """prefix_lm false: no block, the reference's causal logits (as lm-eval's hf class would call it)."""
    model = load_checkpoint(variant(tmp_path, prefix_lm=False)).model
    assert not model.prefix_lm
    ids = ref["input_ids"]
    (res,) = ExitEngine(model, ExitConfig("fixed")).score([(ids[0].tolist(), 5)])
    want = logprobs_of(ref["logits_causal_2"][0], ids[0], 4)
    torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("schedule,prefill", [("token_major", "full"), ("depth_major", "full"), ("auto", "exit")])
@pytest.mark.parametrize("cycles", [1, 2])
def test_a_causal_prompt_scores_as_the_reference_does_without_a_block(ck, ref, schedule, prefill, cycles):
    """causal_prompt on the released prefix-LM: the context read causally, the reference's logits without
    token_type_ids (what lm-eval's hf model computes), through the cache; a causal prompt may run with exits too."""
    ids, prefix = ref["input_ids"], ref["prefix_lengths"].tolist()
    config = ExitConfig("fixed", threshold=cycles, causal_prompt=True, prefill=prefill)
    results = ExitEngine(ck.model, config, schedule=schedule).score(
        [(row.tolist(), n) for row, n in zip(ids, prefix)], batch_size=2)
    for b, res in enumerate(results):
        want = logprobs_of(ref[f"logits_causal_{cycles}"][b], ids[b], prefix[b] - 1)
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), want, atol=ATOL, rtol=0)


def test_the_prompts_reading_is_in_the_key_and_the_baselines_keep_it(tmp_path):
    """Cells of the two readings differ (and every cell before the knob keeps its id); a baseline runs its prompt as
    the policies beside it do; a model that reads prompts causally anyway refuses the knob, and replay names it."""
    from exitbench.engine.recorder import check_recordable

    assert "causal_prompt" not in ExitConfig("kl").key_dict()
    causal = ExitConfig("kl", causal_prompt=True)
    assert causal.key_dict()["causal_prompt"] is True
    assert ExitConfig.fixed_depth(2, causal.to_dict()).causal_prompt
    plain = load_checkpoint(variant(tmp_path, prefix_lm=False)).model
    with pytest.raises(ExitbenchError, match="reads every prompt causally already"):
        ExitEngine(plain, causal)
    with pytest.raises(ExitbenchError, match="cannot replay --causal-prompt"):
        check_recordable(causal.to_dict(), "run")


@pytest.mark.slow  # 4 s: transformers' model through lm-eval; the engine against the reference's causal logits above
def test_causal_prompt_is_lm_evals_hf_model_on_the_same_weights(tmp_path):
    """lm-eval's `hf` model runs HRM-Text causally (no token_type_ids): with causal_prompt exitbench gives its
    numbers, and by default (the prompt one block, as the model was trained) others."""
    pytest.importorskip("transformers.models.hrm_text")
    import transformers
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from exitbench.harness.model import ExitbenchLM

    path = fixture_copy(tmp_path, "hrm-text-tiny")
    tok = load_checkpoint(path).tokenizer
    name = lambda i: tok.decode([i], skip_special_tokens=False)  # noqa: E731
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=name(tok.bos_token_id),
                                         eos_token=name(tok.eos_token_id)).save_pretrained(path)
    requests = [("Natalia sold clips", " to her friends"), ("the cat sat", " on the mat"), ("", "hello there")]
    asked = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=0, metadata=("hrm", i, 1))
             for i, r in enumerate(requests)]
    hf = HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=1, logits_cache=False)
    want = hf.loglikelihood(asked)
    for causal in (True, False):
        got = ExitbenchLM(checkpoint=str(path), policy="fixed", batch_size=2, device="cpu",
                          causal_prompt=causal).loglikelihood(asked)
        gaps = [abs(a - b) for (a, _), (b, _) in zip(got, want)]
        assert max(gaps) < 1e-4 if causal else max(gaps[:2]) > 1e-3, (causal, gaps)


@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
def test_both_schedules_agree_with_exits(ck, ref, schedule):
    """Depth-major waves over a prefix-LM's continuations give token-major's exits (the whole matrix of rules is
    tests/test_depth_major.py, slow)."""
    requests = [(row[:n].tolist(), c) for row, n, c in zip(ref["input_ids"], (12, 7, 10), (2, 3, 1))]
    want = ExitEngine(ck.model, ExitConfig("confidence", threshold=0.02), "token_major").score(requests)
    got = ExitEngine(ck.model, ExitConfig("confidence", threshold=0.02), schedule).score(requests, batch_size=2)
    for a, b in zip(want, got):
        assert [r.exit_steps for r in a.records] == [r.exit_steps for r in b.records]
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("knobs,named", [({"prefill": "exit"}, "prefix_lm"), ({"warm_start": True}, "warm_start")])
def test_what_the_engine_cannot_do_here_is_refused_in_one_line(ck, knobs, named):
    """A prompt read token by token cannot be one bidirectional block; a warm start would replace z_H's start, the
    token's own embedding, which no later step reads again."""
    with pytest.raises(ExitbenchError, match=named) as err:
        ExitEngine(ck.model, ExitConfig("fixed", **knobs))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields,named", [({"attention_bias": True}, "attention_bias"),
                                          ({"mlp_bias": True}, "mlp_bias"),
                                          ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
                                           "rope_parameters"),
                                          ({"num_attention_heads": 3, "head_dim": 16}, "hidden_size")])
def test_what_it_does_not_implement_is_refused_in_one_line(tmp_path, fields, named):
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(variant(tmp_path, **fields))
    assert "\n" not in str(err.value) and named in str(err.value)


def test_rope_theta_is_read_from_rope_parameters(tmp_path):
    """transformers 5 writes RoPE's base inside rope_parameters; older configs at the top level."""
    model = load_checkpoint(variant(tmp_path, rope_theta=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})).model
    assert model.config.rope_theta == 500.0


@pytest.mark.slow  # 20 s: the commands as a user types them; the engine's parts are checked fast above
def test_every_command_runs_on_an_hrm_text_checkpoint(tmp_path):
    """run with every policy exactly and by replay, calibrate, fit-exit and the learned rule, trace, geometry,
    report and info --plan."""
    from helpers.commands import run_every_command

    out = run_every_command(str(FIXTURES / "hrm-text-tiny"), tmp_path, calibrate="0.01,0.02",
                            sentence="Natalia sold clips to her friends and then she sold half as many")
    cells = out["cells"]
    ran = {c["policy"]["policy"] for c in cells}
    # two loops: the rules defined from iteration 2 cannot exit before full depth, so `all` runs none of them
    assert {"fixed", "kl", "first_order", "oracle", "learned"} <= ran and not ran & {"second_order", "contraction"}
    assert all(c["model"]["architecture"] == "hrm_text" and c["iterations"]["max"] <= 2 for c in cells
               if c["policy"]["policy"] != "fixed")
    assert out["replayed"] > 10 and out["info"]["plan"]["kv_layout"]["slots_per_loop_layer"] == [2]
