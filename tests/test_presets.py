"""Presets: the shipped protocols load and list, `run --preset` takes its options from one (flags override it),
and `pareto` / `report` put the published numbers beside the measured fixed-depth cells."""
from __future__ import annotations

import json

import pytest

from exitbench import presets
from exitbench.cli import app
from exitbench.errors import ExitbenchError

from helpers.cli import assert_one_line_error, explain, runner
from helpers.paths import GSM8K_DIR


def test_every_shipped_preset_loads_and_carries_published_numbers_with_a_source():
    names = presets.names()
    assert {"huginn-0125-gsm8k-cot", "huginn-0125-zero-shot", "ouro-1.4b-mmlu", "recurrent-tinyllama-gsm8k"} <= set(names)
    for name in names:
        p = presets.load(name)
        # a published sweep whose paper's tables were not read carries its protocol and rules, not numbers
        assert p.source and (p.numbers() or p.policies) and set(p.numbers()) <= set(p.tasks)
        for by_metric in p.numbers().values():
            for by_depth in by_metric.values():
                assert set(by_depth) <= set(p.baselines) and all(0 <= v <= 100 for v in by_depth.values())
    huginn = presets.load("huginn-0125-gsm8k-cot")
    assert huginn.apply_chat_template and huginn.fewshot_as_multiturn and huginn.num_fewshot == 8
    assert huginn.numbers()["gsm8k_cot"]["exact_match,flexible-extract"][32] == 42.08
    res = runner.invoke(app, ["presets", "--json"])
    assert res.exit_code == 0 and [p["name"] for p in json.loads(res.stdout)] == names


def test_flags_on_the_command_line_override_the_preset():
    p = presets.load("huginn-0125-gsm8k-cot")
    options = {"tasks": "chains", "baselines": "4", "checkpoint": "tiny-raven", "policy": ["kl"],
               "num_fewshot": None, "apply_chat_template": False, "system_instruction": None,
               "fewshot_as_multiturn": None, "add_bos_token": None, "dtype": "auto"}
    out = presets.apply(p, options, given={"checkpoint", "policy"})
    assert out["checkpoint"] == "tiny-raven" and out["policy"] == ["kl"]  # given: kept
    assert out["tasks"] == "gsm8k_cot" and out["baselines"] == "1,32" and out["apply_chat_template"] is True
    assert presets.apply(p, options, given=set())["policy"] == ["fixed"]  # the published numbers first


@pytest.mark.parametrize("name,rule,grid,knobs", [
    ("cdb-ouro-1.4b-gsm8k", "qexit", [0.01, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 0.9], {"min_steps": 2}),
    ("cdb-huginn-gsm8k", "first_order", [0.02, 0.06, 0.1, 0.14, 0.16, 0.2, 0.24, 0.28, 0.3, 0.34],
     {"relative": True, "max_steps": 16}),
])
def test_a_published_sweep_runs_its_rule_over_its_grid_beside_second_order(name, rule, grid, knobs):
    """Continuous Depth Batching's sweeps: its fixed depths, its rule over its own thresholds with its knobs, and
    second order beside it; the grids are recorded as the preset's (`derived`), not keyed."""
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import RunOptions, SweepConfig
    from exitbench.sweep.schedule import exit_configs

    p = presets.load(name)
    checkpoint = "tiny-ouro" if rule == "qexit" else "tiny-raven"
    cfg = SweepConfig.from_options(RunOptions(preset=name, checkpoint=checkpoint, tasks="chains"), {},
                                   given={"checkpoint", "tasks"})
    assert cfg.policies == [rule, "second_order"] and cfg.baselines == p.baselines
    assert cfg.derived == {"from": f"preset {name}", "grids": p.thresholds}
    if rule == "first_order":
        return  # tiny-raven's loop is shorter than Huginn's cap of 16: the configs are for the real checkpoint
    configs = exit_configs(open_checkpoint(checkpoint), cfg)
    assert [c.threshold for c in configs if c.policy == "fixed"] == [1, 2, 3, 4]
    assert [c.threshold for c in configs if c.policy == rule] == grid
    assert all(c.min_steps == 2 for c in configs if c.policy != "fixed")
    assert len([c for c in configs if c.policy == "second_order"]) > 3  # the model's own grid


