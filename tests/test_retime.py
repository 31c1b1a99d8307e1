"""Repeated, interleaved timing of a cell beside full depth (exitbench/timing/retime.py), on stand-in models
whose per-token times are set, so the pairing and the order can be checked exactly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from exitbench.timing import retime, trust


class Timed:
    """An ExitbenchLM's surface as retime uses it: a request method recording per-request stats, with the
    per-token seconds of each successive call taken from `times`."""

    def __init__(self, name: str, times: list[float], log: list[str]):
        self.name, self.times, self.log = name, list(times), log
        self.request_stats = [{"mine": True}]  # the evaluation's own stats, which retiming must leave alone
        self.on_progress = print

    def generate_until(self, requests):
        assert self.on_progress is None  # no progress bar moves while retiming
        self.log.append(self.name)
        per_token = self.times.pop(0)
        for _ in requests:  # two scored tokens per request
            self.request_stats.append({"iterations": [3, 4], "token_seconds": 2 * per_token})
        return ["" for _ in requests]


def requests(task: str, n: int) -> list:
    return [SimpleNamespace(task_name=task, idx=i) for i in range(n)]


def test_repeats_alternate_and_pair_each_cell_timing_with_its_neighbour():
    log: list[str] = []
    cell = Timed("cell", [1.0, 2.0, 1.5, 1.0], log)
    full = Timed("full", [4.0, 4.0, 5.0, 2.0], log)
    work = [("generate_until", requests("t", 3))]
    got = retime.retime(cell, full, work, 4, full_depth=16)
    # Even repeats time the cell first, odd ones full depth first: a machine that speeds up or slows down
    # over the repeats weighs on both sides alike.
    assert log == ["cell", "full", "full", "cell", "cell", "full", "full", "cell"]
    assert got["per_token_s"] == [1.0, 2.0, 1.5, 1.0] and got["full_per_token_s"] == [4.0, 4.0, 5.0, 2.0]
    assert got["ratios"] == [0.25, 0.5, 0.3, 0.5]
    assert got["ratio"] == pytest.approx(0.4)  # the median of four
    assert got["spread"] == pytest.approx((0.5 - 0.25) / 0.4)
    assert got["repeats"] == 4 and got["requests"] == 3 and got["full_depth"] == 16
    for lm in (cell, full):  # the evaluation's statistics and progress callback are as they were
        assert lm.request_stats == [{"mine": True}] and lm.on_progress is print


class Stepped(Timed):
    """A Timed model with an engine counting loop steps: each pass runs `steps` of them for tokens of `iterations`
    iterations (two per request)."""

    def __init__(self, name, times, log, steps: int, iterations: tuple[int, int], prefill: str = "full"):
        super().__init__(name, times, log)
        self.engine = SimpleNamespace(config=SimpleNamespace(prefill=prefill), stats={"steps": 7.0})
        self.steps, self.iterations = steps, list(iterations)

    def generate_until(self, requests):
        out = super().generate_until(requests)
        for s in self.request_stats[-len(requests):]:
            s["iterations"] = self.iterations
        self.engine.stats["steps"] += self.steps
        return out


def test_the_repeats_split_the_overhead_into_the_batches_schedule_and_the_step():
    """Three requests of two tokens: the cell's tokens run 3 + 5 iterations, full depth's 16 + 16, so the
    iteration ratio is 24 / 96 = 1/4; the cell's batch ran 10 steps against full depth's 32, a steps ratio of
    10/32, which is 1.25 × what the iterations need. The engine's counter is read before and after each pass,
    so steps counted before the repeats stay out."""
    log: list[str] = []
    cell = Stepped("cell", [1.0, 1.0], log, steps=10, iterations=(3, 5))
    full = Stepped("full", [2.0, 2.0], log, steps=32, iterations=(16, 16))
    got = retime.retime(cell, full, [("generate_until", requests("t", 3))], 2, full_depth=16)
    assert got["steps_ratio"] == pytest.approx(10 / 32)
    assert got["schedule"] == pytest.approx(1.25)
    # prefill exit loops prompt tokens whose iterations no request's stats carry: no schedule then
    cell = Stepped("cell", [1.0], log, steps=10, iterations=(3, 5), prefill="exit")
    full = Stepped("full", [2.0], log, steps=32, iterations=(16, 16), prefill="exit")
    got = retime.retime(cell, full, [("generate_until", requests("t", 3))], 1, full_depth=16)
    assert got["steps_ratio"] is None and got["schedule"] is None and got["ratio"] == 0.5


def test_nothing_to_time_is_no_timing():
    log: list[str] = []
    assert retime.retime(Timed("c", [], log), Timed("f", [], log), [], 3, 16) is None
    assert retime.retime(Timed("c", [1.0], log), Timed("f", [1.0], log), [("generate_until", [])], 0, 16) is None
    assert log == []


def docs(task: str, n: int, per_doc: int = 1, kind_of=None) -> list:
    """lm-eval's requests for `n` documents of `task`, `per_doc` each (a multiple-choice document has several)."""
    return [SimpleNamespace(task_name=task, doc_id=d, idx=i) for d in range(n) for i in range(per_doc)]


