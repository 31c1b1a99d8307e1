"""The retrofitted-recurrence checkpoints (Llama / TinyLlama / OLMo-2 converted to Huginn's layout): the variant
told from the keys, the outputs held to the public conversion code's, and the refusals.

tests/fixtures/retrofit-{llama,olmo}-tiny are random checkpoints bench/make_retrofit_size.py wrote in the
conversions' layout (2/2/2 layers, width 32, grouped heads 4 / 2, head_dim 8; the Llama one with llama3 RoPE
scaling and Huginn-0125's stale special ids in its config, the OLMo one with a 352-row embedding over a
320-token tokenizer). tests/fixtures/retrofit-*-tiny-reference.safetensors hold what the public code
computed on them: `convert_pretrained_model/raven_modeling_minimal_{llama,olmo}.py` with its
`raven_config_minimal.py` (LoopedLMs/retrofitting-recurrence@3797ded, the public mirror), run in a scratch
environment with transformers 4.51.0 (the version its uv.lock pins) and torch 2.13, float32, never committed:
`RavenConfig(**config.json)`, `load_state_dict` of the file (only the rotary module's non-persistent buffer
missing), then for 2 sequences of 17 tokens the logits of `forward(ids, num_steps=[r, 0], init_scale=0)` at
r = 1, 2, 4, 8, 16 (a zero initial state), the core block's output at each of the 16 steps, and 5 greedy tokens
per 6-token prompt from a batch-1 loop of full forwards at r = 4. The file's metadata says the same.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError
from exitbench.models import AttnContext, Raven, RavenConfig, save_checkpoint
from exitbench.models.checkpoint import inspect_checkpoint, load_checkpoint, open_checkpoint
from exitbench.models.info import describe
from exitbench.models.raven import VARIANTS
from exitbench.models.raven.variants import Evidence
from exitbench.policies import REGISTRY

from helpers.models import make_tiny_raven, make_tiny_tokenizer
from helpers.engine import knobs_for

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = ["llama", "olmo"]
# Here the two agree bit for bit (same float32 ops in the same order on this CPU build); 1e-4 is the issue's
# bound, room for a BLAS or SDPA kernel that sums in another order. The controls below move logits by > 1e-2.
ATOL = 1e-4


def fixture(kind: str) -> Path:
    return FIXTURES / f"retrofit-{kind}-tiny"


@functools.cache
def _case(kind: str):
    ck = load_checkpoint(fixture(kind))
    ck.model.config.init_scale = 0.0  # the reference's zero initial state
    return kind, ck, load_file(str(FIXTURES / f"retrofit-{kind}-tiny-reference.safetensors"))


@pytest.fixture(scope="module", params=KINDS)
def case(request):
    return _case(request.param)


def test_the_variant_is_told_from_the_keys_and_info_says_so(case):
    kind, ck, _ = case
    model = ck.model
    assert isinstance(model, Raven) and model.variant.name == kind
    # The config says what every conversion says; the keys decided.
    assert ck.config["block_class_name"] == "SandwichBlock" and ck.config["mean_recurrence"] == 32
    report = describe(inspect_checkpoint(fixture(kind)))
    assert report["variant"]["name"] == kind and "norm_3" in report["variant"]["decided_by"]
    assert report["variant"]["rope"].startswith("rotate-half") and report["variant"]["ln_f_before_coda"] is False
    assert ("llama3" in report["variant"]["rope"]) == (kind == "llama")
    # Their default depth is the config's mean_recurrence, the field their lm-eval runs set (mean_recurrence=R).
    (group,) = model.loop_groups()
    assert (group.default_steps, group.max_steps, group.n_layers) == (32, 64, 2)
    assert not model.tied_head and "freqs_cis" not in model.checkpoint_extras()


def test_huginn_layouts_still_read_as_the_sandwich(tmp_path):
    assert open_checkpoint("tiny-raven").model.variant.name == "huginn"
    saved = Raven.read_config({**make_tiny_raven().config.to_dict()}, set(make_tiny_raven().state_dict()) |
                              {"freqs_cis"}, "here")
    assert saved.variant == "huginn" and saved.embed_scale == 32 ** 0.5


@pytest.mark.parametrize("r", [1, 2, 4, 8, 16])
def test_logits_match_the_conversion_code(case, r):
    kind, ck, ref = case
    with torch.no_grad():
        logits = ck.model(ref["input_ids"], num_steps=r)
    torch.testing.assert_close(logits, ref[f"logits_r{r}"], atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), ref[f"logits_r{r}"].argmax(-1))


def test_core_states_match_step_by_step(case):
    """The latent grows to |s| ~ 250 by step 16 here, so ATOL would ask for 3 float32 ulps there, and the CPU's
    kernels decide those (an AVX-512 CPU gave 2.7e-4). Each step is held instead to twice the rounding error our
    own float32 run shows against its float64 run on this machine (the reference's own error against that
    float64 run is of the same size), and never looser than ATOL."""
    kind, ck, ref = case
    (states,) = ck.model.iterates(ref["input_ids"], 16)
    (exact,) = copy.deepcopy(ck.model).double().iterates(ref["input_ids"], 16)
    states, exact, want = states[1:], exact[1:], ref["latents_r16"]
    rounding = (states.double() - exact).abs().flatten(1).amax(1)
    for k in range(len(want)):
        torch.testing.assert_close(states[k], want[k], atol=max(ATOL, 2 * rounding[k].item()), rtol=0,
                                   msg=lambda m, k=k: f"step {k + 1}: {m}")


def test_what_the_parity_would_catch(tmp_path):
    """Controls: dropping the llama3 scaling, or reading RoPE's base from the wrong field or off by ten, moves the
    logits far past ATOL."""
    ref = load_file(str(FIXTURES / "retrofit-llama-tiny-reference.safetensors"))
    config = json.loads((fixture("llama") / "config.json").read_text())
    without = lambda name: {k: v for k, v in config.items() if k != name}  # noqa: E731
    changes = {"no-llama3-scaling": without("rope_scaling"), "rope_base-not-rope_theta": without("rope_theta"),
               "base-off-by-ten": {**config, "rope_theta": config["rope_theta"] * 10}}
    for what, changed in changes.items():
        out = tmp_path / what
        out.mkdir()
        for f in fixture("llama").iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        (out / "config.json").write_text(json.dumps(changed))
        ck = load_checkpoint(out)
        ck.model.config.init_scale = 0.0
        moved = (ck.model(ref["input_ids"], num_steps=4) - ref["logits_r4"]).abs().max().item()
        assert moved > 1e-2, (what, moved)


# No gate here (refused: tests/test_ouro.py); learned needs a fitted file (the CLI test). Every rule on the Llama
# layout fast, a latent and a decoding one on OLMo's (its norms differ, not the loop), the rest with the slow tests.
RULES = [p for p, cls in REGISTRY.items() if not cls.needs_gate and p != "learned" and not cls.drafts]


@pytest.mark.parametrize("kind,policy", [
    pytest.param(k, p, id=f"{k}-{p}", marks=() if k == "llama" or p in ("second_order", "kl") else pytest.mark.slow)
    for k in KINDS for p in RULES])
def test_every_policy_runs_and_batches_like_batch_size_one(kind, policy):
    _, ck, ref = _case(kind)
    cls = REGISTRY[policy]
    requests = [(row[:n].tolist(), 3) for row, n in zip(ref["input_ids"], (17, 9))]
    knobs = {} if cls.retrospective else {"threshold": 4 if cls.integer_threshold else 0.3}
    engine = ExitEngine(ck.model, ExitConfig(policy, max_steps=6, **knobs_for(policy), **knobs))
    solo = [engine.score([r], batch_size=1)[0] for r in requests]
    together = engine.score(requests, batch_size=2)
    for a, b in zip(solo, together):
        assert a.iterations == b.iterations, policy
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-6)


def test_a_kv_window_as_deep_as_the_loop_is_the_full_cache(case):
    """Huginn's compressed lookup, counted in iterations of the checkpoint's own core (Huginn's code hard-codes
    a 2-layer prelude and a 4-layer core)."""
    kind, ck, ref = case
    requests = [(ref["input_ids"][0].tolist(), 4)]
    full = ExitEngine(ck.model, ExitConfig("second_order", threshold=0.3, max_steps=6)).score(requests)
    deep = ExitEngine(ck.model, ExitConfig("second_order", threshold=0.3, max_steps=6, kv_window=6)).score(requests)
    short = ExitEngine(ck.model, ExitConfig("second_order", threshold=0.3, max_steps=6, kv_window=1)).score(requests)
    assert full[0].logprobs == deep[0].logprobs and len(short[0].logprobs) == len(full[0].logprobs)
    assert ck.model.cache_slots(window=2) == {0: 1, 1: 1, 2: 2, 3: 2, 4: 1, 5: 1}


def test_the_cache_keeps_each_key_group_once(case):
    """Grouped heads are repeated to the query heads after the cache, so it holds 2 heads here, not 4 (the
    parity tests above run through it); FLOPs still count every query head's scores."""
    kind, ck, _ = case
    assert ck.model.new_cache(2, 10).n_heads == 2 and ck.model.cache_geometry() == (2, 8)
    assert ck.model.attention_width == 4 * 8


