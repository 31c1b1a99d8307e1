"""Depth speculation (exitbench/engine/speculation.py, `--policy speculate`): drafts at a shallow depth or by an exit
rule, verified at full depth, give full depth's greedy output token for token on every embedded model, whatever the
draft and draft length; its cells say what that cost and every reader takes them."""
from __future__ import annotations

import csv
import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.speculation import DepthSpeculator
from exitbench.errors import ExitbenchError
from exitbench.harness.prompting import Prompting
from exitbench.models.checkpoint import open_checkpoint
from exitbench.cli import app
from exitbench.store import cells
from exitbench.sweep import SweepConfig, run_sweep
from helpers.paths import GSM8K_DIR


PROMPTS = ("a=3 b=a c=b d=c. d?", "x=7 y=x. y?", "q=2 r=q s=r t=s u=t. u?")
NEW = 12


@lru_cache(maxsize=None)
def full_depth(name: str):
    """The model, its prompts, and full depth's greedy continuations through the engine."""
    ck = open_checkpoint(name)
    prompts = [ck.tokenizer.encode(p) for p in PROMPTS]
    return ck.model, prompts, ExitEngine(ck.model, ExitConfig("fixed")).generate(prompts, max_new_tokens=NEW)


@pytest.mark.parametrize("name", ["tiny-raven", "tiny-looped-gpt2", "tiny-ouro"])
@pytest.mark.parametrize("draft,k", [(1, 1), (2, 3), (4, 6), (1, 0)])
def test_speculation_generates_full_depths_greedy_output(name, draft, k):
    """Tiny-raven's loop starts from position-keyed noise, so this also holds the draft and verify passes to the
    engine's noise. 1e-5: chunk and token passes sum attention in another order (measured 7e-6 at most)."""
    model, prompts, want = full_depth(name)
    got = DepthSpeculator(model, draft, k).generate(prompts, max_new_tokens=NEW)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    torch.testing.assert_close(torch.tensor([g.logprobs for g in got]), torch.tensor([w.logprobs for w in want]),
                               atol=1e-5, rtol=0)
    full = sum(model.resolve_steps(None))
    for g in got:
        # per round its kept drafts and full depth's own token; every round verified k' + 1 positions at full depth
        assert sum(a + 1 for a in g.accepted) == len(g.tokens) == NEW
        assert all(0 <= a <= k for a in g.accepted) and (k or g.draft_iterations == 0)
        assert g.verify_iterations % full == 0


def test_a_stop_id_ends_it_where_full_depth_stops():
    model, prompts, want = full_depth("tiny-ouro")
    stop = want[0].tokens[4]
    (got,) = DepthSpeculator(model, 2, 6).generate(prompts[:1], max_new_tokens=NEW, stop_ids=[stop])
    (alone,) = ExitEngine(model, ExitConfig("fixed")).generate(prompts[:1], max_new_tokens=NEW, stop_ids=[stop])
    assert got.tokens == alone.tokens and got.stopped_by == alone.stopped_by == "stop_id"


@pytest.mark.parametrize("draft,k,words", [(12, 4, "not below full depth"), (0, 4, "≥ 1"), (2, -1, "(k)")])
def test_a_draft_that_cannot_speculate_is_refused_in_one_line(draft, k, words):
    model = full_depth("tiny-ouro")[0]  # full depth 12
    with pytest.raises(ExitbenchError) as err:
        DepthSpeculator(model, draft, k)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["tiny-raven", "tiny-looped-gpt2", "tiny-ouro"])
def test_drafts_by_an_exit_rule_give_full_depths_greedy_output_too(name):
    """The draft rule's own exits (and the carried entries above them) only move what is kept."""
    model, prompts, want = full_depth(name)
    groups = model.loop_groups()
    rules = [ExitConfig("second_order", threshold=0.3).build_policy().bind(g.default_steps, g) for g in groups]
    got = DepthSpeculator(model, None, 3, draft_rules=rules).generate(prompts, max_new_tokens=NEW)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    full = sum(model.resolve_steps(None))
    # a rule that exits below full depth on some draft: fewer draft iterations than drafts at full depth would be
    assert sum(g.draft_iterations for g in got) < full * sum(g.drafted for g in got)


def test_a_rounds_cost_is_shared_among_the_tokens_it_emitted():
    model, prompts, _ = full_depth("tiny-raven")
    (got,) = DepthSpeculator(model, 2, 4).generate(prompts[:1], max_new_tokens=NEW)
    assert len(got.charges) == len(got.tokens)
    # whole iterations per token that add up to every draft and verification, FLOPs likewise
    assert sum(sum(c.iterations) for c in got.charges) == got.draft_iterations + got.verify_iterations
    assert got.drafted == sum(min(4, NEW - 1 - sum(a + 1 for a in got.accepted[:r])) for r in range(len(got.accepted)))
    assert all(c.flops["total"] > 0 and c.seconds > 0 for c in got.charges)


def _sweep(tmp_path: Path, name: str, full: int, **more) -> dict[str, dict]:
    """Speculation and full-depth cells of `name` on chains; each cell by its series and τ, with its answers."""
    cfg = SweepConfig(checkpoint=name, tasks=more.pop("tasks", ["chains"]), policies=["speculate"],
                      baselines=[full], log_samples=True, timing_repeats=0, quiet=True, out=tmp_path, **more)
    run_sweep(cfg)
    out = {}
    for path in sorted(tmp_path.glob("*.json")):
        cell = cells.read(path)
        answers = [json.loads(line)["resps"] for line in path.with_suffix(".samples.jsonl").read_text().splitlines()]
        out[f"{cells.series(cell['policy'])} {cell['policy']['threshold']:g}"] = {"cell": cell, "answers": answers}
    return out