def evaluated(task: str, costs: list[float], tokens: int = 4) -> list[dict]:
    """The evaluation's per-request stats of a task whose document d ran at `costs[d]` of full depth's FLOPs
    (each request `tokens` tokens, each at context 10)."""
    return [{"task_name": task, "doc_id": d, "idx": 0, "iterations": [1] * tokens, "context_sum": 10 * tokens,
             "flops": c * FULL(tokens, 10 * tokens)} for d, c in enumerate(costs)]


def FULL(tokens: int, context_sum: int) -> float:  # a token at full depth: 1000 FLOPs and 10 per context position
    return 1000.0 * tokens + 10.0 * context_sum


def whole_ratio(costs: list[float]) -> float:
    return sum(costs) / len(costs)  # every document has the same tokens and contexts


ORDERINGS = {
    # the reproduction: 6 easy documents first, 42 hard ones after them
    "easy first": [0.28] * 6 + [0.85] * 42,
    "hard first": [0.85] * 42 + [0.28] * 6,
    "ascending": [0.1 + 0.9 * i / 47 for i in range(48)],
    "descending": [1.0 - 0.9 * i / 47 for i in range(48)],
    # every eighth document cheap: a draw of every eighth by position would take only these, or none
    "periodic": [0.2 if i % 8 == 4 else 0.9 for i in range(48)],
    "shuffled": [0.1 + 0.9 * ((i * 29) % 48) / 47 for i in range(48)],
}


@pytest.mark.parametrize("order", sorted(ORDERINGS))
def test_the_timed_documents_cost_what_the_whole_task_does_in_any_order(order):
    """Documents drawn one per stratum of the cost ranking: their FLOP ratio to full depth stays within
    MAX_SAMPLE_OFF of the whole task's however the task orders them, and they are never the task's first."""
    costs = ORDERINGS[order]
    sample = retime.draw({"generate_until": docs("t", 48)}, evaluated("t", costs), "t", 16, FULL)
    assert len(sample.documents) == 6 and sample.of == 48  # an eighth of 48
    assert sample.whole_flops_ratio == pytest.approx(whole_ratio(costs))
    drawn = sum(costs[d] for d in sample.documents) / len(sample.documents)
    assert sample.expected_flops_ratio == pytest.approx(drawn)
    assert abs(drawn / whole_ratio(costs) - 1) <= trust.MAX_SAMPLE_OFF, (order, sample.documents)
    assert sample.documents != list(range(6))
    assert [r.doc_id for _, reqs in sample.work for r in reqs] == sample.documents


def test_a_prefix_would_have_missed_the_task():
    """What the draw replaces: the first eighth of the reordered task costs a third of the whole's FLOP ratio."""
    costs = ORDERINGS["easy first"]
    assert abs(sum(costs[:6]) / 6 / whole_ratio(costs) - 1) > 0.6


