"""`exitbench check`: regressions exit 1 and are named, identical runs and wall-clock noise exit 0. A verdict only
after comparing cells: a partial sweep says what it compared, a check that compared nothing is exit 2 (naming the
dimensions the two sides differ in), a crash is exit 3, never read as a regression; the learned rule is matched by
its exit model's content, not its path."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
from typer.testing import CliRunner

from exitbench.store import disk as results
from exitbench.cli import app
from exitbench.policies.distribution import KL
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import run_cells
from exitbench.harness.task_set import resolve_tasks

from helpers.cells import ACC, PPL, baseline_cells, copy_cells
from helpers.cli import explain, invoke, one_line, runner
from helpers.paths import BASELINE, REPO


def write(directory, cell_list):
    for c in cell_list:
        results.write(directory, c)
    return directory


def check(run, base, *extra):
    return CliRunner().invoke(app, ["check", str(run), "--baseline", str(base), *extra])


@pytest.fixture
def base(tmp_path):
    return write(tmp_path / "base", ACC + PPL)


def test_identical_runs_pass(tmp_path, base):
    res = check(write(tmp_path / "run", copy.deepcopy(ACC + PPL)), base)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "no regression" in res.stdout


def test_a_run_that_records_where_rules_can_exit_matches_a_baseline_that_did_not(tmp_path, base):
    """Cells now say where their rule can first exit (policy.earliest_exit, late_exit): derived from the knobs, so
    a committed baseline written before is the same cell, not a missing one (CI's replay gate found 252 of 267
    missing)."""
    run = copy.deepcopy(ACC + PPL)
    for c in run:
        if c["policy"]["policy"] != "fixed":
            c["policy"].update(earliest_exit=2, late_exit=True)
    res = check(write(tmp_path / "run", run), base)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "no regression" in res.stdout and "missing" not in res.stdout


def test_worse_quality_fails_and_names_the_cell(tmp_path, base):
    run = copy.deepcopy(ACC + PPL)
    run[2]["quality"]["value"] = 0.85  # kl τ=1e-3 on t: 0.90 → 0.85
    res = check(write(tmp_path / "run", run), base)
    assert res.exit_code == 1
    assert "t kl τ=0.001" in res.stdout and "quality" in res.stdout


def test_a_frontier_point_within_the_quality_tolerance_still_counts(tmp_path, base):
    """kl τ=1e-3 is kl's cheapest point at full quality (ε = 0). One item flipping on another machine moves it
    0.5% below: within --quality-tol 0.01 it still holds that frontier point; within 0.001 it does not."""
    run = copy.deepcopy(ACC + PPL)
    run[2]["quality"]["value"] = 0.8955
    d = write(tmp_path / "run", run)
    res = check(d, base)
    assert res.exit_code == 0, res.stdout
    res = check(d, base, "--quality-tol", "0.001")
    assert res.exit_code == 1 and "frontier: no longer within ε" in res.stdout and "t kl at ε=0%" in res.stdout


def test_lower_is_better_direction(tmp_path, base):
    run = copy.deepcopy(ACC + PPL)
    run[8]["quality"]["value"] = 0.99  # full-depth perplexity improved: not a regression
    assert check(write(tmp_path / "better", run), base).exit_code == 0
    run[8]["quality"]["value"] = 1.2   # full-depth perplexity worse
    assert check(write(tmp_path / "worse", run), base).exit_code == 1


def test_more_iterations_fail_and_missing_cells_fail(tmp_path, base):
    run = copy.deepcopy(ACC + PPL)
    run[4]["iterations"]["mean"] = 7.0 * 1.2
    res = check(write(tmp_path / "iters", run), base)
    assert res.exit_code == 1 and "mean iterations" in res.stdout and "second_order τ=0.1" in res.stdout
    res = check(write(tmp_path / "missing", copy.deepcopy(ACC[:-1] + PPL)), base)
    assert res.exit_code == 1 and "missing cell" in res.stdout and "oracle" in res.stdout


def test_wall_clock_noise_never_fails_unless_asked(tmp_path, base):
    run = copy.deepcopy(ACC + PPL)
    for c in run:
        c["wall_clock"]["per_token_s"] *= 3.0  # a slower machine: absolute times are never compared
    run[2]["wall_clock"]["per_token_s"] *= 2.0  # and one cell much slower relative to full depth
    d = write(tmp_path / "run", run)
    assert check(d, base).exit_code == 0
    assert check(d, base, "--wall-clock", "--wall-tol", "5").exit_code == 0
    res = check(d, base, "--wall-clock")
    assert res.exit_code == 1 and "time / full-depth time" in res.stdout and "kl τ=0.001" in res.stdout
    assert "busy machine" not in res.stderr
    run[2].setdefault("run", {})["load"] = {"start": 9.0, "end": 9.5, "cpus": 2}  # timed beside other work
    d = write(tmp_path / "busy", run)
    res = check(d, base, "--wall-clock")
    assert res.exit_code == 1 and "busy machine" in res.stderr and "kl τ=0.001" in res.stderr


def test_unusable_input_exits_2(tmp_path, base):
    res = check(tmp_path / "nothing-here", base)
    assert res.exit_code == 2 and "not a directory" in res.stderr
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.json").write_text(json.dumps({"schema": "other"}))
    assert check(tmp_path / "junk", base).exit_code == 2
    assert check(base, base, "--quality-tol", "-1").exit_code == 2


def _damage_one_baseline_cell(base, how):
    victim = sorted(base.glob("*.json"))[1]
    raw = victim.read_bytes()
    if how == "truncated":
        victim.write_bytes(raw[:300])
    elif how == "not JSON":
        victim.write_bytes(b"{not json" + raw)
    else:
        cell = json.loads(raw)
        if how == "schema version 2.0":
            cell["schema_version"] = 2.0
        elif how == "schema version 3":
            cell["schema_version"] = 3
        else:  # "null quality"
            cell["quality"]["value"] = None
        victim.write_text(json.dumps(cell))
    return victim


@pytest.mark.parametrize("how", ["truncated", "not JSON", "schema version 2.0", "schema version 3", "null quality"])
@pytest.mark.parametrize("side", ["baseline", "run"])
def test_the_gate_never_skips_a_cell_it_cannot_read(tmp_path, base, how, side):
    """A damaged cell on either side is exit 2 naming its file, never a pass over the cells that are left
    (the run side's null quality is a regression: exit 1, naming the cell)."""
    from helpers.cli import assert_one_line_error

    run = write(tmp_path / "run", copy.deepcopy(ACC + PPL))
    victim = _damage_one_baseline_cell(base if side == "baseline" else run, how)
    res = check(run, base)
    if side == "run" and how == "null quality":
        assert res.exit_code == 1, res.stdout + res.stderr
        return
    assert_one_line_error(res, [victim.name])


@pytest.mark.slow  # 7 s: three real sweeps; the gate's verdicts on hand-made cells above stay fast
def test_a_degraded_policy_fails_the_gate(tmp_path, monkeypatch):
    """A real sweep, then the same sweep with KL's signal scaled down (it exits too early): exit 1."""
    tasks = resolve_tasks(["chains_lambada"])
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["kl"], thresholds=[1e-4], baselines=[16], limit=16)
    run_cells(ck, tasks, cfg, tmp_path / "base", "cpu")
    run_cells(ck, tasks, cfg, tmp_path / "same", "cpu")
    assert check(tmp_path / "same", tmp_path / "base").exit_code == 0
    original = KL.signal
    monkeypatch.setattr(KL, "signal", lambda self, s, memory, logp: original(self, s, memory, logp) * 1e-3)
    run_cells(ck, tasks, cfg, tmp_path / "degraded", "cpu")
    res = check(tmp_path / "degraded", tmp_path / "base")
    assert res.exit_code == 1 and "chains_lambada kl τ=0.0001" in res.stdout