def test_an_embed_init_state_starts_the_loop_from_the_prelude(tmp_path):
    config = json.loads((fixture("olmo") / "config.json").read_text())
    out = tmp_path / "embed-init"
    out.mkdir()
    for f in fixture("olmo").iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps({**config, "initial_state_mode": "embed-init"}))
    model = load_checkpoint(out).model
    ids = torch.tensor([[5, 6, 7]])
    (states,) = model.iterates(ids, 1)
    e = model.walk(model.embed(ids), AttnContext(), stop=1)
    assert torch.equal(states[0], e) and not model.loop_groups()[0].random_init


# ---- reading the layout, and what is refused ----------------------------------------------------------------------

DROP = object()  # a config_change value that removes the field


def rewritten(tmp_path, kind: str, config_change: dict | None = None, drop: str | None = None) -> Path:
    """The fixture with config fields changed and the keys ending in `drop` removed."""
    out = tmp_path / f"{kind}-changed"
    out.mkdir()
    for f in fixture(kind).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config = {k: v for k, v in {**config, **(config_change or {})}.items() if v is not DROP}
    (out / "config.json").write_text(json.dumps(config))
    if drop:
        tensors = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if not k.endswith(drop)}, str(out / "model.safetensors"))
    return out


def test_the_old_misleading_shape_message_is_gone(tmp_path):
    """A grouped-query checkpoint used to fail with "has shape (128, 64) but config.json implies (192, 64)"; now
    it loads, and a config that really disagrees with the files says which variant and widths it read."""
    assert load_checkpoint(fixture("llama")).model.config.num_key_value_heads == 2
    bad = rewritten(tmp_path, "llama", {"num_key_value_heads": 4})
    with pytest.raises(CheckpointError, match=r"read as the llama variant.*num_key_value_heads=4, head_dim=8"):
        inspect_checkpoint(bad)


