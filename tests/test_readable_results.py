"""What a reader sees cannot be misread: metrics in words and their direction said, a fixed depth as r, one
speed-up convention in every table, figure labels on their own points only, presets whole at any width, and none
of lm-eval's hints for its own command line."""
from __future__ import annotations

import copy
import logging
import re


from exitbench import presets
from exitbench.analysis import frontier, labels, plot, report, tables
from exitbench.harness.quiet import lm_eval_output
from exitbench.store.loading import load
from exitbench.sweep.run import summary_rows

from helpers.cells import ACC, paired, write_cells
from helpers.paths import BASELINE, REPO
from helpers.cli import rendered as render_at


def rendered(renderables, width: int = 100) -> str:  # (this file's tables at 100 columns)
    return render_at(renderables, width)


def test_metrics_fixed_depths_and_directions_in_words():
    assert labels.metric_name("exact_match,none") == "exact match"
    assert labels.metric_name("acc_norm,none") == "accuracy (length-normalised)"
    assert labels.metric_name("exact_match,strict-match") == "exact match (strict-match)"
    assert labels.metric_name("word_perplexity,none") == "word perplexity"
    assert labels.metric_with_direction("perplexity,none", False) == "perplexity (lower is better)"
    assert labels.setting("fixed", 16) == "r = 16" and labels.setting("kl", 1e-3) == "0.001"
    assert labels.config_label("fixed", 16) == "fixed r=16" and labels.config_label("kl", 1e-3) == "kl τ=0.001"


def test_run_table_names_metrics_and_depths_and_keeps_policy_names_whole():
    cell_list = copy.deepcopy([c for c in load([BASELINE]) if c["task"]["name"] == "chains"])
    text = rendered([tables.summary_table(summary_rows(cell_list), "cells")], width=100)
    assert "cells: chains · exact match (higher is better)" in text and "exact_match,none" not in text
    assert re.search(r"│ fixed +│ +r = 16 │", text) and not re.search(r"│ fixed +│ +16 │", text)
    # At 100 columns a table of every policy keeps every value whole: nothing is cut to an ellipsis or cropped.
    assert "…" not in text and "second_order_magnitude" in text and "probe" in text


def test_one_speed_up_convention_in_run_and_pareto():
    """The same retimed cell reads the same speed-up (full depth's time ÷ the cell's, ×, with its repeats' range
    as speed-ups) in `run`'s table, `pareto`'s matched-quality table and the report; its evaluations' own ratio
    stays in the JSON beside it."""
    cell_list = copy.deepcopy(ACC)
    kl = next(c for c in cell_list if c["policy"]["policy"] == "kl" and c["policy"]["threshold"] == 1e-3)
    paired(kl, [0.45, 0.5, 0.55])  # 2.00×, its repeats 1.82× to 2.22×
    run_text = rendered([tables.summary_table(summary_rows(cell_list), "cells")])
    rep = frontier.report(cell_list)
    pareto_text = rendered(tables.pareto_tables(rep, "matched"))
    assert re.search(r"│ kl +│ +0\.001 │.*2\.00× \(1\.82–2\.22\)", run_text), run_text
    assert re.search(r"│ kl +│ +0\.001 │.*2\.00× \(1\.82–2\.22\)", pareto_text)
    row = next(r for r in rep["t · acc"]["matched_quality"] if r["policy"] == "kl")
    assert row["speedup"] == 2.0 and row["evaluation_speedup"] == 1.0 / 0.8
    assert "time / full" not in run_text


def test_report_states_direction_and_spread_in_words(tmp_path):
    cell_list = copy.deepcopy(ACC)
    kl = next(c for c in cell_list if c["policy"]["policy"] == "kl" and c["policy"]["threshold"] == 1e-3)
    paired(kl, [0.45, 0.5, 0.55])
    write_cells(tmp_path, cell_list)
    page = report.build(tmp_path)
    matched = page[page.index('id="matched"'):page.index('id="histograms"')]
    assert "(higher is better; full depth r = 16)" in matched and "higher is better: True" not in page
    kl_row = re.search(r"<tr><td>kl</td>(.*?)</tr>", matched).group(1)
    assert "1.82–2.22×" in re.findall(r"<td[^>]*>([^<]*)</td>", kl_row)
    assert '<td class="num">r = 16</td>' in matched


def test_a_frontier_label_never_sits_on_another_point(tmp_path):
    """On the committed sweep's figure (the report's opening one), every label that stays covers no marker but
    its own point's and no other label, and the fixed depths on the frontier keep theirs (`r = 8`)."""
    fig = plot.draw(load([BASELINE]), "iterations")
    renderer = fig.canvas.get_renderer()
    kept = [t for ax in fig.axes for t in ax.texts]
    assert kept, "no label was drawn: nothing was checked"
    boxes = []
    for label in kept:
        box = label.get_window_extent(renderer)
        anchor = label.axes.transData.transform(label.xy)
        for marker in plot.marker_boxes(label.axes):
            assert marker.contains(*anchor) or not box.overlaps(marker), f"{label.get_text()!r} covers a marker"
        assert not any(box.overlaps(b) for b in boxes), f"{label.get_text()!r} covers another label"
        boxes.append(box)
    assert any(t.get_text().startswith("r = ") for t in kept)
    assert not any(re.fullmatch(r"fixed [\d.]+", t.get_text()) for t in kept)