def test_each_task_times_whole_documents_of_its_own():
    """A document's every request is timed together (a multiple-choice question's options share one pass), only
    the task's own, and each kind of request the task made."""
    received = {"loglikelihood": docs("a", 5) + docs("b", 40, per_doc=10), "generate_until": docs("c", 200)}
    stats = evaluated("b", [0.5] * 40)
    sample = retime.draw(received, stats, "b", 16, FULL)
    ((kind, reqs),) = sample.work
    assert kind == "loglikelihood" and len(sample.documents) == 5 and len(reqs) == 50  # an eighth of 40, whole
    assert all(r.task_name == "b" for r in reqs) and {r.doc_id for r in reqs} == set(sample.documents)
    # A stream of three batches of 16, capped at an eighth of 200 generations, where no FLOPs were counted: drawn
    # evenly by position instead.
    plain = retime.draw(received, [], "c", 16)
    assert plain.drawn == "stratified by position" and plain.whole_flops_ratio is None
    # the middle of each of 25 strata of 8 documents (of an even stratum's two middle ones, the first): across
    # the task, not its first 25
    assert plain.documents == [8 * i + 3 for i in range(25)]
    assert retime.task_work(received, "absent", 16) == []
    # throughput: three batches, at least 16, at most an eighth; latency: six documents, at most an eighth
    assert retime.sample_size(1, 600) == 16 and retime.sample_size(16, 600) == 48
    assert retime.sample_size(32, 600) == 75 and retime.sample_size(16, 600, stream=20) == 20
    assert retime.sample_size(16, 600, "latency") == retime.sample_size(64, 600, "latency") == 6
    assert retime.sample_size(16, 24) == 3 and retime.sample_size(16, 8) == 1 and retime.sample_size(16, 7) == 0
    assert retime.sample_size(16, 24, "latency") == 3


def test_a_task_too_small_to_retime_says_so():
    sample = retime.draw({"generate_until": docs("t", 7)}, evaluated("t", [0.5] * 7), "t", 16, FULL)
    assert sample.work == [] and sample.of == 7
    assert retime.too_small("t", 7) == ("t: 7 documents are too few to retime (at least 8: the repeats time an "
                                        "eighth of a task); its cells have no paired speed-up: those shown "
                                        "(marked *) divide the cells' own evaluations, one pass each")


def test_timed_documents_off_the_task_correct_the_ratio_by_flops():
    """Where the timed documents' FLOP ratio strays more than a tenth from the task's, the time ratio is
    carried to the task at the same overhead; within it, the measured ratio stands."""
    assert retime.representative(0.5, 0.52, 0.4) == {"representative": True, "corrected_ratio": None}
    off = retime.representative(0.3, 0.6, 0.4)
    assert off["representative"] is False and off["corrected_ratio"] == pytest.approx(0.8)
    assert retime.representative(None, 0.6, 0.4) == {"representative": None, "corrected_ratio": None}


def test_a_cell_says_why_its_timing_is_unreliable():
    cell = {"run": {"load": {"start": 0.4, "end": 0.6, "cpus": 2}},
            "wall_clock": {"repeats": {"repeats": 3, "ratio": 0.4, "spread": 0.1}}}
    assert trust.warnings(cell) == []
    cell["run"]["load"]["end"] = 6.0
    cell["wall_clock"]["repeats"]["spread"] = trust.UNRELIABLE_SPREAD + 0.1
    reasons = trust.warnings(cell)
    assert len(reasons) == 2
    assert "busy machine (load 6 on 2 cores)" in reasons[0]
    assert "3 repeated timings spread 60%" in reasons[1] and "0.4 to full depth" in reasons[1]
    assert trust.warnings({"run": {}, "wall_clock": {}}) == []  # a cell timed once, before repeats existed


def test_the_run_table_shows_the_paired_speedup_and_marks_an_unreliable_one():
    """As a speed-up (full depth's time ÷ the cell's: a ratio of 0.4 is 2.50×) with its repeats' range, the
    convention of every table; red, marked and without a number where a warning says not to trust it."""
    from exitbench.timing.speedup import NONE, SpeedUp
    from exitbench.analysis.tables import _speedup_cell

    assert _speedup_cell({"speedup": NONE}) == "-"  # timed once, no full depth to divide by
    assert _speedup_cell({"speedup": SpeedUp(2.5, "paired", 2.4, 2.6, 8.0), "warnings": []}) == "2.50× (2.40–2.60)"
    marked = _speedup_cell({"speedup": SpeedUp(2.5, "paired", 1.5, 4.0, 8.0), "warnings": ["spread"]})
    # no number where none can be read (issue 72): `?` and the repeats' range
    assert marked == "[red]? (1.50–4.00) ![/red]"


