"""Ouro: the architecture read from its published layout, held to the public reference's outputs, and its gate
rules.

tests/fixtures/ouro-tiny is a random checkpoint in Ouro's layout (2 layers, GQA 4/2 heads, head_dim 8, T = 4, a
gate with spread-out weights so Q-exit lands on every step). tests/fixtures/ouro-tiny-reference.safetensors holds
what the public `modeling_ouro.py` (Eagle4398/ouro-nixpkgs@16df09c, run in a scratch environment with
transformers 4.57.1 and torch 2.13, eager attention, float32, never committed) computed on it: per-step logits
and gate logits of 3 sequences of 12 tokens (its strict `load_state_dict` accepted the file's keys), the step
its `exit_threshold=q` forward returned for q = 0.2, 0.5, 0.8 (found by matching its logits to a step's
exactly), its `use_weighted_exit` logits (with `early_exit_threshold` unset, since the shipped 1.0 silently
overrides it), and 5 greedy tokens per prompt from a batch-1 loop of full forwards at its default depth. Its own
cached `generate` crashed on a cached prompt pass (a known bug of that copy), so the greedy reference uses none.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError, ExitbenchError
from exitbench.models import AttnContext, Ouro, OuroConfig
from exitbench.models import cache as cache_module
from exitbench.models.cache import KVCache
from exitbench.policies import REGISTRY

from helpers.files import fixture_and_reference

FIXTURES = Path(__file__).parent / "fixtures"
# The reference sums in another order (eager matmul attention vs SDPA, its cat-based rotate-half): float32
# logits of this size agree to ~1e-6; 1e-4 is the bound and leaves room for other BLAS builds.
ATOL = 1e-4


ck, ref = fixture_and_reference("ouro-tiny")  # module fixtures: the checkpoint and its reference outputs


def trajectories(model: Ouro, ids: torch.Tensor, depth: int = 4) -> list[torch.Tensor]:
    states = []
    model.walk(model.embed(ids), AttnContext(), [depth],
               on_state=lambda g, k, s: states.append(s) if k else None)
    return states


def test_the_published_layout_loads_with_its_key_names(ck):
    model = ck.model
    assert isinstance(model, Ouro) and model.architecture == "ouro"
    assert "model.early_exit_gate.bias" in model.state_dict() and "model.layers.1.input_layernorm_2.weight" in \
        model.state_dict()
    (group,) = model.loop_groups()
    assert (group.default_steps, group.max_steps, group.n_layers, group.gate is not None) == (4, 8, 2, True)
    assert not model.tied_head and model.gated


@torch.no_grad()
def test_per_step_logits_and_gates_match_the_reference(ck, ref):
    states = trajectories(ck.model, ref["input_ids"])
    logits = torch.stack([ck.model.head(s) for s in states], 2)
    torch.testing.assert_close(logits, ref["step_logits"], atol=ATOL, rtol=0)
    gates = torch.stack([ck.model.loop_groups()[0].gate(s) for s in states], 2)
    torch.testing.assert_close(gates, ref["gate_logits"], atol=ATOL, rtol=0)


@torch.no_grad()
def test_qexit_steps_over_the_full_trajectories_are_the_reference_steps(ck, ref):
    """The reference runs every token through every step and reads the step Q-exit picks, so its steps are the
    rule applied to full-depth trajectories: what a recording (replay) sees."""
    states = trajectories(ck.model, ref["input_ids"])
    B, T = ref["input_ids"].shape
    for q, want in zip(ref["qexit_q"].tolist(), ref["qexit_steps"]):
        policy = ExitConfig("qexit", threshold=q).bound_policies(ck.model.loop_groups())[0]
        memory = policy.start(states[0].reshape(B * T, -1), 0)
        signals = torch.stack([policy.signal(s.reshape(B * T, -1), memory, None) for s in states], 1)
        got = policy.first_exits(signals.double().numpy()).reshape(B, T)
        assert got.tolist() == want.tolist(), f"q={q}"


@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
def test_fixed_depth_scoring_matches_the_reference_last_step(ck, ref, schedule):
    ids = ref["input_ids"]
    engine = ExitEngine(ck.model, ExitConfig("fixed"), schedule=schedule)
    results = engine.score([(row.tolist(), 1) for row in ids], batch_size=2)
    want = torch.log_softmax(ref["step_logits"][:, :, 3].double(), -1)
    for b, res in enumerate(results):
        expected = want[b, :-1].gather(-1, ids[b, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=ATOL, rtol=0)


def test_qexit_saves_iterations_and_q1_reads_the_last_step(ck, ref):
    requests = [(row.tolist(), 1) for row in ref["input_ids"]]
    low = ExitEngine(ck.model, ExitConfig("qexit", threshold=0.2)).score(requests)
    full = ExitEngine(ck.model, ExitConfig("qexit", threshold=1.0)).score(requests)
    mean = lambda rs: sum(sum(r.iterations) for r in rs) / sum(len(r.iterations) for r in rs)  # noqa: E731
    assert mean(low) < 3.0 and mean(full) == 4.0


def test_grouped_heads_read_their_keys_in_place_as_gathered(ck, ref, monkeypatch):
    """Ouro's 4 query heads over 2 KV groups: read in place (forced; KVCache.attend_in_place puts a group's heads
    on the query axis instead of repeating its keys), continuous Q-exit generation gives the gather's tokens,
    exits and log-probabilities (1e-5: the attention sums over exactly a token's keys instead of the masked
    padded ones, float32 rounding apart)."""
    prompts = [row[:n].tolist() for row, n in zip(ref["input_ids"], (12, 7, 10))]
    runs, calls = {}, []
    attend = KVCache.attend_in_place
    monkeypatch.setattr(KVCache, "attend_in_place", lambda self, *a: calls.append(1) or attend(self, *a))
    for read, bytes_from in (("gather", float("inf")), ("in place", 0)):
        monkeypatch.setattr(cache_module, "IN_PLACE_FROM", bytes_from)
        runs[read] = ExitEngine(ck.model, ExitConfig("qexit", threshold=0.5)).generate(prompts, 6, batch_size=3)
    assert calls and len({s for r in runs["gather"] for s in r.iterations}) >= 3
    for a, b in zip(runs["in place"], runs["gather"]):
        assert (a.tokens, a.iterations) == (b.tokens, b.iterations)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_gate_rule_on_a_model_without_a_gate_is_one_line():
    from helpers.models import make_tiny_raven

    model = make_tiny_raven()
    for name in ("qexit", "gate"):
        with pytest.raises(ExitbenchError, match=f"{name}: reads a trained exit gate.*has none"):
            ExitEngine(model, ExitConfig(name))
    assert not model.gated


def test_gate_thresholds_are_probabilities():
    with pytest.raises(ExitbenchError, match="qexit: threshold is a probability"):
        REGISTRY["qexit"](threshold=1.5)


def test_ouro_grids_reach_its_step_sizes(ck):
    grids = ck.model.exit_grids()
    assert max(grids["second_order"]) >= 0.5 * 32 ** 0.5  # steps ~0.2 ‖h‖ must be inside the grid


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types has 'sliding_attention'"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    # values that make NaN, or a plan no machine holds, refused at the door
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": -10000.0}, "rope_theta must be a finite number > 0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number ≥ 0"),
    ({"total_ut_steps": 100000}, "total_ut_steps=100000 asks for more than exitbench's 1024"),
    ({"total_ut_steps": 4, "max_ut_steps": 5000}, "max_ut_steps=5000"),
])
def test_what_ouro_does_not_implement_is_refused_in_one_line(change, message):
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)
    with pytest.raises(CheckpointError, match=message):
        OuroConfig.from_dict({**base, **change})


@pytest.mark.parametrize("checkpoint,policy", [(str(FIXTURES / "ouro-tiny"), "qexit"), ("tiny-raven", "second_order")])
def test_trace_json_holds_ids_text_exits_and_signals(tmp_path, checkpoint, policy):
    import json

    from typer.testing import CliRunner

    from exitbench.cli import app

    out = tmp_path / "trace.json"
    res = CliRunner().invoke(app, ["trace", "a=7 b=a", "-c", checkpoint, "-p", policy, "--generate", "3",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())  # strict JSON: steps never run are null, not NaN
    (trace,) = doc["traces"]
    assert doc["schema"] == "exitbench.trace" and {"seed", "versions", "machine"} <= set(doc["run"])
    assert trace["mode"] == "generate" and len(trace["generated_ids"]) == len(trace["tokens"]) <= 3
    assert [t["next_id"] for t in trace["tokens"]] == trace["generated_ids"]
    for token in trace["tokens"]:
        assert len(token["exit_steps"]) == len(trace["loop_groups"]) == len(token["signals"])
        for k, signals in zip(token["exit_steps"], token["signals"]):
            assert all(v is not None for v in signals[:k]) and all(v is None for v in signals[k:])
        assert isinstance(token["logprob"], float) and isinstance(token["input"], str)


def test_trace_encodes_the_prompt_as_run_does(tmp_path, ck):
    """Ouro's tokenizer adds no BOS: trace follows it (as run and the reference's own generate do) unless told
    otherwise, and its generation is the engine's on those very ids."""
    import json

    from typer.testing import CliRunner

    from exitbench.cli import app

    tok, prompt = ck.tokenizer, "a=7 b=a"
    for flag, want in ((None, tok.encode(prompt, add_special_tokens=True)),
                       ("--add-bos-token", [tok.bos_token_id, *tok.encode(prompt)]),
                       ("--no-add-bos-token", tok.encode(prompt))):
        out = tmp_path / f"{flag}.json"
        res = CliRunner().invoke(app, ["trace", prompt, "-c", str(FIXTURES / "ouro-tiny"), "-p", "fixed",
                                       "--threshold", "4", "--generate", "3", "--json", str(out),
                                       *([flag] if flag else [])])
        assert res.exit_code == 0, res.output
        (trace,) = json.loads(out.read_text())["traces"]
        assert trace["prompt_ids"] == want, flag
        engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=4))
        assert trace["generated_ids"] == engine.generate([want], 3, stop_ids=[tok.eos_token_id])[0].tokens, flag
    assert tok.bos_token_id not in tok.encode(prompt, add_special_tokens=True)  # the case this test is about