def test_presets_read_whole_at_100_columns_and_as_markdown():
    found = [presets.load(name) for name in presets.names()]
    text = " ".join(rendered(tables.presets_tables(found), width=100).split())
    assert "…" not in text
    flat = re.sub(r"[│ ]+", " ", text)
    for p in found:
        assert p.checkpoint in flat and " ".join(p.source.split()) in flat
    md = tables.presets_markdown(found)
    assert all(p.source in md and ", ".join(p.tasks) in md for p in found)


def test_no_metadata_hint_and_no_datasets_bar_inside_a_run(tmp_path, capfd):
    """lm-eval's `--metadata` hint and datasets' "Generating … split" bar, each shown outside the block (so the
    check can fail), never inside it."""
    import datasets
    from lm_eval.tasks import TaskManager

    heard: list[str] = []

    class Ear(logging.Handler):
        def emit(self, record):
            heard.append(record.getMessage())

    ear = Ear()
    logger = logging.getLogger("lm_eval")
    # an earlier simple_evaluate(verbosity="ERROR") in this process leaves lm-eval at ERROR: a fresh console's
    # WARNING, so the hint is really logged outside the block
    saved_level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(ear)
    manager = TaskManager(include_path=[str(REPO / "tasks")], include_defaults=False)
    data = REPO / "tasks" / "chains" / "test.jsonl"
    try:
        manager.load(["chains"])
        datasets.Dataset.from_json(str(data), cache_dir=str(tmp_path / "outside"))
        outside = capfd.readouterr().err
        assert any("--metadata" in m for m in heard) and "Generating" in outside
        heard.clear()
        with lm_eval_output(quiet=False, progress_bars=False):
            manager.load(["chains"])
            datasets.Dataset.from_json(str(data), cache_dir=str(tmp_path / "inside"))
        assert not any("--metadata" in m for m in heard) and "Generating" not in capfd.readouterr().err
    finally:
        logger.removeHandler(ear)
        logger.setLevel(saved_level)


def test_a_conjunctions_trace_says_whose_threshold_it_is():
    """`all_of τ=5` named no rule; the title names the rules and the one τ varies."""
    knobs = {"policy": "all_of", "threshold": 5, "patience": 2, "max_steps": 16,
             "rules": [{"policy": "margin", "threshold": 0.125}, {"policy": "argmax_stability"}]}
    table = tables.trace_table({"policy": knobs, "mode": "score", "mean_iterations": 7.0, "tokens": []})
    assert str(table.title).startswith("margin 0.125 ∧ argmax_stability, argmax_stability τ=5 (patience 2")
    plain = tables.trace_table({"policy": {**knobs, "policy": "kl", "threshold": 5e-4, "rules": None},
                                "mode": "score", "mean_iterations": 3.0, "tokens": []})
    assert str(plain.title).startswith("kl τ=0.0005 (patience 2")


def test_the_quickstarts_trace_shows_an_answer_not_only_misses():
    """Scoring the program's own tokens is a row of misses (a next variable's name is arbitrary); the quickstart's
    trace generates the answer, which the model gets right, so the exit steps it shows mean something."""
    import shlex

    from helpers.cli import runner
    from helpers.paths import REPO

    from exitbench.cli import app

    text = (REPO / "docs" / "quickstart.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("exitbench trace "))
    args = [a for a in shlex.split(line)[1:] if a != "--html" and a != "exitmap.html"]
    assert "--generate" in args
    res = runner.invoke(app, args, terminal_width=120)
    assert res.exit_code == 0, res.output
    rows = [r for r in res.output.splitlines() if r.startswith("│ d=c")]
    assert len(rows) == 2 and all("│ 7 " in r and "│ yes " in r for r in rows), res.output


def test_a_rule_that_can_exit_only_late_is_marked_in_every_table():
    """A rule whose definition leaves it only the last iteration or two (contraction on three passes) is run and
    tabled, marked †, with the iteration it can first exit at."""
    cell_list = copy.deepcopy(ACC)
    so = next(c for c in cell_list if c["policy"]["policy"] == "second_order" and c["policy"]["threshold"] == 0.1)
    so["policy"].update(late_exit=True, earliest_exit=15)
    run_text = rendered([tables.summary_table(summary_rows(cell_list), "cells")], width=160)
    assert re.search(r"│ second_order † +│ +0\.1 │", run_text), run_text
    assert "† the rule's definition lets it exit no earlier than iteration 15" in " ".join(run_text.split())
    pareto_text = " ".join(rendered(tables.pareto_tables(frontier.report(cell_list), "matched"), width=160).split())
    assert "second_order † │ 0.1" in pareto_text and "no earlier than iteration 15" in pareto_text
