"""The memory plan (`exitbench info --plan`): weights, the KV cache the engine will allocate, activations; and
`run` refusing, before its first cell, a sweep whose plan exceeds the device's free memory."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.engine.memory import plan
from exitbench.models import Raven, RavenConfig

from helpers.cli import assert_one_line_error, explain
from helpers.models import HUGINN_CONFIG, HUGINN_PARAMETERS, make_tiny_raven, random_ids
from helpers.sweeps import SMALL

runner = CliRunner()


def huginn_on_meta() -> Raven:
    with torch.device("meta"):
        return Raven(RavenConfig(**HUGINN_CONFIG))


def test_huginn_plan_counts_one_slot_per_iteration_per_core_layer():
    """Huginn-0125 at batch 16, 1,000 positions, 32 iterations, bf16: 4 core layers × 32 slots + 4 plain
    layers, keys and values of 55 heads × 96 → 44.6 GB of cache beside 7.1 GB of weights (issue 15)."""
    p = plan(huginn_on_meta(), torch.bfloat16, batch=16, context=1000)
    assert p["max_steps"] == [32]
    assert p["weights"] == 2 * HUGINN_PARAMETERS
    assert p["kv_cache"] == 2 * (4 * 32 + 4) * 16 * 1000 * 55 * 96 * 2 == 44_605_440_000
    assert p["kv_layout"] == {"loop_layers": 4, "slots_per_loop_layer": [32], "plain_layers": 4, "state_layers": 0,
                              "bytes_per_slot": 2 * 16 * 1000 * 5280 * 2}
    assert p["total"] == p["weights"] + p["kv_cache"] + p["activations"]
    # The cache scales with iterations: 8 iterations need a quarter of the loop layers' slots.
    assert plan(huginn_on_meta(), torch.bfloat16, 16, 1000, max_steps=8)["kv_cache"] == \
        2 * (4 * 8 + 4) * 16 * 1000 * 55 * 96 * 2


@pytest.mark.parametrize("policy,max_steps", [("second_order", None), ("kl", 5), ("fixed", 3)])
def test_engine_allocates_what_the_plan_says(policy, max_steps, monkeypatch):
    """A run's cache holds its requests' longest sequence (not the model's context) at its policy's depth, and
    is exactly the plan's KV for those rows, positions and iterations."""
    model = make_tiny_raven(mean_recurrence=4, max_recurrence=8, block_size=128)
    knobs = {"max_steps": max_steps} if max_steps and policy != "fixed" else {}
    config = ExitConfig(policy, threshold=max_steps if policy == "fixed" else None, **knobs)
    engine = ExitEngine(model, config)
    made = []
    original = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **k: made.append(original(*a, **k)) or made[-1])
    lengths = [9, 17, 12]
    engine.score([(random_ids(1, n, seed=n)[0].tolist(), 3) for n in lengths], batch_size=2)
    (cache,) = made
    longest_input = max(lengths) - 1  # the last token is only ever a target
    assert cache.capacity == longest_input < model.config.block_size
    depth = engine.policies[0].max_steps
    assert cache.nbytes() == plan(model, torch.float32, batch=2, context=longest_input, max_steps=depth)["kv_cache"]


def test_plan_refuses_what_no_run_could_do():
    model = huginn_on_meta()
    with pytest.raises(ExitbenchError, match="--context must be between 1 and the model's context of 4096"):
        plan(model, torch.bfloat16, 1, 5000)
    with pytest.raises(ExitbenchError, match="--max-steps 65: the core_block group runs 1 … 64"):
        plan(model, torch.bfloat16, 1, 10, max_steps=65)
    with pytest.raises(ExitbenchError, match="--batch-size must be ≥ 1"):
        plan(model, torch.bfloat16, 0, 10)


def test_info_plan_cli(tiny_checkpoint):
    res = runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--batch-size", "4", "--context", "50",
                              "--max-steps", "6", "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)["plan"]
    assert (p["batch_size"], p["context"], p["max_steps"], p["dtype"]) == (4, 50, [6], "float32")
    assert p["device"] == "cpu" and p["available"] > p["total"]
    assert p["kv_cache"] == 2 * (4 * 6 + 4) * 4 * 50 * 32 * 4
    res = runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    # The plan's default batch is run's (16), and it says whether the total fits what the device has free.
    assert "memory plan: batch 16, context 128, max steps 4, bfloat16" in res.stdout
    assert "free on cpu" in res.stdout and "fits" in res.stdout
    res = runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--batch-size", str(10 ** 9)])
    assert res.exit_code == 0 and "does NOT fit" in res.stdout
    assert "warning: the plan needs" in res.stderr and "lower --batch-size" in res.stderr
    assert "KV cache" in res.stdout and "4 loop layers × 4 slots + 4 plain layers × 1 slot" in res.stdout
    assert_one_line_error(runner.invoke(app, ["info", "-c", str(tiny_checkpoint), "--plan", "--context", "0"]),
                          ["--context", "128"])


def test_a_sweep_whose_plan_cannot_fit_is_refused_before_its_first_cell(tmp_path, monkeypatch):
    import exitbench.runtime.devices as devices
    import exitbench.sweep.schedule

    def no_compute(*a, **k):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(devices, "available_memory", lambda device: 1000)  # 1 kB free
    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", no_compute)
    res = runner.invoke(app, ["run", *SMALL, "--out", str(tmp_path / "o")])
    assert_one_line_error(res, ["needs at least", "GB free", "--no-memory-check"])
    monkeypatch.setattr(exitbench.sweep.schedule, "run_config", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    res = runner.invoke(app, ["run", *SMALL, "--no-memory-check", "--out", str(tmp_path / "o")])
    assert res.exit_code == 130, explain(res)  # past the check: the first cell started
