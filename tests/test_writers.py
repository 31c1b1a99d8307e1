"""Every file a command writes besides the cells (reports, traces, exports, plots, calibrations, exit models,
geometry) goes through two checks: `store.disk.writable_output` before any compute (never onto a result cell or
its samples, while a command's own earlier report is replaced) and `runtime.files.atomic_write` (whole or not at
all, its folder made, a full disk one line)."""
from __future__ import annotations

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.store import disk as results

from helpers.cells import baseline_cells, copy_cells
from helpers.cli import assert_one_line_error, explain
from helpers.paths import A_CELL

runner = CliRunner()


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    """A few rules' chains_lambada cells of the committed baseline: a frontier, full depth and the oracle for
    every reader, drawn quickly (the whole baseline's report takes seconds, and these tests are about writing)."""
    return copy_cells(tmp_path_factory.mktemp("cells"),
                      baseline_cells("chains_lambada", ("fixed", "kl", "second_order", "margin", "oracle")))


# Every command that writes a file a user names (pareto's --plot takes only .png or .svg: no cell or samples file
# can be one). The file PATH is put where {path} is; geometry writes DIR/geometry.json, put as {dir}.
WRITERS = {
    "calibrate --out": ["calibrate", "--programs", "4", "--thresholds", "0.1", "--out", "{path}"],
    "fit-exit --out": ["fit-exit", "--limit", "4", "--out", "{path}"],
    "trace --json": ["trace", "a=1 b=a", "--json", "{path}"],
    "export -o": ["export", "{cells}", "-o", "{path}"],
    "report --out": ["report", "{cells}", "--out", "{path}"],
    "geometry -o": ["geometry", "--programs", "4", "-o", "{dir}"],
}


@pytest.mark.parametrize("target", ["cell", "samples"])
@pytest.mark.parametrize("command", list(WRITERS))
def test_no_writer_replaces_a_cell_or_its_samples(command, target, tmp_path, capfd, monkeypatch, cells):
    """One check that every writer calls (store.disk.writable_output), before anything is computed or read."""
    import exitbench.harness.documents as documents
    import exitbench.models.checkpoint as checkpoint

    def no_compute(*a, **k):
        raise AssertionError(f"{command} computed before refusing its output")

    monkeypatch.setattr(documents, "token_lists", no_compute)
    monkeypatch.setattr(checkpoint, "open_checkpoint", no_compute)
    if command == "geometry -o":
        if target == "samples":
            pytest.skip("geometry names its own files: none is a samples file")
        victim = tmp_path / "geometry.json"
    else:
        victim = tmp_path / (A_CELL.name if target == "cell" else A_CELL.name.replace(".json", results.SAMPLES_SUFFIX))
    victim.write_bytes(A_CELL.read_bytes() if target == "cell" else b'{"doc_id": 0}\n')
    before = victim.read_bytes()
    args = [a.format(path=victim, dir=tmp_path, cells=cells) for a in WRITERS[command]]
    capfd.readouterr()
    res = runner.invoke(app, args)
    words = ["result cell"] if target == "cell" else ["samples file"]
    assert_one_line_error(res, [str(victim), *words], fd=capfd.readouterr())
    assert victim.read_bytes() == before


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



# Every writer on a full disk: the write fails as the disk fails it (at the flush to disk), and the command says so
# in one line, leaving neither the file nor its temporary behind. {path} / {dir}: where it writes.
FULL_DISK = {
    "run": ["run", "--tasks", "chains_lambada", "--policy", "second_order", "--thresholds", "0.1", "--baselines",
            "16", "--limit", "4", "--quiet", "--out", "{dir}"],
    "report --out": ["report", "{cells}", "--out", "{path}.html"],
    "trace --json": ["trace", "a=1 b=a", "--json", "{path}.json"],
    "export -o": ["export", "{cells}", "-o", "{path}.csv"],
    "calibrate --out": ["calibrate", "--programs", "8", "--thresholds", "0.1", "--out", "{path}.json"],
    "pareto --plot": ["pareto", "{cells}", "--plot", "{path}.png"],
    "fit-exit --out": ["fit-exit", "--limit", "4", "--out", "{path}.json"],
    "geometry -o": ["geometry", "--programs", "4", "--steps", "4", "-o", "{dir}"],
}


@pytest.mark.parametrize("command", list(FULL_DISK))
def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(command, tmp_path, capfd, monkeypatch, cells):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    target = tmp_path / "out"
    args = [a.format(path=target / "file", dir=target, cells=cells) for a in FULL_DISK[command]]
    capfd.readouterr()
    res = runner.invoke(app, args)
    fd = capfd.readouterr()
    # What was computed may have been printed (trace's table, calibrate's); the error ends the command, alone.
    errors = [line for line in (res.stderr + fd.err).splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and "Traceback" not in res.stdout + res.stderr + fd.out + fd.err, explain(res)
    assert len(errors) == 1 and "cannot write" in errors[0] and "No space left on device" in errors[0], errors
    assert res.stderr.rstrip().endswith(errors[0]), res.stderr
    left = [p.name for p in target.rglob("*") if p.is_file()] if target.exists() else []
    assert left == [], left  # no result, no report, no temporary


@pytest.mark.parametrize("command", ["report --out", "trace --json"])
def test_a_writer_makes_the_folder_it_was_given(command, tmp_path, cells):
    target = tmp_path / "not" / "there" / "yet" / "file"
    args = [a.format(path=target, cells=cells) for a in FULL_DISK[command]]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, explain(res)
    assert len(list(target.parent.iterdir())) == 1