def test_a_layout_matching_no_variant_names_what_decided(tmp_path):
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(rewritten(tmp_path, "olmo", drop="k_norm.weight"))
    message = str(err.value)
    assert "\n" not in message and "match no Raven variant" in message and "attn.q_norm" in message
    assert "olmo: norm_1, norm_2, attn.q_norm and attn.k_norm" in message


def test_a_soft_capped_sandwich_is_not_read_as_huginn(tmp_path):
    """The Gemma-2 retrofit's blocks hold four norms like Huginn's; its soft-capping fields tell it apart, and
    until it has a variant it is refused rather than run as the wrong network."""
    path = save_checkpoint(make_tiny_raven(), tmp_path / "gemma-like", make_tiny_tokenizer(),
                           extra_config={"final_logit_softcapping": 30.0})
    with pytest.raises(CheckpointError, match=r"norm_4, config final_logit_softcapping=30.0 match no Raven variant"):
        inspect_checkpoint(path)


def test_a_block_missing_a_key_is_named(tmp_path):
    out = rewritten(tmp_path, "olmo")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["transformer.coda.1.attn.q_norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks key transformer.coda.1.attn.q_norm.weight"):
        inspect_checkpoint(out)


def test_the_rules_never_overlap():
    """Every combination of the features the rules read matches at most one variant, so `detect`'s "two
    variants" error is a guard for the next rule, not a state any checkpoint reaches today."""
    names = ["norm_1", "norm_2", "norm_3", "norm_4", "attn.q_norm", "attn.k_norm"]
    for bits in range(2 ** len(names)):
        keys = frozenset(f"{n}.weight" for i, n in enumerate(names) if bits >> i & 1)
        for config in ({}, {"final_logit_softcapping": 30.0}):
            assert sum(v.rule(Evidence(keys, config)) for v in VARIANTS) <= 1, (keys, config)


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_scaling", "'yarn'", "llama3"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, ["llama3", "low_freq_factor"]),
    ({"initial_state_mode": "skip-adapter"}, ["initial_state_mode", "skip-adapter"]),
    ({"tie_embeddings": True, "tie_word_embeddings": False}, ["tie_embeddings", "tie_word_embeddings"]),
    ({"num_key_value_heads": 3}, ["multiple of num_key_value_heads=3"]),
    ({"init_values": {"embed_scale": "big"}}, ["init_values.embed_scale"]),
    # fields that change the numbers, refused rather than ignored
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0", "not implemented"]),
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping=30.0", "uncapped"]),
    ({"init_values": DROP}, ["lacks init_values", "embed_scale"]),
    ({"tie_embeddings": True, "tie_word_embeddings": True}, ["tie_embeddings is true", "lm_head.weight"]),
    # values that make NaN, or a plan no machine holds
    ({"rope_theta": 0}, ["rope_theta must be a finite number > 0"]),
    ({"rope_theta": -5.0}, ["rope_theta must be a finite number > 0"]),
    ({"norm_eps": -1e-5}, ["norm_eps must be a finite number ≥ 0"]),
    ({"mean_recurrence": 100000}, ["mean_recurrence=100000", "1024"]),
    # the source model's model_type kept by mistake: the architecture is what is wrong, not a token id
    ({"model_type": "llama"}, ["unknown architecture 'llama'", "model_type 'huginn_raven'"]),
])
def test_config_fields_that_cannot_be_run_are_refused_in_one_line(tmp_path, change, words):
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(rewritten(tmp_path, "llama", change))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_stale_huginn_token_ids_give_way_to_the_tokenizers_own():
    """The Llama conversion keeps Huginn-0125's ids 65504/65505/65509 beside a small vocabulary; the
    tokenizer_config.json's <s> and </s> take their place, as lm-eval's hf model would use them."""
    ck = load_checkpoint(fixture("llama"))
    raw = json.loads((fixture("llama") / "config.json").read_text())
    assert raw["bos_token_id"] == 65504 and "bos_token_id" not in ck.config
    assert (ck.tokenizer.bos_token_id, ck.tokenizer.eos_token_id) == (1, 2)
    assert ck.tokenizer.token(1) == "<s>"


