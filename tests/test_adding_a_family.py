"""The family kit holds: the families built with it are named in four tracked paths outside tests/ and docs/;
a toy family (tests/helpers/toy_family.py, a Llama whose last layers loop), written with
exitbench.models.hf_blocks and hf_config alone, is a family once registered: it saves and loads by its key names,
`info` describes it from its headers, and the engine runs and exits it, batched as alone. Its schema and module
stay under 150 lines: the size of adding a family, measured (docs/adding-a-family.md)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import CheckpointError
from exitbench.models import registry, save_checkpoint
from exitbench.models.attention import AttnContext
from exitbench.models.checkpoint import inspect_checkpoint, load_checkpoint
from exitbench.models.info import describe

from helpers import toy_family
from helpers.engine import exit_steps, logprobs_close, mixed_requests
from helpers.files import edited_copy
from helpers.models import make_tiny_tokenizer
from helpers.toy_family import ToyLoop, ToyLoopConfig

SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             num_loop_layers=2, vocab_size=100, max_position_embeddings=64)


@pytest.fixture
def toy_registered(monkeypatch):
    """ToyLoop in the registry for one test only (monkeypatch restores both tables)."""
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    monkeypatch.setattr(registry, "_HF_CLASS_NAMES", dict(registry._HF_CLASS_NAMES))
    monkeypatch.setattr(registry, "_MODEL_TYPES", dict(registry._MODEL_TYPES))
    registry.register(ToyLoop)


@pytest.fixture
def toy_dir(tmp_path, toy_registered) -> Path:
    model = ToyLoop(ToyLoopConfig(**SHAPE))
    model.init_weights(torch.Generator().manual_seed(0), std=0.2)
    return save_checkpoint(model, tmp_path / "toy", tokenizer=make_tiny_tokenizer())


def test_a_family_is_a_schema_and_a_module_of_under_150_lines():
    lines = Path(toy_family.__file__).read_text().splitlines()
    assert len(lines) < 150, f"the toy family takes {len(lines)} lines"


def test_it_saves_and_loads_by_its_key_names_and_info_describes_it(toy_dir):
    model = load_checkpoint(toy_dir).model
    assert isinstance(model, ToyLoop) and {"model.embed_tokens.weight", "model.layers.2.self_attn.k_proj.weight",
                                           "model.norm.weight", "lm_head.weight"} <= set(model.state_dict())
    report = describe(inspect_checkpoint(toy_dir))
    assert report["architecture"] == "toy_loop" and report["layers"] == {"prelude": 1, "loop": 2}
    assert report["loop_groups"] == [{"name": "core", "layers": 2, "default_steps": 3, "max_steps": 6,
                                      "random_init": False}]


@torch.no_grad()
def test_its_stages_compute_the_loop_it_describes(toy_dir):
    """The engine's view (prelude stage, core loop) is the docstring's loop, written out by hand."""
    model = load_checkpoint(toy_dir).model
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    layers, ctx = model.model.layers, AttnContext()
    s = layers[0](model.model.embed_tokens(ids), model.rope, ctx)
    for _ in range(4):
        s = model.model.norm(layers[2](layers[1](s, model.rope, ctx), model.rope, ctx))
    # the same modules in the same order; the stage view only routes them (any gap is float reordering in SDPA)
    torch.testing.assert_close(model(ids, 4), model.lm_head(s).float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy,tau", [("kl", 1e-2), ("second_order", 1.0), ("oracle", None)])
def test_the_engine_exits_it_batched_as_alone(toy_dir, policy, tau):
    engine = ExitEngine(load_checkpoint(toy_dir).model, ExitConfig(policy, threshold=tau))
    requests = mixed_requests(6)
    together = engine.score(requests, batch_size=6)
    alone = [result for r in requests for result in engine.score([r], batch_size=1)]
    assert exit_steps(together) == exit_steps(alone)
    assert all(logprobs_close(a.logprobs, b.logprobs) for a, b in zip(together, alone))
    assert {steps[0] for request in exit_steps(together) for steps in request} <= {1, 2, 3}


@pytest.mark.parametrize("fields,words", [({"num_loop_layers": 4}, "num_loop_layers=4 exceeds"),
                                          ({"max_loops": 2}, "max_loops=2 is below the trained num_loops=3")])
def test_its_schema_refuses_a_bad_config_in_one_line(toy_dir, tmp_path, fields, words):
    with pytest.raises(CheckpointError, match=words) as err:
        load_checkpoint(edited_copy(toy_dir, tmp_path / "edited", **fields))
    assert "\n" not in str(err.value)


# What adding a family takes outside tests/ and docs/ (docs/adding-a-family.md): its module, the registry's one
# `register` call, its full-size bench and the README's model table. (bench/RESULTS.md, which records the size
# bench's footprint, is a record of a measurement, as docs/ is of the rest.)
KIT_FAMILIES = {"nanbeige": "Nanbeige", "hrm_text": "HrmText", "dory": "Dory"}


@pytest.mark.parametrize("module", sorted(KIT_FAMILIES))
def test_a_family_built_with_the_kit_is_named_in_four_places(module):
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    naming = sorted(path for path in listed.split()
                    if not path.startswith(("tests/", "docs/")) and path != "bench/RESULTS.md"
                    and (root / path).is_file() and (module in (text := (root / path).read_text(errors="ignore"))
                                                     or KIT_FAMILIES[module] in text))
    assert naming == sorted(["README.md", f"bench/make_{module}_size.py", f"exitbench/models/{module}.py",
                             "exitbench/models/registry.py"])
