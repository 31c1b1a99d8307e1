"""What a run prints besides its results. exitbench.harness.quiet: lm-eval's console noise around
simple_evaluate, silenced without hiding errors or changing a result. On the command line: exitbench's own
progress (a line per cell off a terminal, with the time spent and left) in place of lm-eval's bars, and with
--quiet the table alone.

The evaluations run in this process, the way exitbench.sweep calls lm-eval, from a directory outside any git
checkout. Output is read at the file-descriptor level (capfd), where git's stderr lands.
"""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from exitbench.cli import app
from exitbench.harness.quiet import _git_describe_without_stderr, lm_eval_output

from helpers.cli import explain, invoke, runner
from helpers.sweeps import SMALL, SMALL_LOUD

NOISE = ("bootstrapping for stddev", "fatal:", "WARNING", "Custom kwargs", "it/s]", "Generating train split")


@pytest.fixture
def outside_git(tmp_path, monkeypatch):
    """cwd in tmp_path, where git finds no repository (the ceiling stops it searching the parents)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    return tmp_path


class StderrNow(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it between setup and call)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


@pytest.fixture
def lm_eval_console():
    """lm-eval's loggers as a fresh process has them on a console: WARNING and up, printed to stderr.

    Earlier tests leave the `lm_eval` logger at ERROR (simple_evaluate's verbosity) or with a handler bound to
    a closed stream; pytest's own capture would otherwise take records that reach the root logger.
    """
    import lm_eval.utils

    logger = logging.getLogger("lm_eval")
    saved = logger.handlers[:], logger.level, logger.propagate, lm_eval.utils._LOGGING_CONFIGURED
    logger.handlers = [StderrNow()]
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    lm_eval.utils._LOGGING_CONFIGURED = True  # keeps simple_evaluate from adding a second handler
    yield
    logger.handlers, level, logger.propagate, lm_eval.utils._LOGGING_CONFIGURED = saved
    logger.setLevel(level)


def evaluate(quiet: bool, cache_dir) -> dict:
    """chains (generation) and chains_lambada (perplexity, a bootstrapped stderr), as a sweep cell runs them,
    with an empty datasets cache so the data is prepared (and its progress bar drawn) again."""
    import datasets.config
    import lm_eval

    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.engine import ExitConfig
    from exitbench.harness.model import ExitbenchLM
    from exitbench.harness.task_set import resolve_tasks

    saved_cache = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(cache_dir)
    try:
        task_set = resolve_tasks(["chains", "chains_lambada"])
        lm = ExitbenchLM.from_checkpoint(open_checkpoint(None), ExitConfig("second_order", threshold=0.1),
                                         batch_size=16)
        with lm_eval_output(quiet=quiet):
            return lm_eval.simple_evaluate(
                model=lm, tasks=task_set.specs, task_manager=task_set.manager, limit=4, bootstrap_iters=1000,
                random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                verbosity="ERROR")
    finally:
        datasets.config.HF_DATASETS_CACHE = saved_cache


def test_quiet_evaluation_prints_nothing_and_computes_the_same(outside_git, lm_eval_console, capfd):
    capfd.readouterr()
    loud = evaluate(quiet=False, cache_dir=outside_git / "cache-loud")
    heard = capfd.readouterr()
    # The noise is really there without quiet, so its absence below means something; git's is gone anyway.
    assert "bootstrapping for stddev: perplexity" in heard.out
    # lm-eval's advice for its own --metadata flag never prints, loud or quiet (exitbench has no such flag)
    assert "Custom kwargs can be passed to `--metadata`" not in heard.err
    assert "it/s]" in heard.err and "Generating train split" in heard.err
    assert "fatal:" not in heard.err + heard.out and "Logging error" not in heard.err

    # simple_evaluate(verbosity="ERROR") left lm-eval at ERROR for the rest of the process (so a sweep's first
    # cell is the noisy one); back to a fresh console's WARNING, so the quiet run has to do the silencing.
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    quiet = evaluate(quiet=True, cache_dir=outside_git / "cache-quiet")
    heard = capfd.readouterr()
    for noise in NOISE:
        assert noise not in heard.out + heard.err, (noise, heard)
    assert heard.out.strip() == "" and heard.err.strip() == "", heard
    assert quiet["results"] == loud["results"]
    assert isinstance(quiet["results"]["chains_lambada"]["perplexity_stderr,none"], float)
    assert quiet["git_hash"] is None  # outside a checkout, as lm-eval itself reports it


def test_quiet_keeps_errors_and_restores_everything(lm_eval_console, capfd):
    import datasets
    import lm_eval.api.metrics
    import lm_eval.api.task

    before = (lm_eval.api.metrics.bootstrap_stderr, lm_eval.api.task.tqdm, logging.getLogger("lm_eval").level,
              datasets.is_progress_bar_enabled())
    capfd.readouterr()
    with pytest.raises(ZeroDivisionError):
        with lm_eval_output(quiet=True):
            logging.getLogger("lm_eval.api.task").warning("a warning the quiet run drops")
            logging.getLogger("lm_eval.api.task").error("an error it keeps")
            1 / 0
    heard = capfd.readouterr()
    assert "an error it keeps" in heard.err
    assert "a warning the quiet run drops" not in heard.err
    after = (lm_eval.api.metrics.bootstrap_stderr, lm_eval.api.task.tqdm, logging.getLogger("lm_eval").level,
             datasets.is_progress_bar_enabled())
    assert after == before


def test_git_lookup_keeps_lm_evals_answer_without_its_noise(outside_git, monkeypatch, capfd):
    """Same answer as lm-eval's own lookup, inside a repository and outside one; only git's stderr goes."""
    from lm_eval.loggers.utils import get_git_commit_hash

    capfd.readouterr()
    assert get_git_commit_hash() is None
    assert "fatal: not a git repository" in capfd.readouterr().err  # what lm-eval does on its own
    assert _git_describe_without_stderr() is None
    assert capfd.readouterr().err == ""

    repo = outside_git / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    (repo / "sub").mkdir()
    monkeypatch.chdir(repo / "sub")
    assert _git_describe_without_stderr() == get_git_commit_hash() and len(get_git_commit_hash()) >= 7


_spawned: list[str] | None = None  # while a list: every program this process starts is appended to it


def _record_spawns(event: str, args: tuple) -> None:
    if _spawned is not None and event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork"):
        _spawned.append(event if event == "os.fork" else str(args[1] if event == "subprocess.Popen" else args[0]))


sys.addaudithook(_record_spawns)  # audit hooks cannot be removed: it records only inside the test below


def test_a_sweep_spawns_no_program_per_cell(tmp_path):
    """lm-eval's environment report ran torch's collect_env, a dozen programs (`pip list` among them) per
    cell, and its bootstrap of perplexity's stderr a pool of forked workers per cell; a run's own provenance may
    start a few programs, once."""
    global _spawned
    from helpers.cli import run_ok

    _spawned = []
    try:
        run_ok("--tasks", "chains_lambada", "--policy", "second_order", "--thresholds", "1,2", "--baselines", "1,16",
               "--limit", "2", "--timing-repeats", "0", "--out", str(tmp_path / "cells"))
    finally:
        spawned, _spawned = _spawned, None
    assert len(list((tmp_path / "cells").glob("*.json"))) == 4
    assert not [p for p in spawned if "pip" in p or "conda" in p or "nvidia-smi" in p or p == "os.fork"], spawned
    assert len(spawned) <= 4, spawned  # uname, git rev-parse, git status, git describe: once each at most


# ---- on the command line: exitbench's progress, not lm-eval's -----------------------------------------------------

def test_a_quiet_run_prints_the_table_and_nothing_else(tmp_path, capfd):
    code, lines, out = invoke(["run", *SMALL, "--out", str(tmp_path / "o")], capfd)
    assert code == 0
    # no lm-eval warnings, bootstrap lines, request bars or git noise; only why its four documents carry no
    # speed-up (test_retime: a task too small to retime says so)
    assert [line for line in lines if "too few to retime" not in line] == [], lines
    assert "bootstrapping" not in out and "%|" not in out and "cells in" in out


def test_progress_off_a_terminal_is_a_line_per_cell(tmp_path, capfd):
    args = [a for a in SMALL if a != "--quiet"]
    code, lines, out = invoke(["run", *args, "--out", str(tmp_path / "o")], capfd)
    assert code == 0
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/2", "[2/2"]
    # so that a slow machine never looks like a hung one: the time spent, and before the end the time left
    assert re.search(r" · \d+ s elapsed, about \d+ s left$", progress[0]), progress
    assert re.search(r" · \d+ s elapsed$", progress[1]), progress
    # and at the end, what to do next with the cells (issue 72): the two readers, on this run's folder
    said = "\n".join(lines)
    assert f"next: exitbench pareto {tmp_path / 'o'}" in said and f"exitbench report {tmp_path / 'o'}" in said, lines


@pytest.mark.parametrize("mode", [[], ["--replay"]], ids=["exact", "replay"])
def test_a_run_showing_its_progress_prints_no_lm_eval_bars(mode, tmp_path, capfd):
    capfd.readouterr()
    res = runner.invoke(app, ["run", *SMALL_LOUD, *mode, "--out", str(tmp_path / "o")])
    fd = capfd.readouterr()
    assert res.exit_code == 0, explain(res)
    out, err = res.stdout + fd.out, res.stderr + fd.err
    assert "it/s]" not in err and "%|" not in err, err  # lm-eval's request and bootstrap bars (tqdm)
    assert "bootstrapping for stddev" not in out, out
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/2", "[2/2"]  # exitbench's own progress remains


def test_only_exitbench_progress_switches_lm_evals_bars_off():
    """The switch is exitbench's progress, not a blanket silence: outside --quiet lm-eval keeps its warnings, and
    its bars stay wherever nothing else shows progress (a bare evaluation, a sweep run as a library call)."""
    import logging

    import lm_eval.api.metrics
    import lm_eval.api.task
    from tqdm import tqdm

    from exitbench.harness.quiet import lm_eval_output

    bootstrap = lm_eval.api.metrics.bootstrap_stderr
    level = logging.getLogger("lm_eval").level
    with lm_eval_output(quiet=False, progress_bars=True):
        assert lm_eval.api.task.tqdm is tqdm and lm_eval.api.metrics.bootstrap_stderr is bootstrap
    with lm_eval_output(quiet=False, progress_bars=False):
        assert lm_eval.api.task.tqdm is not tqdm and lm_eval.api.metrics.bootstrap_stderr is not bootstrap
        assert logging.getLogger("lm_eval").level == level
    assert lm_eval.api.task.tqdm is tqdm and lm_eval.api.metrics.bootstrap_stderr is bootstrap