def test_state_scale_follows_init_values():
    huginn = RavenConfig(n_embd=32, n_heads=2, vocab_size=10, intermediate_size=8)
    assert huginn.state_std == pytest.approx(0.4 ** 0.5) and huginn.embed_scale == pytest.approx(32 ** 0.5)
    retro = RavenConfig(n_embd=32, n_heads=2, vocab_size=10, intermediate_size=8,
                        init_values={"std": 0.0087, "embed_scale": 1.0})
    assert retro.state_std == pytest.approx(0.0087) and retro.embed_scale == 1.0


def test_a_sweep_runs_exactly_and_by_replay_on_a_retrofitted_checkpoint(tmp_path):
    """The library half of the commands below: the sweep's one entry (exitbench.sweep.run), exact and by replay,
    with a decoding and a decoding-free rule, on the OLMo fixture."""
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.sweep.run import execute, open_sweep
    from exitbench.sweep.config import SweepConfig

    ck, tasks = open_checkpoint(str(fixture("olmo"))), resolve_tasks(["chains_lambada"])
    for mode in ("exact", "replay"):
        cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order", "kl"], thresholds=[0.3], baselines=[4],
                          limit=2, exit={"max_steps": 6}, quiet=True, timing_repeats=0, replay=mode == "replay")
        out = tmp_path / mode
        done = execute(open_sweep(dataclasses.replace(cfg, out=out), ck, tasks)).cells
        assert {(c["policy"]["policy"], c["policy"]["threshold"]) for c in done} == {
            ("fixed", 4), ("second_order", 0.3), ("kl", 0.3)}, mode
        assert all(c["model"]["architecture"] == "huginn_raven" and c["iterations"]["max"] <= 6 for c in done), mode
        assert len(list(out.glob("*.json"))) == 3


