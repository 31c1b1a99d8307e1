"""Every reader of result cells (pareto, check, report, export, and a run's summary of the cells it reuses).

- On one real sweep, the session's shared one: the hand-made cells of the other reader tests have known answers;
  these are what a sweep really writes.
- At the door: every file a reader takes (cells, samples files) is checked before use. Whatever its fields hold, the
  command ends normally or with one line and exit code 2, never a traceback, and writes nothing; JSON that is not a
  cell is skipped; cells of different models never meet in one check, frontier or report unless one model is picked.
"""
from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exitbench.cli import app
from exitbench.store import cells

from helpers.cells import baseline_cells, copy_cells, load_cells
from helpers.cli import assert_one_line_error, explain, invoke, one_line, runner
from helpers.paths import BASELINE, REPO
from helpers.sweeps import N_CELLS


def test_pareto_reads_every_cell_and_draws_the_frontier(shared_sweep, tmp_path):
    res = runner.invoke(app, ["pareto", str(shared_sweep.out), "--plot", str(tmp_path / "pareto.png")])
    assert res.exit_code == 0, explain(res)
    for task in ("chains", "chains_lambada"):
        assert task in res.stdout
    assert "second_order" in res.stdout and (tmp_path / "pareto.png").read_bytes().startswith(b"\x89PNG")


def test_check_of_a_sweep_against_itself_compares_every_cell(shared_sweep):
    res = runner.invoke(app, ["check", str(shared_sweep.out), "--baseline", str(shared_sweep.out)])
    assert res.exit_code == 0, explain(res)
    assert f"compared {N_CELLS} of the baseline's {N_CELLS} cells" in " ".join(res.stdout.split())