def test_wall_clock_compares_paired_repeats_where_both_sides_have_them(tmp_path, base):
    """A cell's ratio over the full-depth cell moves with whatever the machine did between the two; its paired
    repeats (timing/retime.py) time both within seconds. Where run and baseline have them, they decide."""
    def with_repeats(cell_list, ratio):
        for c in cell_list:
            c["wall_clock"]["repeats"] = {"repeats": 3, "full_depth": 16, "ratio": ratio if c is cell_list[2] else
                                          c["wall_clock"]["per_token_s"] / 1e-3, "spread": 0.1}
        return cell_list

    run = copy.deepcopy(ACC + PPL)
    run[2]["wall_clock"]["per_token_s"] *= 4.0  # the evaluation alone: kl τ=1e-3 looks 4× slower
    d = write(tmp_path / "run", with_repeats(run, 0.8))  # but paired with full depth it is as fast as before
    b = write(tmp_path / "paired-base", with_repeats(copy.deepcopy(ACC + PPL), 0.8))
    assert check(d, b, "--wall-clock").exit_code == 0
    assert check(d, base, "--wall-clock").exit_code == 1  # the baseline was timed once: evaluations divided
    d = write(tmp_path / "slower", with_repeats(copy.deepcopy(ACC + PPL), 1.6))
    res = check(d, b, "--wall-clock")
    assert res.exit_code == 1 and "time / full-depth time" in res.stdout and "kl τ=0.001" in res.stdout