def test_a_preset_rule_the_command_line_names_sweeps_its_own_grid():
    from exitbench.sweep.config import RunOptions, SweepConfig

    cfg = SweepConfig.from_options(RunOptions(preset="cdb-ouro-1.4b-gsm8k", policy=["second_order"]), {},
                                   given={"policy"})
    assert cfg.policies == ["second_order"] and cfg.derived is None


def test_an_unknown_preset_and_a_replayed_one_are_one_line():
    assert_one_line_error(runner.invoke(app, ["run", "--preset", "huginn-9999"]), ["huginn-9999", "exitbench presets"])
    assert_one_line_error(runner.invoke(app, ["run", "--preset", "ouro-1.4b-mmlu", "-c", "tiny-raven", "--replay"]),
                          ["--preset", "without --replay"])
    with pytest.raises(ExitbenchError, match="unknown preset"):
        presets.load("../README")


def assert_published_beside_measured(out, published: str) -> None:
    """pareto's table and the report show the published number beside the measured one, and say whose it is."""
    res = runner.invoke(app, ["pareto", str(out)])
    assert res.exit_code == 0, explain(res)
    assert "published vs measured" in res.stdout and published in res.stdout
    assert "published numbers are for smcleish/Recurrent-TinyLlama-3T-train-recurrence-4" in " ".join(
        res.stderr.split())
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, explain(res)
    page = (out / "report.html").read_text()
    assert "Published vs measured" in page and "McLeish et al. 2025" in page


def test_a_presets_numbers_go_into_its_cells_and_beside_them_in_pareto_and_report(tmp_path):
    """The library half of the run below, on a shipped task (no lm-eval task index to build): a sweep made from
    a preset carries the published numbers in its cells, and the readers print them beside the measured ones."""
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.schedule import run_cells

    shipped = presets.load("recurrent-tinyllama-gsm8k")
    chains = shipped.model_copy(update={"tasks": ["chains"], "published": {
        "source": shipped.source, "chains": {"exact_match,none": {1: 12.5}}}})
    out = tmp_path / "preset"
    cfg = SweepConfig(tasks=["chains"], policies=["fixed"], baselines=[1], limit=2, quiet=True, timing_repeats=0,
                      preset=chains)
    run_cells(open_checkpoint("tiny-raven"), resolve_tasks(["chains"]), cfg, out, "cpu")
    (cell,) = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert cell["preset"]["name"] == "recurrent-tinyllama-gsm8k"
    assert cell["preset"]["published"]["exact_match,none"]["1"] == 12.5
    assert_published_beside_measured(out, "12.50")


@pytest.mark.slow  # 16 s: lm-eval's gsm8k_cot (its task index) on the local GSM8K; what the preset puts into the
# cells and the readers is checked fast on a shipped task (test_a_presets_numbers_go_into_its_cells_and_beside_…)
def test_a_preset_run_puts_the_papers_numbers_beside_its_cells(tmp_path):
    """On the embedded model the preset runs the plumbing (its task, shots, BOS rule, dtype) and the tables
    say the published numbers are for the real checkpoint."""
    out = tmp_path / "preset"
    res = runner.invoke(app, ["run", "--preset", "recurrent-tinyllama-gsm8k", "-c", "tiny-raven", "--data-dir",
                              str(GSM8K_DIR), "--limit", "1", "--baselines", "1", "--gen-kwargs", "max_gen_toks=4",
                              "--out", str(out), "--quiet"])
    assert res.exit_code == 0, explain(res)
    (cell,) = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert cell["task"]["name"] == "gsm8k_cot" and cell["key"]["num_fewshot"] == 1
    assert cell["key"]["add_bos_token"] is True and cell["key"]["dtype"] == "float32"
    assert cell["preset"]["name"] == "recurrent-tinyllama-gsm8k"
    assert cell["preset"]["published"]["exact_match,flexible-extract"]["1"] == 18.9
    assert_published_beside_measured(out, "18.90")