@pytest.mark.slow  # 10 s: ten commands as a user types them; the sweep itself, exact and by replay, is checked fast
# (test_a_sweep_runs_exactly_and_by_replay_on_a_retrofitted_checkpoint) and each command's own code elsewhere
def test_every_command_runs_on_a_retrofitted_checkpoint(tmp_path):
    """run (exact and replay, with a KV window), calibrate, fit-exit and the learned rule, geometry, trace, report
    and info --plan, as a user types them, on the OLMo fixture (the Llama one runs the same code)."""
    from exitbench.cli import app

    from helpers.cli import explain, runner

    ck = str(fixture("olmo"))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"the cat sat on the mat {i} and the dog ran" for i in range(24)))
    exit_model = tmp_path / "exit.json"
    common = ["-c", ck, "--tasks", "chains_lambada", "--limit", "2", "--baselines", "4", "--max-steps", "6",
              "--quiet"]
    commands = {
        "run": ["run", *common, "-p", "second_order", "-p", "kl", "--thresholds", "0.3", "--out", str(tmp_path / "r")],
        "window": ["run", *common, "-p", "first_order", "--thresholds", "0.3", "--kv-window", "2",
                   "--out", str(tmp_path / "w")],
        "replay": ["run", *common, "-p", "all", "--replay", "--out", str(tmp_path / "replay")],
        "calibrate": ["calibrate", "-c", ck, "--text", str(docs), "--policy", "second_order", "--thresholds",
                      "0.3,3", "--max-steps", "6", "--out", str(tmp_path / "cal.json")],
        "fit-exit": ["fit-exit", "-c", ck, "--text", str(docs), "--limit", "24", "--tokens", "600",
                     "-o", str(exit_model)],
        "learned": ["run", *common, "-p", "learned", "--exit-model", str(exit_model), "--thresholds", "0.5",
                    "--out", str(tmp_path / "r")],
        "geometry": ["geometry", "-c", ck, "--text", str(docs), "-n", "6", "--tokens", "300", "-o",
                     str(tmp_path / "geo")],
        "trace": ["trace", "a=7 b=a", "-c", ck, "-p", "second_order", "--max-steps", "6", "--generate", "2",
                  "--json", str(tmp_path / "trace.json")],
        "report": ["report", str(tmp_path / "r")],
        "info": ["info", "-c", ck, "--plan", "--kv-window", "2", "--json"],
    }
    for name, args in commands.items():
        res = runner.invoke(app, args)
        assert res.exit_code == 0, f"{name}: {explain(res)}"
    policies = {json.loads(f.read_text())["policy"]["policy"] for f in (tmp_path / "r").glob("*.json")}
    assert policies == {"fixed", "second_order", "kl", "learned"}
    assert len(list((tmp_path / "replay").glob("*.json"))) > 10
    assert json.loads(res.stdout)["plan"]["kv_layout"]["slots_per_loop_layer"] == [2]
    assert (tmp_path / "r" / "report.html").exists() and (tmp_path / "geo" / "geometry.json").exists()
