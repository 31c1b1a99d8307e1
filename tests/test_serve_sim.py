"""`exitbench serve-sim`: decode throughput replayed from recorded exit schedules (exitbench/analysis/serving.py),
the schedule each exact cell records, and the command's answers to bad input."""
from __future__ import annotations

import json
import random

import pytest

from exitbench.analysis.serving import Cost, Request, parse_batch_sizes, requests_of, serve_sim, simulate
from exitbench.errors import ExitbenchError
from exitbench.store import cells

from helpers.cells import baseline_cells, copy_cells
from helpers.cli import assert_one_line_error, runner
from exitbench.cli import app

K = 16
# Only per-row loop work: time is the rows' iterations, the cost model under which the ideal is exact
WORK = Cost(step_s=0.0, row_s=1.0, exit_s=0.0, exit_row_s=0.0, prefill_s=0.0, prefill_token_s=0.0, source="work")
# Host-bound, as the embedded models on a CPU: a step costs the same for 1 row or 16, a tick of exit work two steps
HOST = Cost(step_s=1.0, row_s=0.0, exit_s=2.0, exit_row_s=0.0, prefill_s=16.0, prefill_token_s=0.0, source="host")


def spread(n: int, tokens: int, low: int, seed: int = 0) -> list[Request]:
    g = random.Random(seed)
    return [Request(g.randint(4, 40), [g.randint(low, K) for _ in range(tokens)]) for _ in range(n)]


def test_a_static_batch_step_lasts_until_its_slowest_token():
    """Two rows, one request each, of tokens exiting at 4 and 10: static runs 10 steps with both rows for 4 of
    them (4·2 + 6·1 row-steps under per-row work), continuous the same work; at full depth 2 · 16."""
    reqs = [Request(3, [4]), Request(5, [10])]
    assert simulate(reqs, 2, "static", WORK, K) == 4 * 2 + 6 * 1
    assert simulate(reqs, 2, "full", WORK, K) == 2 * K
    # host-bound: one prefill of both, 10 steps, one tick of exit work for both
    assert simulate(reqs, 2, "static", HOST, K) == 16 + 10 + 2


def test_continuous_rows_take_their_next_token_without_waiting_for_the_slowest():
    """One request of tokens (2, 2, 2) beside one of (12): static makes each of the first row's tokens wait for the
    12-step token while it runs; continuous runs the first row's three tokens inside those 12 steps."""
    reqs = [Request(0, [2, 2, 2]), Request(0, [12])]
    host = Cost(step_s=1.0, row_s=0.0, exit_s=0.0, exit_row_s=0.0, prefill_s=0.0, prefill_token_s=0.0, source="h")
    assert simulate(reqs, 2, "static", host, K) == 12 + 2 + 2   # batch steps of 12, 2, 2 loop steps
    assert simulate(reqs, 2, "continuous", host, K) == 12


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_full_depth_schedules_are_full_depth_under_every_scheduler(batch):
    reqs = [Request(r.prompt, [K] * len(r.iterations)) for r in spread(50, 3, 1)]
    times = {s: simulate(reqs, batch, s, HOST, K) for s in ("full", "static", "continuous")}
    assert times["static"] == times["full"] == times["continuous"]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_under_per_row_work_continuous_beats_static_and_stays_under_the_iteration_bound(batch):
    """Where time is the rows' loop work the ideal (the iteration ratio) is exactly continuous batching's bound,
    and static batching's idle rows cost nothing, so all three are equal at batch 1 and ordered above it."""
    reqs = spread(40, 4, 2, seed=batch)
    full = simulate(reqs, batch, "full", WORK, K)
    ideal = K * sum(len(r.iterations) for r in reqs) / sum(sum(r.iterations) for r in reqs)
    static, cont = (full / simulate(reqs, batch, s, WORK, K) for s in ("static", "continuous"))
    assert static == pytest.approx(cont) == pytest.approx(ideal)  # idle rows cost nothing: all reach the ideal
    # with a fixed part per step a batch step's idle tail costs time: both fall under the ideal, equal at batch 1
    stepped = Cost(step_s=1.0, row_s=1.0, exit_s=0.0, exit_row_s=0.0, prefill_s=0.0, prefill_token_s=0.0, source="s")
    full = simulate(reqs, batch, "full", stepped, K)
    static, cont = (full / simulate(reqs, batch, s, stepped, K) for s in ("static", "continuous"))
    assert 1 < static <= ideal and 1 < cont <= ideal
    if batch == 1:
        assert static == cont


