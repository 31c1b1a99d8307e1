"""`exitbench export`: every result cell as one row of plain columns (issue 30: a tidy export for scripts)."""
from __future__ import annotations

import csv
import io
import json

from exitbench.analysis.export import COLUMNS
from exitbench.cli import app

from helpers.cli import assert_one_line_error, explain, runner
from helpers.paths import REPO

BASELINE = REPO / "results" / "baseline"


def test_one_row_per_cell_with_plain_columns(tmp_path):
    res = runner.invoke(app, ["export", str(BASELINE)])
    assert res.exit_code == 0, explain(res)
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    files = sorted(p.name for p in BASELINE.glob("*.json"))
    assert len(rows) == len(files) == 267 and list(rows[0]) == COLUMNS
    assert sorted(r["file"].rpartition("/")[2] for r in rows) == files
    assert {r["task"] for r in rows} == {"chains", "chains_mc", "chains_lambada"}
    assert all(" · " not in r["task"] and r["metric"] in ("exact_match,none", "acc,none", "perplexity,none")
               for r in rows)
    # each row's numbers are its cell's
    row = next(r for r in rows if r["policy"] == "fixed" and r["threshold"] == "16" and r["task"] == "chains")
    cell = json.loads((BASELINE / row["file"].rpartition("/")[2]).read_text())
    assert float(row["quality"]) == cell["quality"]["value"] and float(row["mean_iterations"]) == 16
    # cells written before the cost counters existed read as having none
    assert "attention_token_steps" not in cell["iterations"]
    assert row["attention_token_steps"] == row["mlp_token_steps"] == ""
    out = tmp_path / "sub" / "cells.json"
    res = runner.invoke(app, ["export", str(BASELINE), "--format", "json", "-o", str(out)])
    assert res.exit_code == 0, explain(res)
    assert [r["cell_id"] for r in json.loads(out.read_text())] == [r["cell_id"] for r in rows]


def test_no_cells_and_a_bad_format_are_one_line(tmp_path):
    (tmp_path / "calibration.json").write_text("{}")
    assert_one_line_error(runner.invoke(app, ["export", str(tmp_path)]), ["no result cells"])
    assert_one_line_error(runner.invoke(app, ["export", str(BASELINE), "--format", "xlsx"]), ["csv or json"])
