"""`exitbench report`: one self-contained HTML page per sweep, from hand-made cells with known answers (the page
in a real browser, and over a real sweep's samples, is tests/test_report_browser.py, marked slow)."""
from __future__ import annotations

import base64
import json
import re

import pytest

from exitbench.analysis import report

from helpers.cells import ACC, PPL, paired, write_cells, write_samples
from helpers.cli import assert_one_line_error, explain, runner
from exitbench.cli import app


def _cell(policy: str, tau: float):
    return next(c for c in ACC if c["policy"]["policy"] == policy and c["policy"]["threshold"] == tau)


def test_page_is_self_contained(tmp_path):
    write_cells(tmp_path / "sweep", ACC + PPL)
    page = report.build(tmp_path / "sweep")
    # No network at view time: every image inline, no src or href leaving the page but in-page anchors.
    assert not re.findall(r'(?:src|href)="(?!data:|#)', page)
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3 + 2  # a frontier plot per cost axis, a histogram figure per task
    assert all(base64.b64decode(b).startswith(b"\x89PNG\r\n\x1a\n") for b in images)
    for section in ("frontiers", "matched", "histograms", "exitmaps", "geometry", "provenance"):
        assert f'id="{section}"' in page
    # What is missing is said, not left blank.
    assert "rerun the sweep with --log-samples" in page and "no geometry report here" in page
    # (issue 72) frontiers at the page's width, not half of it, and every table in a box that scrolls sideways
    # rather than being cut off at the page's edge
    assert len(re.findall(r'<img class="figure" alt="frontier over', page)) == 3
    assert "img.figure { width: 100%; }" in page
    assert page.count('<table class="sortable">') == page.count('<div class="wide"><table class="sortable">') > 0


def test_the_wall_clock_figure_is_points_under_the_frontier():
    """Measured times do not fall in threshold order: a line through a policy's cells zigzagged across the time
    axis (issue 72). On wall-clock its cells are points, the frontier's band the one line; the legend stands
    beside the axes, not over them."""
    from exitbench.analysis.plot import draw

    fig = draw(ACC, "wall_clock")
    ax = fig.axes[0]
    series = [line for line in ax.get_lines()
              if not line.get_label().startswith("_") and line.get_label() != "frontier"]
    assert series and all(line.get_linestyle() == "None" for line in series)
    legend = ax.get_legend()
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the axes
    assert all(line.get_linestyle() != "None" for line in draw(ACC, "iterations").axes[0].get_lines()
               if line.get_label() == "fixed depth")


def test_matched_table_is_sorted_by_iterations(tmp_path):
    write_cells(tmp_path, ACC)
    page = report.build(tmp_path)
    matched = page[page.index('id="matched"'):page.index('id="histograms"')]
    policies = re.findall(r"<tr><td>([a-z_]+)</td>", matched)
    # Within 1% of full depth (0.90): oracle 4.5 iterations, kl 6, second_order 7 (0.896), fixed 16.
    assert policies == ["oracle", "kl", "second_order", "fixed"]


def test_range_column_only_when_some_cell_was_retimed(tmp_path):
    import copy

    cells = copy.deepcopy(ACC)
    write_cells(tmp_path / "plain", cells)
    assert "range of repeats</th>" not in report.build(tmp_path / "plain")
    kl = next(c for c in cells if c["policy"]["policy"] == "kl" and c["policy"]["threshold"] == 1e-3)
    paired(kl, [0.76, 0.8, 0.84])
    write_cells(tmp_path / "retimed", cells)
    page = report.build(tmp_path / "retimed")
    matched = page[page.index('id="matched"'):page.index('id="histograms"')]
    assert "range of repeats</th>" in matched
    # The range lands in its own column of kl's row (as speed-ups, as `pareto` says it) beside what it was timed
    # by; the other rows leave it blank and say theirs (the cells' own evaluations).
    kl_row = re.search(r"<tr><td>kl</td>(.*?)</tr>", matched).group(1)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", kl_row)[3:6] == ["1.25×", "1.19–1.32×", "paired"]
    oracle_row = re.search(r"<tr><td>oracle</td>(.*?)</tr>", matched).group(1)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", oracle_row)[4:6] == ["", "evaluations"]


def test_exit_maps_put_disagreement_first(tmp_path):
    paths = write_cells(tmp_path, ACC)
    # Operating points within 1%: kl 1e-3, second_order 0.1, oracle 0.01 (and fixed 16, which has no samples).
    # doc 2: the scores differ; doc 1: same score, the widest spread of iterations; docs 0, 3: agreement.
    docs = {"kl": {0: (1, [3, 3]), 1: (1, [2, 2, 2]), 2: (1, [5]), 3: (0, [4, 4])},
            "second_order": {0: (1, [3, 4]), 1: (1, [9, 9, 9]), 2: (0, [5]), 3: (0, [4, 4])},
            "oracle": {0: (1, [3, 3]), 1: (1, [1, 1, 1]), 2: (1, [2]), 3: (0, [4, 4])}}
    tau = {"kl": 1e-3, "second_order": 0.1, "oracle": 0.01}
    for policy, by_doc in docs.items():
        write_samples(paths[_cell(policy, tau[policy])["cell_id"]], by_doc)
    page = report.build(tmp_path, docs=2)
    shown = re.findall(r'<div class="doc" data-doc="(\d+)">', page)
    assert shown == ["2", "1"]
    block = page[page.index('data-doc="1"'):]
    block = block[:block.index('<div class="legend">')]
    rows = re.findall(r'<div class="row" data-tokens="(\d+)">', block)
    assert rows == ["3", "3", "3"]  # one row per policy, as many tokens as the document scored
    assert block.count('class="tok') == 9 and block.count('class="tok miss"') == 3
    assert 'data-step="9"' in block and "exit step 9" in block  # the hover text
    assert "no samples at the operating point" not in page  # fixed depth is never asked for


