"""The report page and an exit map in a real browser (headless Chromium): they load without errors, every
image decodes, nothing is fetched from the network, and each exit map row shows as many tokens as the
document scored. Slow: each test starts a browser, and one runs a small sweep; the fast stand-ins for the
same code are tests/test_report.py and tests/test_exitmap.py."""
from __future__ import annotations

import json

import pytest

from exitbench.analysis import report
from exitbench.models.checkpoint import open_checkpoint
from exitbench.cli import app

from exitbench.analysis.plot import LABEL_PT
from exitbench.analysis.report import FIGURE_DPI

from helpers.browser import console_errors, layout_problems, load
from helpers.cli import explain, run_ok, runner
from helpers.paths import REPO

pytestmark = pytest.mark.slow


def _assert_clean(found: dict, stderr: str) -> None:
    assert found["errors"] == [] and console_errors(stderr) == [], (found["errors"], console_errors(stderr))
    assert found["external"] == []
    assert found["images"] == found["decoded"], found


def test_baseline_report_loads_in_a_browser(tmp_path):
    page = report.write(REPO / "results" / "baseline", tmp_path / "report.html")
    found, stderr = load(page, tmp_path)
    _assert_clean(found, stderr)
    assert found["images"] == 3 + 3  # frontiers per cost axis, a histogram figure per task
    assert found["maps"] == []  # the committed baseline has no samples: the page says so instead
    assert "rerun the sweep with --log-samples" in page.read_text()
    # three tasks: each frontier panel gets its own row at the page's width, its labels legible
    assert layout_problems(found, LABEL_PT, FIGURE_DPI) == []


def test_sweep_exit_maps_show_every_scored_token(tmp_path):
    out = tmp_path / "sweep"
    run_ok("--policy", "kl", "--policy", "second_order", "--thresholds", "1e-3,0.3", "--baselines", "16",
           "--tasks", "chains,chains_lambada", "--limit", "6", "--log-samples", "--out", str(out))
    page = report.write(out, tmp_path / "report.html", docs=2)
    found, stderr = load(page, tmp_path)
    _assert_clean(found, stderr)
    tokens: dict[tuple[str, str], set[int]] = {}  # (task, doc) → token counts its samples hold
    for path in out.glob("*.samples.jsonl"):
        task = path.name.split("__")[0]
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            tokens.setdefault((task, str(sample["doc_id"])), set()).add(len(sample["exitbench"]["exit_steps"]))
    assert {m["task"] for m in found["maps"]} == {"chains", "chains_lambada"}
    for m in found["maps"]:
        assert len(m["rows"]) == 2  # kl and second_order side by side (fixed depth is not drawn)
        for declared, shown in m["rows"]:
            assert declared == shown and shown in tokens[(m["task"], m["doc"])], m


def test_trace_exit_map_loads_in_a_browser(tmp_path):
    prompt = "f=3 X=0 c=X G=3 V=c t=4 g=f l=t y=l i=V h=i"
    html = tmp_path / "trace.html"
    res = runner.invoke(app, ["trace", prompt, "--policy", "second_order", "--vs", "kl", "--html", str(html)])
    assert res.exit_code == 0, explain(res)
    found, stderr = load(html, tmp_path)
    _assert_clean(found, stderr)
    n = len(open_checkpoint(None).tokenizer.encode(prompt, add_bos=True)) - 1  # every token after BOS
    assert [m["rows"] for m in found["maps"]] == [[[n, n], [n, n]]]