def reordered_chains(root):
    """tasks/chains under another name, 6 one-hop programs first and 42 twelve-hop ones after them: the easy
    end of a task first, as a task ordered by difficulty has it (built here, never shipped)."""
    import json
    import shutil

    from helpers.paths import TASKS_DIR

    rows = [json.loads(line) for line in (TASKS_DIR / "chains" / "test.jsonl").read_text().splitlines()]
    easy, hard = [r for r in rows if r["hop"] == 1][:6], [r for r in rows if r["hop"] == 12][:42]
    task = root / "chains_reordered"
    task.mkdir(parents=True)
    (task / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in easy + hard))
    shutil.copy(TASKS_DIR / "chains" / "utils.py", task)
    spec = (TASKS_DIR / "chains" / "chains.yaml").read_text()
    (task / "chains_reordered.yaml").write_text(spec.replace("task: chains\n", "task: chains_reordered\n")
                                                .replace("exitbench_chains", "exitbench_chains_reordered"))
    return task


def test_on_a_task_ordered_easy_first_the_timed_flops_are_the_cells(tmp_path):
    """The issue's reproduction, run: tiny-raven on the reordered task, confidence and kl at τ 0.5 and 0.01 and
    the oracle beside full depth. Every exit cell's timed documents have the FLOP ratio to full depth of the
    whole cell (`flops.per_token` over full depth's) within 10% (timing the first eighth, it was 10-67% off),
    and the cell records which documents were timed."""
    from exitbench.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(tasks=["chains_reordered"], policies=["confidence", "kl", "oracle"], thresholds=[0.5, 0.01],
                      baselines=[16], limit=48, timing_repeats=1, quiet=True, out=tmp_path / "out",
                      include_path=[reordered_chains(tmp_path / "tasks")])
    made = run_sweep(cfg).cells
    full = next(c for c in made if c["policy"]["policy"] == "fixed")
    exits = [c for c in made if c["policy"]["policy"] != "fixed"]
    assert len(exits) >= 3
    for cell in exits:
        rep = cell["wall_clock"]["repeats"]
        whole = cell["flops"]["per_token"] / full["flops"]["per_token"]
        assert abs(rep["flops_ratio"] / whole - 1) <= 0.10, (cell["policy"]["policy"], rep["flops_ratio"], whole)
        assert rep["whole_flops_ratio"] == pytest.approx(whole, rel=1e-6)  # generation stops at the same tokens
        assert len(rep["documents"]) == 6 and rep["of_documents"] == 48 and rep["documents"] != list(range(6))
        assert rep["representative"] is True and rep["corrected_ratio"] is None
        # 16 rows of a batch wait for their slowest: never fewer steps than the tokens' iterations need
        assert rep["schedule"] >= 1
        # (and each cell records where its rule's definition lets it exit first: from iteration 1 here)
        assert cell["policy"]["earliest_exit"] == 1 and "late_exit" not in cell["policy"]