def test_export_has_a_row_per_cell_with_the_cells_numbers(shared_sweep):
    res = runner.invoke(app, ["export", str(shared_sweep.out)])
    assert res.exit_code == 0, explain(res)
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    cells = {c["cell_id"]: c for c in load_cells(shared_sweep.out).values()}
    assert len(rows) == N_CELLS and {r["cell_id"] for r in rows} == set(cells)
    for row in rows:
        cell = cells[row["cell_id"]]
        assert float(row["quality"]) == cell["quality"]["value"]
        assert float(row["mean_iterations"]) == cell["iterations"]["mean"]
    res = runner.invoke(app, ["export", str(shared_sweep.out), "--format", "json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == N_CELLS


def test_report_of_a_real_sweep(shared_sweep, tmp_path):
    out = shared_sweep.copy(tmp_path / "sweep")  # the report is written into the sweep's directory
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, explain(res)
    page = (out / "report.html").read_text()
    for section in ("frontiers", "matched", "histograms", "provenance"):
        assert f'id="{section}"' in page
    assert "chains_lambada" in page and "second_order" in page


# ---- what is not a cell ------------------------------------------------------------------------------------------

def test_pareto_skips_reports_that_are_not_cells_and_makes_the_plot_folder(tmp_path, capfd):
    baseline = REPO / "results" / "baseline"
    root = tmp_path / "results"
    shutil.copytree(baseline, root / "baseline")
    (root / "calibrate").mkdir()
    (root / "calibrate" / "tiny-raven-kl.json").write_text(json.dumps({"schema": "exitbench.calibration"}))
    plot = tmp_path / "new" / "folder" / "p.png"
    code, lines, out = invoke(["pareto", str(root), "--plot", str(plot)], capfd)
    assert code == 0, lines
    assert plot.stat().st_size > 0
    assert any("skipped 1 JSON file" in line for line in lines)
    code, _, out = invoke(["pareto", str(root), "--format", "csv", "--table", "matched"], capfd)
    header, *rows = out.strip().splitlines()
    assert header.startswith("group,tolerance,max_tolerance,policy") and rows and "\n\n" not in out.strip()


# ---- cells of different models -----------------------------------------------------------------------------------

def another_model(cell: dict) -> None:
    """The same cell as if another checkpoint had made it (its own fingerprint, key and id)."""
    cell["model"]["fingerprint"] = "feedfacefeedface"
    cell["model"]["source"] = "/ckpt/other-model"
    cell["model"]["path"] = "/ckpt/other-model"
    cell["key"]["model"] = "feedfacefeedface"
    cell["cell_id"] = cells.cell_id(cell["key"])


def test_a_directory_of_two_models_is_refused_unless_one_is_picked(tmp_path, capfd):
    mixed = copy_cells(tmp_path / "mixed", baseline_cells())
    copy_cells(mixed, baseline_cells(), another_model, renamed=True)
    assert len(list(mixed.glob("*.json"))) == 2 * len(baseline_cells())
    for args in (["pareto", str(mixed)], ["check", str(mixed), "--baseline", str(BASELINE)],
                 ["report", str(mixed), "--out", str(tmp_path / "r.html")]):
        one_line(args, capfd, ["2 models", "feedfacefeedface", "--model"])
    assert not (tmp_path / "r.html").exists()
    res = runner.invoke(app, ["pareto", str(mixed), "--model", "feedface", "--format", "json"])
    assert res.exit_code == 0, explain(res)
    res = runner.invoke(app, ["check", str(mixed), "--model", "tiny-raven", "--baseline", str(BASELINE),
                              "--present-only"])
    assert res.exit_code == 0, explain(res)
    one_line(["pareto", str(mixed), "--model", "nope"], capfd, ["--model", "'nope'"])


def test_cells_of_two_backends_are_never_paired(tmp_path):
    """hf's and vLLM's clocks are two clocks (docs/serving.md): pareto once divided hf's full depth by vLLM's cells
    with only the generic note; each backend is now a setup of its own, with its own full depth (issue 72)."""
    from exitbench.store import cells as cellmod

    def served_by_vllm(cell):
        cell["key"]["backend"] = "vllm"
        cell["cell_id"] = cellmod.cell_id(cell["key"])
    d = copy_cells(tmp_path / "c", baseline_cells())
    copy_cells(d, baseline_cells(), served_by_vllm, renamed=True)
    res = runner.invoke(app, ["pareto", str(d), "--format", "json"])
    assert res.exit_code == 0, explain(res)
    assert sorted(json.loads(res.stdout)) == ["chains_mc · acc,none · backend hf",
                                              "chains_mc · acc,none · backend vllm"]
    assert "different setups (backend)" in " ".join(res.stderr.split())


def test_pareto_names_the_model(tmp_path):
    res = runner.invoke(app, ["pareto", str(copy_cells(tmp_path / "c", baseline_cells())), "--format", "json"])
    assert res.exit_code == 0 and "model: embedded:tiny-raven" in res.stderr
    json.loads(res.stdout)  # the model's name goes to stderr: stdout stays the table a script reads


# ---- every reader at its door: mutated cells and samples files ---------------------------------------------------
# A value of each kind a JSON field can hold, none of them of a cell's own types everywhere.
WRONG_VALUES = st.sampled_from(["0.9", "", None, True, [], [1, 2], {}, {"a": 1}, -1, 1e308, "kl"])
# Fields readers use (section, field): each mutation replaces one of them.
FIELDS = [("quality", "value"), ("quality", "metric"), ("quality", "higher_is_better"), ("policy", "policy"),
          ("policy", "threshold"), ("policy", "relative"), ("policy", "max_steps"), ("task", "name"),
          ("task", "limit"), ("task", "metrics"), ("task", "primary_metric"), ("iterations", "mean"),
          ("iterations", "tokens"), ("iterations", "histogram"), ("wall_clock", "per_token_s"),
          ("flops", "per_token"), ("model", "fingerprint"), ("run", "started"), ("", "cell_id"), ("", "model"),
          ("", "mode"), ("numerics", "nonfinite_tokens")]
READERS = {
    "pareto": lambda d, t: ["pareto", str(d)],
    "check": lambda d, t: ["check", str(d), "--baseline", str(BASELINE), "--present-only"],
    "report": lambda d, t: ["report", str(d), "--out", str(t / "report.html")],
}


def assert_clean_end(res, fd, written: Path | None = None, verdicts=(0,)):
    """Ended with one of `verdicts` (check's 1 is "regressed", a verdict), or with exactly one `error:` line and
    exit 2; never a traceback."""
    text = res.stdout + res.stderr + fd.out + fd.err
    assert "Traceback" not in text, explain(res)
    if res.exit_code not in verdicts:
        assert_one_line_error(res, fd=fd)
        if written is not None:
            assert not written.exists()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=WRONG_VALUES, reader=st.sampled_from(sorted(READERS)))
def test_a_mutated_cell_never_crashes_a_reader(tmp_path_factory, capfd, field, value, reader):
    tmp = tmp_path_factory.mktemp("mutated")

    def mutate(cell):
        section, name = field
        (cell if not section else cell[section])[name] = value
    d = copy_cells(tmp / "cells", baseline_cells()[:1])
    copy_cells(d, baseline_cells()[1:])
    copy_cells(d, baseline_cells()[:1], mutate)
    capfd.readouterr()
    res = runner.invoke(app, READERS[reader](d, tmp))
    assert_clean_end(res, capfd.readouterr(), tmp / "report.html", (0, 1) if reader == "check" else (0,))


def test_a_cell_of_the_wrong_type_is_named(tmp_path, capfd):
    def quality_text(cell):
        cell["quality"]["value"] = "0.9"
    d = copy_cells(tmp_path / "c", baseline_cells(), quality_text)
    one_line(["pareto", str(d)], capfd, ["broken cell", "quality.value", "'0.9'"])


def test_a_reusing_run_names_a_broken_cell(tmp_path, capfd):
    """The run summary reads reused cells too: a cell of the wrong type there is one line before compute."""
    def policy_number(cell):
        cell["policy"]["policy"] = 7
    d = copy_cells(tmp_path / "c", baseline_cells(series=("fixed",)), policy_number)
    one_line(["run", "--tasks", "chains_mc", "--policy", "kl", "--baselines", "16", "--limit", "4", "--quiet",
              "--out", str(d)], capfd, ["broken cell", "policy.policy"])



def _rules(value):
    def change(cell):
        cell["policy"]["rules"] = value
    return change


def _exit_mode(cell):
    cell["policy"]["exit_mode"] = "frozen"


def _late(cell):
    cell["policy"]["late_exit"] = "yes"


# A conjunction's rules are read by every label (its series name): a malformed list is refused with the rest of the
# schema, at the door, by every reader alike.
MALFORMED_POLICY = {
    "rules a string": (_rules("margin"), "policy.rules"),
    "a rule without policy": (_rules([{"threshold": 0.125}, {"policy": "argmax_stability"}]), "policy.rules.0.policy"),
    "a rule's threshold a string": (_rules([{"policy": "margin", "threshold": "0.125"}, {"policy": "kl"}]),
                                    "policy.rules.0.threshold"),
    "one rule": (_rules([{"policy": "margin"}]), "policy.rules"),
    "an unknown exit mode": (_exit_mode, "policy.exit_mode"),
    "a late mark not a boolean": (_late, "policy.late_exit"),
}
WHOLE_READERS = {**READERS, "export": lambda d, t: ["export", str(d)],
                 "check as the baseline": lambda d, t: ["check", str(BASELINE), "--baseline", str(d), "--present-only"]}


@pytest.mark.parametrize("reader", sorted(WHOLE_READERS))
@pytest.mark.parametrize("case", list(MALFORMED_POLICY))
def test_a_malformed_policy_section_is_one_line_in_every_reader(tmp_path, capfd, case, reader):
    change, named = MALFORMED_POLICY[case]
    d = copy_cells(tmp_path / "c", baseline_cells("chains_mc", ("fixed", "kl")))
    copy_cells(d, baseline_cells("chains_mc", ("margin_0.125_argmax_stability",))[:1], change)
    one_line(WHOLE_READERS[reader](d, tmp_path), capfd, ["broken cell", named])


def test_the_schema_knows_the_engines_exit_modes():
    from typing import get_args

    from exitbench.engine.config import EXIT_MODES
    from exitbench.store.schema import ExitMode

    assert set(get_args(ExitMode)) == set(EXIT_MODES)


def test_the_schema_knows_the_backends_and_refuses_another(tmp_path, capfd):
    """A key naming a backend no exitbench has ("bogus", 5) was read silently, as hf (issue 72)."""
    from typing import get_args

    from exitbench.store.schema import Backend
    from exitbench.sweep.backends import BACKENDS

    assert set(get_args(Backend)) == set(BACKENDS)
    for value in ("bogus", 5):
        d = copy_cells(tmp_path / str(value), baseline_cells())
        copy_cells(d, baseline_cells()[:1], lambda cell: cell["key"].update(backend=value))
        one_line(["pareto", str(d)], capfd, ["broken cell", "key.backend", repr(value)])


def sampled_sweep(tmp: Path) -> Path:
    """A small sweep with samples files: two policies on one task."""
    out = tmp / "sampled"
    res = runner.invoke(app, ["run", "--tasks", "chains_lambada", "--policy", "kl", "--thresholds", "1e-3",
                              "--baselines", "16", "--limit", "3", "--log-samples", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, explain(res)
    return out


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> Path:
    return sampled_sweep(tmp_path_factory.mktemp("sweep"))


SAMPLE_DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "binary": lambda b: bytes(range(256)) * 4,
    "a list per line": lambda b: b"[1, 2, 3]\n",
    "exit steps as text": lambda b: b.replace(b'"exit_steps": [', b'"exit_steps": "x", "was": ['),
    "no doc id": lambda b: b.replace(b'"doc_id"', b'"doc"'),
}


@pytest.mark.parametrize("damage", list(SAMPLE_DAMAGE))
def test_a_damaged_samples_file_is_one_line_in_report(sampled, tmp_path, capfd, damage):
    d = tmp_path / "copy"
    shutil.copytree(sampled, d)
    victim = next(p for p in sorted(d.glob("*.samples.jsonl")) if "__kl-" in p.name)
    victim.write_bytes(SAMPLE_DAMAGE[damage](victim.read_bytes()))
    one_line(["report", str(d), "--out", str(tmp_path / "r.html")], capfd, ["samples file", victim.name])
    assert not (tmp_path / "r.html").exists()


# ---- a cell's timing and schedule checked against the cell itself (issue 72) ---------------------------------------
def _timed(cell):
    """A committed cell (no schedule, no repeats) given what a sweep since writes: its tokens' schedule, with
    the cell's own mean, and paired repeats on the throughput clock."""
    its = cell["iterations"]
    its["tokens"], its["mean"], its["per_group_mean"], its["schedule"] = 4, 2.5, [2.5], "2,3;4,1"
    cell["wall_clock"]["repeats"] = {"repeats": 3, "ratio": 1.2, "spread": 0.1, "full_depth": 16,
                                     "ratios": [1.1, 1.2, 1.3], "clock": "throughput"}


BAD_TIMING = {  # what a hand edit left, the field the one line names
    "schedule-letters": ({"iterations.schedule": "a,b;3"}, "iterations.schedule"),
    "schedule-fraction": ({"iterations.schedule": "1.5;2"}, "iterations.schedule"),
    "schedule-negative": ({"iterations.schedule": "-5,3;2"}, "iterations.schedule"),
    "schedule-deeper-than-the-cell": ({"iterations.schedule": "40", "iterations.mean": 40.0}, "deeper than"),
    "schedule-not-the-cells-mean": ({"iterations.schedule": "2,3;4,5"}, "average 3.5"),
    "a-ratio-of-zero": ({"wall_clock.repeats.ratios": [1.1, 0, 1.3]}, "wall_clock.repeats.ratios"),
    "a-negative-ratio": ({"wall_clock.repeats.ratio": -1.2}, "wall_clock.repeats.ratio"),
    "a-negative-corrected-ratio": ({"wall_clock.repeats.corrected_ratio": -2.0}, "corrected_ratio"),
    "a-nan-ratio": ({"wall_clock.repeats.ratio": float("nan")}, "wall_clock.repeats.ratio"),
    "max-steps-zero": ({"policy.max_steps": 0}, "policy.max_steps"),
    # (Hypothesis found this one: the report's histogram read its keys as iteration counts)
    "histogram-key-not-a-count": ({"iterations.histogram": {"a": 1}}, "iterations.histogram"),
}
TIMING_READERS = {"pareto": lambda d, t: ["pareto", str(d)], "export": lambda d, t: ["export", str(d)],
                  "serve-sim": lambda d, t: ["serve-sim", str(d)],
                  "report": lambda d, t: ["report", str(d), "--out", str(t / "report.html")]}


def _scheduled(cell):
    """A committed cell with a schedule of its own (one token at 1 iteration, one at its max_steps), its mean
    made to match: cells serve-sim projects beside the one a test breaks."""
    depth = cell["policy"]["max_steps"]
    cell["iterations"].update(schedule=f"1;{depth}", mean=(1 + depth) / 2, tokens=2)


def _edit(cell, edits):
    _timed(cell)
    for dotted, value in edits.items():
        *parents, name = dotted.split(".")
        part = cell
        for p in parents:
            part = part[p]
        part[name] = value


@pytest.mark.parametrize("reader", sorted(TIMING_READERS))
@pytest.mark.parametrize("case", sorted(BAD_TIMING))
def test_a_cells_timing_and_schedule_are_checked_against_the_cell(case, reader, tmp_path, capfd):
    """Values the schema's types accept but the cell contradicts crashed readers (a schedule of "a,b;3"), or read
    as results (a negative ratio as a negative speed-up, a token deeper than the cell can run projected as 10×):
    every reader now refuses such a cell in one line naming the field."""
    edits, named = BAD_TIMING[case]
    d = copy_cells(tmp_path / "c", baseline_cells())
    copy_cells(d, baseline_cells()[:1], lambda cell: _edit(cell, edits))
    one_line(TIMING_READERS[reader](d, tmp_path), capfd, ["broken cell", named])
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("edits", [{"iterations.schedule": ";", "iterations.mean": None},
                                   {"policy.max_steps": None}], ids=["no-tokens", "no-max-steps"])
def test_serve_sim_skips_a_cell_it_cannot_project_and_says_why(edits, tmp_path, capfd):
    """A schedule of requests with no tokens (";" divided by zero) is skipped with a note; a cell with no
    max_steps (read for every cell, old ones included, before any was skipped) is projected at its task's full
    depth, which the other cells give."""
    d = copy_cells(tmp_path / "c", baseline_cells(), _scheduled)
    copy_cells(d, baseline_cells()[:1], lambda cell: _edit(cell, edits))
    capfd.readouterr()
    res = runner.invoke(app, ["serve-sim", str(d)])
    assert res.exit_code == 0, explain(res)
    said = res.stderr + capfd.readouterr().err
    if "iterations.schedule" in edits:
        assert "no tokens scored; nothing to project" in said, said
    else:
        assert "chains_mc" in res.stdout and "skipped" not in said, said


def test_serve_sim_reads_a_broken_samples_file_as_a_skip(tmp_path, capfd):
    """A cell without a recorded schedule falls back to its samples file: a line cut short, not JSON, or exit
    steps that are not numbers skip the cell with the line named, instead of a traceback."""
    from exitbench.store.disk import samples_path

    d = copy_cells(tmp_path / "c", baseline_cells(), _scheduled)
    first = sorted(d.glob("*.json"))[0]
    cell = json.loads(first.read_text())
    cell["samples"], cell["iterations"]["schedule"] = True, None
    first.write_text(json.dumps(cell))
    for text in ('{"doc_id": 0, "exitbench": {"exit_steps": [[3], [4]]}}\n{"doc_id": 1, "exitb',
                 "not json\n", '{"doc_id": 0, "exitbench": {"exit_steps": [["abc"]]}}\n'):
        samples_path(first).write_text(text)
        capfd.readouterr()
        res = runner.invoke(app, ["serve-sim", str(d)])
        assert res.exit_code == 0 and "Traceback" not in res.output, explain(res)
        assert "samples file's line" in res.stderr + capfd.readouterr().err


def test_serve_sim_says_each_reason_to_skip_once(tmp_path, capfd):
    """A folder of cells written before schedules printed a "skipped" line per cell (89 before its error): one
    line per reason now, counting the cells and naming a few."""
    d = copy_cells(tmp_path / "c", baseline_cells())
    res = runner.invoke(app, ["serve-sim", str(d)])
    lines = [line for line in res.stderr.splitlines() if line.startswith("skipped")]
    assert lines == [f"skipped {len(baseline_cells())} cells (chains_mc fixed τ=16, chains_mc fixed τ=1, chains_mc "
                     "fixed τ=2, …): no per-token exits recorded (written before schedules were recorded); rerun it "
                     "into a new --out to project it"], res.stderr
