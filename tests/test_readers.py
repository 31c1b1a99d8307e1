"""Every reader of result cells (pareto, check, report, export) on one real sweep, the session's shared one: the
hand-made cells of the other reader tests have known answers; these are what a sweep really writes."""
from __future__ import annotations

import csv
import io
import json

from exitbench.cli import app

from helpers.cells import load_cells
from helpers.cli import explain, runner
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
