"""Results you can trust, part two (issue 29): sweeps that share a directory, reports that never land on a cell,
bad options refused before compute, one cell per computation, and lm-eval's own chatter kept off the console.

- two `--replay` sweeps into one directory compute every cell once: each claims a cell right before it
  replays it, as the exact sweep does, and collects what the other wrote;
- `calibrate --out` and `fit-exit --out` refuse a path that holds a result cell, and replace their own reports;
- bad options (`--limit inf`, `fit-exit --seed -5`, `geometry --steps 100000`, a `--max-steps` past the
  checkpoint's maximum, `--verify-cells` not in the sweep, `--baselines ''`) end with one line before any cell
  is computed;
- a limit that takes every document of a task keys the cell of no limit; a smaller one keys its own;
- a run that shows its own progress prints none of lm-eval's tqdm bars;
- `exitbench lm-eval run --apply_chat_template` on a checkpoint without a chat template says so in one line.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exitbench.store import cells, disk as results
from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.sweep.replay import ReplaySweep
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import plan
from exitbench.harness.task_set import resolve_tasks

from helpers.cells import held_by_another_sweep
from helpers.cli import assert_one_line_error, explain, subprocess_env
from helpers.paths import REPO

runner = CliRunner()
SMALL = ["--tasks", "chains_lambada", "--policy", "second_order", "--thresholds", "0.1", "--baselines", "16",
         "--limit", "4"]
A_CELL = next((REPO / "results" / "baseline").glob("chains_lambada__fixed-16__*.json"))


def no_cells(directory: Path) -> bool:
    return not directory.exists() or not list(directory.rglob("*.json"))


@pytest.fixture(scope="module")
def replay_sweep():
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    tasks = resolve_tasks(["chains_lambada"])
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16], limit=4,
                      replay=True, quiet=True)
    return ck, tasks, cfg


@pytest.fixture
def counted_writes(monkeypatch):
    """run_id → cell ids of every cell file a sweep in this process writes."""
    writes: dict[str, list[str]] = {}
    real = results.write

    def write(directory, cell, samples=None):
        writes.setdefault(cell["run"]["run_id"], []).append(cell["cell_id"])
        return real(directory, cell, samples)

    monkeypatch.setattr(results, "write", write)
    return writes


# ---- 1. concurrent replay sweeps ----------------------------------------------------------------------------------

def test_replay_sweeps_that_planned_together_compute_each_cell_once(tmp_path, replay_sweep, counted_writes):
    """The race, made deterministic: both sweeps look at the empty directory (their plans), then one computes.
    The other finds every cell written once it holds the cell's claim, and collects instead of recomputing."""
    ck, tasks, cfg = replay_sweep
    out = tmp_path / "out"
    first, second = plan(ck, tasks, cfg, out, "cpu"), plan(ck, tasks, cfg, out, "cpu")
    assert not first.done and not second.done
    made = ReplaySweep(ck, tasks, cfg, first).run(out)
    collected = ReplaySweep(ck, tasks, cfg, second).run(out)
    assert len(made) == len(collected) == 2
    assert sorted(counted_writes[first.run_id]) == sorted(c["cell_id"] for c in made)
    assert second.run_id not in counted_writes  # nothing computed, nothing written twice
    assert {c["run"]["run_id"] for c in collected} == {first.run_id}
    assert not list(out.glob(".*.lock"))


def test_a_cell_a_live_sweep_holds_is_collected_not_replayed(tmp_path, replay_sweep, counted_writes):
    """A claim held through another open file refuses the sweep's claim as another process's would. The
    holder writes the cell 0.3 s in and lets go; the sweep replays the rest and collects the held cell."""
    ck, tasks, cfg = replay_sweep
    ref = tmp_path / "ref"
    reference = {c["policy"]["policy"]: c for c in ReplaySweep(ck, tasks, cfg, plan(ck, tasks, cfg, ref, "cpu")).run(ref)}
    out = tmp_path / "out"
    out.mkdir()
    sweep = plan(ck, tasks, cfg, out, "cpu")
    fixed_key = next(key for _, c, key in sweep.cells if c.policy == "fixed")
    with held_by_another_sweep(out, fixed_key, reference["fixed"], tmp_path / "theirs.json", 0.3):
        done = {c["policy"]["policy"]: c for c in ReplaySweep(ck, tasks, cfg, sweep).run(out)}
    assert done["fixed"]["run"]["run_id"] == "the-other-sweep"  # collected, not replayed a second time
    assert done["second_order"]["run"]["run_id"] == sweep.run_id
    assert counted_writes[sweep.run_id] == [done["second_order"]["cell_id"]]
    assert not list(out.glob(".*.lock"))


# Runs `exitbench ARGV` once a go-file appears, logging each cell file it writes (one line per write).
COUNTING_RUN = """
import sys, time
from pathlib import Path
from exitbench.store import disk as results
from exitbench.cli import app
log, go, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
real = results.write
def write(directory, cell, samples=None):
    path = real(directory, cell, samples)
    with open(log, "a") as fh:
        fh.write(cell["cell_id"] + "\\n")
    return path
results.write = write
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
app(argv)
"""