# ---- what a verdict rests on: the cells it compared -------------------------------------------------------------

def test_check_of_a_partial_sweep_says_what_it_compared(tmp_path, capfd):
    baseline = REPO / "results" / "baseline"
    part = tmp_path / "part"
    part.mkdir()
    kept = [p for p in baseline.glob("chains__*.json") if "__fixed-" in p.name or "__kl-" in p.name]
    for p in kept:
        shutil.copy(p, part / p.name)
    code, _, out = invoke(["check", str(part), "--baseline", str(baseline)], capfd)
    assert code == 1 and "missing" in out and "--present-only" in out
    code, _, out = invoke(["check", str(part), "--baseline", str(baseline), "--present-only"], capfd)
    assert code == 0, out
    assert f"compared {len(kept)} of the baseline's" in out and f"{len(kept)} within the tolerances" in out


def test_check_that_compares_nothing_is_exit_2_and_says_why(tmp_path, capfd):
    def other_limit(cell):
        cell["task"]["limit"] = 20
    run = copy_cells(tmp_path / "run", baseline_cells(), other_limit)
    base = copy_cells(tmp_path / "base", baseline_cells())
    for extra in ([], ["--present-only"]):
        line = one_line(["check", str(run), "--baseline", str(base), *extra], capfd, ["nothing to check", "limit"])
        assert "20" in line and "48" in line

    def every_document(cell):
        cell["task"]["limit"] = None
    run = copy_cells(tmp_path / "all", baseline_cells(), every_document)
    line = one_line(["check", str(run), "--baseline", str(base)], capfd, ["nothing to check", "limit"])
    assert "limit (run: all documents; baseline: 48)" in line and "None" not in line


def test_check_matches_the_learned_rule_by_its_exit_models_content(tmp_path):
    def learned_at(path):
        def change(cell):
            cell["policy"].update(policy="learned", exit_model=path, exit_model_sha256="ab" * 32)
            cell["key"]["exit"].update(policy="learned", exit_model="sha256:" + "ab" * 32)
        return change
    kl = [p for p in baseline_cells() if "__kl-" in p.name][:1]
    run = copy_cells(tmp_path / "run", baseline_cells(series=("fixed",)) + kl, None)
    base = copy_cells(tmp_path / "base", baseline_cells(series=("fixed",)), None)
    copy_cells(run, kl, learned_at("/home/a/exit.json"), renamed=True)
    copy_cells(base, kl, learned_at("/home/b/copy-of-exit.json"), renamed=True)
    res = runner.invoke(app, ["check", str(run), "--baseline", str(base)])
    assert res.exit_code == 0, explain(res)


def test_a_crash_in_check_is_not_read_as_a_regression(tmp_path, monkeypatch):
    """Python exits 1 on an uncaught exception, which is check's "regressed": a crash must be told apart."""
    import exitbench.analysis.check as check

    def bug(*a, **k):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(check, "compare", bug)
    res = runner.invoke(app, ["check", str(BASELINE), "--baseline", str(BASELINE)])
    assert res.exit_code == 3 and "crashed" in res.stderr, explain(res)