def test_host_bound_exits_buy_less_than_their_iterations():
    """On a host-bound model a loop step, a tick of exit work and a prefill cost the same for one row as for
    sixteen, so an exit schedule's throughput stays far under its iteration ratio, and continuous batching,
    which splits a batch's exit work and prefills into more ticks, can fall below static batching, even below
    full depth: the projection says so where the ideal would not."""
    reqs = spread(64, 2, 1)
    ideal = K * 128 / sum(sum(r.iterations) for r in reqs)
    full = simulate(reqs, 16, "full", HOST, K)
    static, cont = (full / simulate(reqs, 16, s, HOST, K) for s in ("static", "continuous"))
    assert 1 < static < 0.8 * ideal
    assert cont < static


def fixed_and_kl(tmp_path, kl_iterations):
    """The committed chains_mc cells of full depth, kl and the oracle, given exit schedules: full depth's at K,
    kl's `kl_iterations`, the oracle's none (a cell written before schedules were)."""
    def change(cell):
        policy = cell["policy"]["policy"]
        if policy == "oracle":
            cell.pop("exits", None)
            return
        n = 40
        its = [[K]] * n if policy == "fixed" else [[i] for i in kl_iterations(n)]
        cell["exits"] = {"kind": "loglikelihood", "first": [30] * n, "iterations": its}
    paths = [p for p in baseline_cells() if "fixed-16" in p.name or "kl-0.001_" in p.name or "oracle" in p.name]
    return copy_cells(tmp_path / "sweep", paths, change)


def test_serve_sim_prints_full_depth_at_one_and_skips_cells_without_schedules(tmp_path):
    sweep = fixed_and_kl(tmp_path, lambda n: [4 + i % 9 for i in range(n)])
    res = runner.invoke(app, ["serve-sim", str(sweep), "--batch-size", "1,16", "--format", "json"])
    assert res.exit_code == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["cost"]["source"]  # the cost model is named
    rows = {(r["policy"], r["batch_size"]): r for r in out["rows"]}
    assert set(rows) == {("fixed", 1), ("fixed", 16), ("kl", 1), ("kl", 16)}
    for b in (1, 16):
        full = rows[("fixed", b)]
        assert full["throughput_full"] == full["throughput_static"] == full["throughput_continuous"] == 1.0
        kl = rows[("kl", b)]
        assert kl["ideal"] == pytest.approx(K / (sum(4 + i % 9 for i in range(40)) / 40))
        assert 1 < kl["throughput_static"] <= kl["ideal"] and kl["throughput_continuous"] <= kl["ideal"]
    assert "oracle" in res.stderr and "no recorded exit schedule" in res.stderr
    table = runner.invoke(app, ["serve-sim", str(sweep), "--batch-size", "16"])
    assert table.exit_code == 0 and "continuous" in table.stdout and "Cost model" in table.stdout


@pytest.mark.parametrize("args,words", [
    (["--batch-size", "0"], ["--batch-size", "≥ 1"]),
    (["--batch-size", "1,x"], ["--batch-size", "whole numbers"]),
    (["--cost", "MISSING"], ["--cost", "bench/serving_cost.py"]),
    (["--cost", "BAD"], ["--cost", "step_s", "≥ 0"]),
    (["--format", "csv"], ["--format", "rich or json"]),
])
def test_bad_input_is_one_line(tmp_path, args, words):
    sweep = fixed_and_kl(tmp_path, lambda n: [8] * n)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"step_s": -1}))
    args = [str(tmp_path / "missing.json") if a == "MISSING" else str(bad) if a == "BAD" else a for a in args]
    assert_one_line_error(runner.invoke(app, ["serve-sim", str(sweep), *args]), words)


def test_the_packaged_cost_file_reads_and_a_batch_size_list_parses():
    cost = Cost.read()
    assert cost.step_s > 0 and "serving_cost.py" in cost.source
    assert parse_batch_sizes("1,8,64") == [1, 8, 64]
    with pytest.raises(ExitbenchError, match="≥ 1"):
        serve_sim([], parse_batch_sizes("0"), cost)


def test_a_cell_records_its_exit_schedule_request_by_request():
    """`cells.exit_schedule`: what serve-sim replays, from the per-request stats the harness keeps."""
    stats = [{"kind": "generate_until", "first_position": 11, "iterations": [5, 16]},
             {"kind": "generate_until", "first_position": 7, "iterations": [3]}]
    schedule = cells.exit_schedule(stats)
    assert schedule == {"kind": "generate_until", "first": [11, 7], "iterations": [[5, 16], [3]]}
    assert requests_of({"exits": schedule}) == [Request(11, [5, 16]), Request(7, [3])]
    assert requests_of({}) is None