def test_a_sweep_of_a_task_too_small_to_retime_says_so_once_and_keeps_its_cells(tmp_path):
    """Four documents: nothing to draw an eighth from. The run says so in one line, and the cells are written,
    without a speed-up, saying why."""
    from helpers.cells import load_cells
    from helpers.cli import explain, run_cli
    from helpers.sweeps import SMALL

    res, _ = run_cli(*SMALL, "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, explain(res)
    said = [line for line in res.output.splitlines() if "too few to retime" in line]
    assert said == ["note: chains_lambada: 4 documents are too few to retime (at least 8: the repeats time an eighth "
                    "of a task); its cells have no paired speed-up: those shown (marked *) divide the cells' own "
                    "evaluations, one pass each"]
    made = load_cells(tmp_path / "out")
    assert len(made) == 2
    for cell in made.values():
        assert "repeats" not in cell["wall_clock"] and "too few to retime" in cell["wall_clock"]["untimed"]


def test_retiming_one_task_leaves_the_next_tasks_documents_to_draw():
    """A model remembers the requests of its last call of each kind; a timed pass hands it one task's sample, so
    without restoring them, the next task of the same kind (chains_mc after chains_lambada) found none to draw and
    was never retimed."""
    class Receiving(Timed):
        def loglikelihood(self, requests):
            self.received["loglikelihood"] = requests
            return self.generate_until(requests)

    both = docs("a", 16) + docs("b", 16)
    lm = Receiving("cell", [1.0], [])
    lm.received = {"loglikelihood": both}
    retime.timed_pass(lm, [("loglikelihood", both[:2])])
    assert lm.received == {"loglikelihood": both}
    assert retime.draw(lm.received, [], "b", 16).work  # two documents of b's sixteen


def shown(rows) -> str:
    """run's summary table of `rows`, as a terminal wide enough not to fold it shows it."""
    from rich.console import Console

    from exitbench.analysis.tables import summary_table

    console = Console(record=True, width=200)
    console.print(summary_table(rows, "t"))
    return console.export_text()


def test_run_table_shows_the_schedule_only_where_cells_have_one():
    """run's table puts the schedule beside the overhead and explains it; for cells retimed before it existed the
    column is left out. (The slow test below renders it from a real sweep.)"""
    from exitbench.timing.speedup import SpeedUp

    def row(threshold, schedule):
        return {"task": "chains", "metric": "exact_match", "higher_is_better": True, "policy": "second_order",
                "threshold": threshold, "quality": 1.0, "mean_iterations": 11.1, "ms_per_token": 0.5,
                "probe_share": 0.06, "speedup": SpeedUp(1.0, "paired", 0.9, 1.1, 1.44), "warnings": [],
                "overhead": 1.38, "overhead_timing": "paired", "schedule": schedule}

    assert "schedule" in shown([row(0.1, 1.39)]) and "1.39×" in shown([row(0.1, 1.39)])
    assert "schedule" not in shown([row(0.1, None)])


# 8 s: two sweeps of tiny-raven; test_the_repeats_split_the_overhead_into_the_batches_schedule_and_the_step and
# test_run_table_shows_the_schedule_only_where_cells_have_one cover the same code fast
@pytest.mark.slow
def test_at_batch_size_one_a_rules_steps_are_its_iterations_and_in_a_batch_the_slowest_rows(tmp_path):
    """The schedule is the engine's own count, not a model of it: one row steps exactly as often as its tokens'
    iterations say (schedule 1 under any rule), while at batch size 16 second_order's rows exit apart and the
    batch steps on for its slowest (above 1); a fixed depth's batch loses nothing (1)."""
    from exitbench.sweep import SweepConfig, run_sweep

    got, made = {}, []
    for batch in (1, 16):
        cfg = SweepConfig(tasks=["chains"], policies=["second_order"], thresholds=[1.0], baselines=[4, 16],
                          limit=128, batch_size=batch, timing_repeats=1, quiet=True, out=tmp_path / f"b{batch}")
        made = run_sweep(cfg).cells
        for cell in made:
            got[(batch, cell["policy"]["policy"], cell["policy"]["threshold"])] = cell["wall_clock"]["repeats"]
    # run's table shows it beside the overhead, and leaves the column out for cells retimed before it existed
    from exitbench.sweep.run import summary_rows

    rows = summary_rows(made)
    batch16 = got[(16, "second_order", 1.0)]["schedule"]
    assert "schedule" in shown(rows) and f"{batch16:.2f}×" in shown(rows)
    assert "schedule" not in shown([{**r, "schedule": None} for r in rows])
    for batch in (1, 16):
        assert got[(batch, "fixed", 4)]["schedule"] == pytest.approx(1.0, rel=1e-12)
        assert got[(batch, "fixed", 4)]["steps_ratio"] == pytest.approx(4 / 16, rel=1e-12)
    assert got[(1, "second_order", 1.0)]["schedule"] == pytest.approx(1.0, rel=1e-12)
    assert got[(16, "second_order", 1.0)]["schedule"] > 1.1