@pytest.mark.parametrize("name,full", [("tiny-raven", 16), ("tiny-looped-gpt2", 6), ("tiny-ouro", 12)])
def test_speculation_cells_are_full_depths_generations(tmp_path, name, full):
    """On the shipped generation task, every embedded model: each speculation cell's answers are full depth's, its
    quality too (checked, not assumed), and it says what its rounds cost."""
    got = _sweep(tmp_path, name, full, thresholds=[1, 2], limit=12)
    ref = got.pop(f"fixed {full}")
    assert sorted(got) == ["speculate-k4 1", "speculate-k4 2"]
    for cell in got.values():
        assert cell["answers"] == ref["answers"]
        c = cell["cell"]
        assert c["quality"]["value"] == ref["cell"]["quality"]["value"]
        rounds = c["speculation"]
        assert rounds["rounds"] > 0 and 0 <= rounds["acceptance_rate"] <= 1
        # a token's iterations are its share of its round's drafts and verification
        per_token = rounds["draft_iterations_per_token"] + rounds["verify_iterations_per_token"]
        assert c["iterations"]["mean"] == pytest.approx(per_token)
        assert "schedule" not in c["iterations"]


@pytest.mark.slow  # (8 s, most of it lm-eval building GSM8K; chains above holds the shipped task in the fast suite)
def test_speculation_on_gsm8k_is_full_depths_generation(tmp_path):
    """lm-eval's own gsm8k (the real test set under ../shared), answers long enough for several rounds."""
    got = _sweep(tmp_path, "tiny-looped-gpt2", 6, tasks=["gsm8k"], thresholds=[2], limit=2, data_dir=GSM8K_DIR,
                 prompting=Prompting(gen_kwargs="max_gen_toks=24"))
    ref, spec = got["fixed 6"], got["speculate-k4 2"]
    assert spec["answers"] == ref["answers"] and spec["cell"]["speculation"]["rounds"] >= 2 * 2


def test_a_draft_rule_is_a_series_of_its_own_over_its_rules_grid(tmp_path):
    got = _sweep(tmp_path, "tiny-raven", 16, thresholds=[0.3], limit=8, exit={"draft": {"policy": "second_order"}})
    assert set(got) == {"fixed 16", "speculate:second_order-k4 0.3"}
    assert got["speculate:second_order-k4 0.3"]["answers"] == got["fixed 16"]["answers"]


@pytest.mark.parametrize("args,words", [
    (["--tasks", "chains_mc"], "task chains_mc is multiple_choice"),
    (["--thresholds", "16"], "drafts at depth 16, and full depth is 16"),
    (["--draft-tokens", "0"], "--draft-tokens must be a whole number ≥ 1"),
    (["--thresholds", "1.5"], "whole numbers"),
    (["--kv-layout", "single"], "drop --kv-layout"),
])
def test_bad_speculation_is_refused_in_one_line_and_nothing_is_written(tmp_path, args, words):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", "--policy", "speculate", "--limit", "8", "--out", str(out),
                                      *(["--tasks", "chains"] if "--tasks" not in args else []), *args])
    assert result.exit_code == 2, result.output
    assert words in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_a_rule_that_cannot_draft_is_refused():
    with pytest.raises(ExitbenchError, match="oracle cannot draft"):
        ExitConfig("speculate", threshold=0.1, draft={"policy": "oracle"})
    with pytest.raises(ExitbenchError, match="its threshold is the cell's τ"):
        ExitConfig("speculate", threshold=0.1, draft={"policy": "kl", "threshold": 1e-3})
    with pytest.raises(ExitbenchError, match="no per-token exit"):
        ExitEngine(full_depth("tiny-ouro")[0], ExitConfig("speculate", threshold=2))


def test_every_reader_takes_speculation_cells(tmp_path):
    """pareto, report, export and check read them, speculation as its own series beside the rules."""
    _sweep(tmp_path / "run", "tiny-ouro", 12, thresholds=[2], limit=8)
    runner = CliRunner()
    pareto = runner.invoke(app, ["pareto", str(tmp_path / "run")])
    assert pareto.exit_code == 0 and "speculate" in pareto.output, pareto.output
    assert "differs from full depth's" not in pareto.output  # the lossless check found nothing to say
    report = runner.invoke(app, ["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")])
    assert report.exit_code == 0 and "speculate-k4" in (tmp_path / "r.html").read_text()
    export = runner.invoke(app, ["export", str(tmp_path / "run"), "-o", str(tmp_path / "x.csv")])
    assert export.exit_code == 0
    rows = {r["series"]: r for r in csv.DictReader((tmp_path / "x.csv").open())}
    assert rows["speculate-k4"]["draft"] == "depth 2" and rows["speculate-k4"]["draft_tokens"] == "4"
    assert 0 <= float(rows["speculate-k4"]["acceptance_rate"]) <= 1 and rows["fixed"]["draft"] == ""
    check = runner.invoke(app, ["check", str(tmp_path / "run"), "--baseline", str(tmp_path / "run")])
    assert check.exit_code == 0, check.output


def test_a_speculation_cell_that_lost_quality_is_warned_of(tmp_path):
    from exitbench.analysis.notes import lossless_note

    got = _sweep(tmp_path, "tiny-ouro", 12, thresholds=[2], limit=8)
    spec = got["speculate-k4 2"]["cell"]
    assert lossless_note([got["fixed 12"]["cell"], spec]) is None
    spec["quality"]["value"] = spec["quality"]["value"] - 0.125
    assert "speculation cells' quality differs from full depth's" in lossless_note([got["fixed 12"]["cell"], spec])