@pytest.mark.slow  # two processes at once, ~10 s; the two fast tests above cover the claim and the collection
def test_two_replay_sweeps_at_once_compute_each_cell_once(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    args = ["run", "--tasks", "chains_lambada,chains_mc", "--policy", "second_order", "--thresholds", "0.1,1",
            "--baselines", "4,16", "--limit", "24", "--replay", "--quiet", "--out", str(out)]
    procs = [subprocess.Popen([sys.executable, "-c", COUNTING_RUN, str(tmp_path / f"writes-{i}"), str(go), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for i in range(2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    go.touch()  # both plan over the same empty directory
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    written = [cid for i in range(2) if (tmp_path / f"writes-{i}").exists()
               for cid in (tmp_path / f"writes-{i}").read_text().split()]
    on_disk = {cells.read(p)["cell_id"] for p in out.glob("*.json")}
    assert len(on_disk) == 2 * 4
    assert sorted(written) == sorted(on_disk)  # every cell written once, by one of the two
    assert not list(out.glob(".*.lock"))


# ---- 2. no writer replaces a result cell ------------------------------------------------------------------------

REPORTS = {  # each command, and the schema of the report it writes
    "calibrate": (["calibrate", "--programs", "4", "--thresholds", "0.1"], "exitbench.calibration"),
    "fit-exit": (["fit-exit", "--limit", "4"], "exitbench.exit_model"),
}
@pytest.mark.parametrize("command", list(REPORTS))
def test_a_report_replaces_its_own_earlier_report(command, tmp_path):
    """What the refusal above must not catch: the command's own report (and files that are not JSON at all)."""
    from exitbench.store.disk import writable_output

    own = tmp_path / "own.json"
    own.write_text(json.dumps({"schema": REPORTS[command][1], "schema_version": 1}))
    assert writable_output(own, "--out") == own
    (tmp_path / "notes.json").write_text("not JSON")
    assert writable_output(tmp_path / "notes.json", "--out") == tmp_path / "notes.json"
    assert writable_output(tmp_path / "new.json", "--out") == tmp_path / "new.json"


# ---- 3. bad options: one line, before anything runs ----------------------------------------------------------------

def run(*args: str):
    """`run` with the small sweep's options, quiet, then ARGS (a later option wins)."""
    return lambda t: ["run", *SMALL, "--quiet", *[a.format(out=t / "o") for a in args]]


BAD = {
    "run --limit inf": (run("--limit", "inf", "--out", "{out}"), ["--limit", "inf"]),
    "run --limit nan": (run("--limit", "nan", "--out", "{out}"), ["--limit", "nan"]),
    "fit-exit --batch-size 0": (lambda t: ["fit-exit", "--batch-size", "0", "--limit", "4", "--out",
                                           str(t / "o" / "m.json")], ["--batch-size", "0"]),
    "fit-exit --batch-size -2": (lambda t: ["fit-exit", "--batch-size", "-2", "--limit", "4", "--out",
                                            str(t / "o" / "m.json")], ["--batch-size", "-2"]),
    "fit-exit --seed -5": (lambda t: ["fit-exit", "--seed", "-5", "--limit", "4", "--out", str(t / "o" / "m.json")],
                           ["--seed", "-5"]),
    "geometry --steps 100000": (lambda t: ["geometry", "--steps", "100000", "--programs", "2", "--out", str(t / "o")],
                                ["--steps 100000", "32"]),
    "run --max-steps past the maximum": (run("--max-steps", "1000", "--out", "{out}"), ["--max-steps 1000", "32"]),
    "run --baselines past the maximum": (run("--baselines", "4,1000", "--out", "{out}"), ["--baselines 1000", "32"]),
    "run --min-steps past the depth": (run("--min-steps", "20", "--out", "{out}"), ["min_steps=20", "max_steps=16"]),
    "run --baselines ''": (run("--baselines", "", "--out", "{out}"), ["--baselines", "empty"]),
    "run --verify-cells policy not swept": (
        run("--replay", "--verify", "--verify-cells", "kl:1e-3", "--out", "{out}"),
        ["--verify-cells kl:0.001", "'kl' is not in this sweep", "second_order at 0.1", "fixed at 16"]),
    "run --verify-cells threshold not swept": (
        run("--replay", "--verify", "--verify-cells", "second_order:0.5", "--out", "{out}"),
        ["--verify-cells second_order:0.5", "no threshold 0.5", "second_order at 0.1"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_option_is_one_line_before_any_cell(case, tmp_path, capfd):
    make_args, words = BAD[case]
    capfd.readouterr()
    res = runner.invoke(app, make_args(tmp_path))
    assert_one_line_error(res, words, fd=capfd.readouterr())
    assert no_cells(tmp_path / "o")  # refused at planning: not one cell computed first


def test_verify_cells_of_the_sweep_are_accepted():
    """The refusal above is of cells the sweep lacks: named cells that are in it pass, whatever the spelling of
    their threshold (1e-1 is 0.1; an iteration count 3 is 3.0)."""
    from exitbench.engine import ExitConfig
    from exitbench.sweep.config import check_named, parse_named

    configs = [ExitConfig("fixed", threshold=16), ExitConfig("second_order", threshold=0.1),
               ExitConfig("argmax_stability", threshold=3)]
    check_named(parse_named("second_order:1e-1,fixed:16,argmax_stability:3.0"), configs)
    with pytest.raises(ExitbenchError, match="argmax_stability has no threshold 4"):
        check_named(parse_named("argmax_stability:4"), configs)


# ---- 4. one computation, one cell id ------------------------------------------------------------------------------

def _cell_ids(ck, tasks, limit, out: Path) -> list[str]:
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["fixed"], baselines=[1], limit=limit)
    return [cells.cell_id(key) for _, _, key in plan(ck, tasks, cfg, out, "cpu").cells]


def test_a_limit_that_takes_every_document_keys_the_cell_of_no_limit(tmp_path, replay_sweep):
    ck, tasks, _ = replay_sweep
    n_docs = len((REPO / "tasks" / "chains" / "test.jsonl").read_text().splitlines())
    assert n_docs == 600
    whole = _cell_ids(ck, tasks, None, tmp_path)
    assert len(whole) == 1
    for limit in (600, 601, 10**12, 0.9999):  # 0.9999 of 600 documents rounds up to all 600, as lm-eval counts
        assert _cell_ids(ck, tasks, limit, tmp_path) == whole, limit
    parts = {limit: _cell_ids(ck, tasks, limit, tmp_path) for limit in (599, 48, 0.5)}
    assert all(ids != whole for ids in parts.values())
    assert len({tuple(ids) for ids in parts.values()}) == 3
    # a limit that leaves documents out is keyed as given (the committed baselines use --limit 48)
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["fixed"], baselines=[16], limit=48)
    (_, _, key), = plan(ck, tasks, cfg, tmp_path, "cpu").cells
    committed = cells.read(A_CELL)
    assert key["limit"] == committed["key"]["limit"] == 48
    assert {k: v for k, v in key.items() if k != "versions"} == \
        {k: v for k, v in committed["key"].items() if k != "versions"}


@pytest.mark.slow  # all 600 documents, 3-4 s for what the plan-level test above checks in 0.4 s
def test_limit_600_and_no_limit_are_one_cell_on_disk(tmp_path):
    out = tmp_path / "o"
    args = ["run", "--tasks", "chains_lambada", "--policy", "fixed", "--baselines", "1", "--quiet", "--out", str(out)]
    res = runner.invoke(app, [*args, "--limit", "600"])
    assert res.exit_code == 0, explain(res)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, explain(res)
    assert "reusing 1 cell" in res.stderr
    assert len(list(out.glob("*.json"))) == 1


# ---- 5. lm-eval's bars ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [[], ["--replay"]], ids=["exact", "replay"])
def test_a_run_showing_its_progress_prints_no_lm_eval_bars(mode, tmp_path, capfd):
    capfd.readouterr()
    res = runner.invoke(app, ["run", *SMALL, *mode, "--out", str(tmp_path / "o")])
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


# ---- 6. chat templates --------------------------------------------------------------------------------------------

def test_apply_chat_template_is_one_line(capfd):
    capfd.readouterr()
    res = runner.invoke(app, ["lm-eval", "run", "--model", "exitbench", "--model_args", "policy=fixed", "--tasks",
                              "chains_lambada", "--limit", "2", "--apply_chat_template"])
    assert_one_line_error(res, ["--apply_chat_template", "no chat template"], fd=capfd.readouterr())


def test_the_model_itself_says_it_has_no_chat_template():
    """Called from Python (simple_evaluate(apply_chat_template=True)) the model's answer is the same line, not
    lm-eval's NotImplementedError (tiny-raven's tokenizer has no template; tests/test_chat.py has one that does)."""
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.engine import ExitConfig
    from exitbench.harness.model import ExitbenchLM

    lm = ExitbenchLM.from_checkpoint(open_checkpoint(None), ExitConfig("fixed", threshold=4))
    with pytest.raises(ExitbenchError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "a=1 q=a"}])


# ---- 7. Ctrl-C ----------------------------------------------------------------------------------------------------

def test_ctrl_c_says_what_is_kept_and_that_a_rerun_resumes(tmp_path, monkeypatch):
    """Interrupted mid-sweep, `run` says how many of its cells are on disk and that the same command resumes,
    and exits 130 (the shell's code for SIGINT), not silently."""
    import exitbench.sweep.run

    runner = CliRunner()
    args = ["run", "--tasks", "chains_lambada", "--limit", "2", "--baselines", "4", "--out", str(tmp_path), "--quiet"]
    first = runner.invoke(app, [*args, "-p", "second_order", "--thresholds", "0.1"])
    assert first.exit_code == 0, explain(first)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(exitbench.sweep.run, "execute", interrupted)
    res = runner.invoke(app, [*args, "-p", "second_order", "--thresholds", "0.1,0.2"])
    assert res.exit_code == 130, explain(res)
    assert "interrupted: 2 of the sweep's 3 cells are finished and kept in" in " ".join(res.stderr.split())
    assert "rerun the same command to resume" in " ".join(res.stderr.split())