def test_with_one_policy_the_maps_shown_are_its_misses_then_its_most_varied(tmp_path):
    """Samples are on by default, so a one-rule sweep has full depth's too: the documents it shows first are
    those where the rule's score differs from full depth's, then those whose exit steps spread widest (before
    this, every document tied and the last ids were shown, whatever they held)."""
    cells = [c for c in ACC if c["policy"]["policy"] in ("fixed", "second_order")]
    paths = write_cells(tmp_path, cells)
    write_samples(paths[_cell("second_order", 0.1)["cell_id"]],
                  {0: (1, [3, 3]), 1: (1, [2, 9, 5]), 2: (0, [4]), 3: (1, [4, 4]), 4: (1, [6, 7])})
    write_samples(paths[_cell("fixed", 16.0)["cell_id"]], {d: (1, [16] * n) for d, n in enumerate([2, 3, 1, 2, 2])})
    page = report.build(tmp_path, docs=3)
    assert re.findall(r'<div class="doc" data-doc="(\d+)">', page) == ["2", "1", "4"]
    assert "(scores differ, mean iterations spread 0.00)" in page


def test_replay_cells_get_a_column(tmp_path):
    cells = [dict(c) for c in ACC]
    cells[2] = {**cells[2], "mode": "replay"}
    write_cells(tmp_path, cells)
    page = report.build(tmp_path)
    assert "1 replay" in page and f"{len(cells) - 1} exact" in page
    assert "<th class=\"\">mode</th>" in page


def test_geometry_figures_are_inlined(tmp_path):
    write_cells(tmp_path / "sweep", ACC)
    geo = tmp_path / "sweep" / "geometry"
    geo.mkdir()
    (geo / "geometry.json").write_text(json.dumps({"schema": "exitbench.geometry", "source": "tiny-raven"}))
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    (geo / "steps.png").write_bytes(png)
    page = report.build(tmp_path / "sweep")
    assert base64.b64encode(png).decode() in page and "no geometry report here" not in page


def test_cli_writes_the_page_into_the_directory(tmp_path):
    write_cells(tmp_path, PPL)
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, explain(res)
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")
    assert "wrote" in res.stderr
    # how to open it (issue 72): the page's own file URI, which a browser opens with no server
    assert f"open {(tmp_path / 'report.html').resolve().as_uri()} in a browser" in " ".join(res.stderr.split())


def test_cli_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(runner.invoke(app, ["report", str(tmp_path / "empty")]), ["no result cells"])
    assert_one_line_error(runner.invoke(app, ["report", str(tmp_path / "nowhere")]), ["not a directory"])
    write_cells(tmp_path / "sweep", PPL)
    assert_one_line_error(runner.invoke(app, ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "r.png")]),
                          ["--out", ".html"])
    assert_one_line_error(runner.invoke(app, ["report", str(tmp_path / "sweep"), "--docs", "-1"]), ["--docs"])
    assert not (tmp_path / "sweep" / "report.html").exists()


def _as_model(cell_list, fingerprint: str, source: str):
    import copy

    out = copy.deepcopy(cell_list)
    for c in out:
        c["model"] = {**c["model"], "fingerprint": fingerprint, "source": source}
    return out


@pytest.mark.slow  # 7 s: three models' committed sweeps in one page; the page's sections stay fast above and below
def test_page_opens_with_other_models_on_the_tasks_they_share(tmp_path):
    """report.yaml (or --compare) names other models' sweeps: one figure per shared task, all models on its
    axes, before anything else; a task only one model ran is not drawn."""
    write_cells(tmp_path / "a", _as_model(ACC + PPL, "aaaa1111", "embedded:model-a"))
    write_cells(tmp_path / "b", _as_model(ACC, "bbbb2222", "embedded:model-b"))
    (tmp_path / "a" / "report.yaml").write_text("compare:\n  - ../b\n")
    page = report.build(tmp_path / "a")
    assert page.index('id="models"') < page.index('id="frontiers"')
    models = page[page.index('id="models"'):page.index('id="frontiers"')]
    assert models.count("<img ") == 1 and "model-a, model-b" in models  # task t only: u is model-a's alone
    assert models.count("<td>model-a</td>") == models.count("<td>model-b</td>") == 4  # 4 policies within 1%
    assert page == report.build(tmp_path / "a", compare_with=[tmp_path / "b"])
    (tmp_path / "a" / "report.yaml").write_text("compare: [../nowhere]\n")
    assert_one_line_error(runner.invoke(app, ["report", str(tmp_path / "a")]), ["report.yaml", "nowhere"])
