"""`exitbench lm-eval …`: lm-eval's own CLI with the exitbench model, its shipped tasks and one-line errors.

Bad input and --help run in this process (typer's CliRunner, plus capfd for what reaches file descriptor 2);
one real run goes through the installed entry point, from a directory outside any git checkout.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.harness.cli import prepare, with_shipped_tasks
from exitbench.harness.task_set import SHIPPED_TASKS

from helpers.cli import assert_one_line_error, exitbench_cmd, explain, subprocess_env
from helpers.files import truncate_shard

runner = CliRunner()
RUN = ["lm-eval", "run", "--model", "exitbench", "--tasks", "chains", "--limit", "2"]


@pytest.fixture
def fresh_lm_eval_logging():
    """lm-eval as a new process has it: its first setup_logging() adds a handler on the stderr of that moment
    (here the runner's), so anything lm-eval logs before the error shows up in the result's stderr."""
    import lm_eval.utils

    logger = logging.getLogger("lm_eval")
    saved = logger.handlers[:], logger.level, logger.propagate, lm_eval.utils._LOGGING_CONFIGURED
    logger.handlers = []
    lm_eval.utils._LOGGING_CONFIGURED = False
    yield
    logger.handlers, level, logger.propagate, lm_eval.utils._LOGGING_CONFIGURED = saved
    logger.setLevel(level)


@pytest.fixture
def truncated_checkpoint(tiny_checkpoint):
    """The tiny sharded checkpoint with its second shard cut to half its length."""
    return tiny_checkpoint, truncate_shard(tiny_checkpoint)


BAD = {
    "unknown-policy": (["--model_args", "policy=nope"], "'nope'"),
    "negative-threshold": (["--model_args", "policy=second_order,threshold=-1"], "got -1"),
    "unknown-key": (["--model_args", "foo=1"], "'foo'"),
    "device-in-model-args": (["--model_args", "device=tpu"], "'tpu'"),
    "device-flag": (["--device", "tpu"], "'tpu'"),
    "device-given-twice": (["--model_args", "device=cpu", "--device", "cuda"], "disagree"),
    "batch-size-in-model-args": (["--model_args", "batch_size=0"], "batch_size must be ≥ 1"),
    "truncated-checkpoint": (["--model_args", "checkpoint={checkpoint}"], "{shard} is truncated"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_args_end_with_one_line_and_exit_2(case, truncated_checkpoint, fresh_lm_eval_logging, capfd):
    checkpoint, shard = truncated_checkpoint
    args, needle = BAD[case]
    args = [a.format(checkpoint=checkpoint) for a in args]
    capfd.readouterr()
    res = runner.invoke(app, [*RUN, *args])
    assert_one_line_error(res, [needle.format(shard=shard)], fd=capfd.readouterr())


@pytest.mark.parametrize("argv, expected", [
    (["lm-eval", "run", "--help"], ["--model_args", "--include_path", "--limit"]),
    (["lm-eval", "--help"], ["Language Model Evaluation Harness", "run", "validate"]),
])
def test_help_is_lm_evals(argv, expected):
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, explain(res)
    for text in expected:
        assert text in res.stdout, (text, res.stdout)


def test_shipped_tasks_join_the_include_path(tmp_path):
    shipped = str(SHIPPED_TASKS)
    mine = tmp_path / "mine"
    assert with_shipped_tasks(None) == [shipped]
    assert with_shipped_tasks(str(mine)) == [shipped, str(mine)]
    assert with_shipped_tasks([mine, tmp_path]) == [shipped, str(mine), str(tmp_path)]
    # Named already, or inside or around a named folder: indexed once, as the user gave it.
    for given in (shipped, SHIPPED_TASKS / "chains", SHIPPED_TASKS.parent):
        assert with_shipped_tasks(str(given)) == [str(given)]


def test_include_path_from_a_config_file_is_kept(tmp_path, monkeypatch):
    """lm-eval's `run --config FILE` may name the include path; the command line then overrides the file, so the
    edited value has to carry the file's folder too."""
    from lm_eval._cli import HarnessCLI

    config = tmp_path / "run.yaml"
    config.write_text(f"include_path: {tmp_path}\ntasks: [chains]\n")
    monkeypatch.setattr(sys, "argv", ["lm-eval", "run", "--config", str(config)])
    args = HarnessCLI().parse_args()
    prepare(args)
    assert args.include_path == [str(SHIPPED_TASKS), str(tmp_path)]


@pytest.mark.slow  # 15 s: a fresh interpreter imports torch and lm-eval and builds lm-eval's task index; the
# command's argument handling (test_bad_model_args_…, test_include_path_…) stays fast, in this process
def test_shipped_task_runs_outside_a_checkout_without_include_path_or_git_noise(tmp_path):
    """The real entry point, from a directory git finds no repository in; the device rides in --model_args."""
    out = tmp_path / "lm-eval"
    proc = subprocess.run(
        exitbench_cmd("lm-eval", "run", "--model", "exitbench", "--model_args", "policy=fixed,threshold=4,device=cpu",
                      "--tasks", "chains", "--limit", "4", "--output_path", str(out)),
        env=subprocess_env(GIT_CEILING_DIRECTORIES=str(tmp_path.parent)), capture_output=True, text=True,
        timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fatal:" not in proc.stderr + proc.stdout
    assert "|chains|" in proc.stdout and "exact_match" in proc.stdout
    (results_file,) = list(out.rglob("results_*.json"))
    results = json.loads(results_file.read_text())
    assert 0.0 <= results["results"]["chains"]["exact_match,none"] <= 1.0
    assert results["config"]["device"] == "cpu"
    assert results["config"]["exitbench"]["exit"]["threshold"] == 4


def test_exit_statistics_are_added_to_what_simple_evaluate_returns(tiny_checkpoint):
    """The library half of the CLI run below: lm-eval builds the exitbench model from its name and model args,
    and what `simple_evaluate` returns carries the exits, in its results, its config and its samples."""
    import lm_eval

    import exitbench.harness.model  # noqa: F401  (registers the model with lm-eval, as the CLI does)
    from exitbench.harness.cli import exits_in_lm_evals_results
    from exitbench.harness.exit_statistics import FILTER
    from exitbench.harness.quiet import silence_git_lookup
    from exitbench.harness.task_set import resolve_tasks

    silence_git_lookup()  # as the CLI does
    tasks = resolve_tasks(["chains"])
    original = lm_eval.simple_evaluate
    with exits_in_lm_evals_results():
        results = lm_eval.simple_evaluate(model="exitbench", limit=2, log_samples=True, tasks=tasks.specs,
                                          bootstrap_iters=0,
                                          task_manager=tasks.manager, verbosity="ERROR",
                                          model_args=f"checkpoint={tiny_checkpoint},policy=second_order,threshold=0.1")
    stats = results["config"]["exitbench"]["exit_statistics"]["chains"]
    assert stats["tokens"] > 0 and 1 <= stats["mean"] <= stats["p90"] <= stats["max"]
    assert results["results"]["chains"][f"mean_iterations,{FILTER}"] == stats["mean"]
    assert results["results"]["chains"][f"max_iterations,{FILTER}"] == stats["max"]
    samples = results["samples"]["chains"]
    assert len(samples) == 2 and all(s["exitbench"]["exit_steps"] for s in samples)
    assert sum(s["exitbench"]["tokens"] for s in samples) == stats["tokens"]
    assert lm_eval.simple_evaluate is original  # the wrapper lives for one CLI run only


@pytest.mark.slow  # 17 s, most of it lm-eval's task index, which its CLI builds; the statistics themselves are
# checked fast on what simple_evaluate returns (test_exit_statistics_are_added_to_what_simple_evaluate_returns)
def test_exit_statistics_reach_lm_evals_table_results_and_samples(tiny_checkpoint, tmp_path, capfd):
    """What `exitbench run` records about the exits, a user of lm-eval's own CLI sees in lm-eval's outputs."""
    out = tmp_path / "lm-eval"
    res = runner.invoke(app, [*RUN, "--model_args", f"checkpoint={tiny_checkpoint},policy=second_order,threshold=0.1",
                              "--output_path", str(out), "--log_samples"])
    printed = res.stdout + capfd.readouterr().out
    assert res.exit_code == 0, explain(res)
    assert "mean_iterations" in printed and "|exitbench|" in printed.replace(" ", "")  # lm-eval's table
    (results_file,) = list(out.rglob("results_*.json"))
    results = json.loads(results_file.read_text())
    stats = results["config"]["exitbench"]["exit_statistics"]["chains"]
    assert stats["tokens"] > 0 and 1 <= stats["mean"] <= stats["max"]
    assert results["results"]["chains"]["mean_iterations,exitbench"] == stats["mean"]
    (samples_file,) = list(out.rglob("samples_chains_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 2 and all(s["exitbench"]["exit_steps"] for s in samples)
    assert sum(s["exitbench"]["tokens"] for s in samples) == stats["tokens"]
