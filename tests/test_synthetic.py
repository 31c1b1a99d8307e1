"""The synthetic task, its shipped data, and the depth properties the embedded checkpoint promises."""
from __future__ import annotations

import random

import pytest
from typer.testing import CliRunner

from exitbench.models import checkpoint, embedded
from exitbench.training import synthetic
from exitbench.cli import app
from exitbench.studies.depth import depth_report

from helpers.paths import TASKS_DIR


def test_programs_are_well_formed_chains():
    task = synthetic.ChainTask(n_chains=3, length=5)
    program = task.sample(random.Random(0))
    assert len(program.statements) == 15 and sorted(program.hops) == sorted(list(range(1, 6)) * 3)
    bound: dict[str, int] = {}
    for stmt, value, hop in zip(program.statements, program.values, program.hops):
        lhs, rhs = stmt.split("=")
        assert lhs not in bound, "each variable is bound once"
        expected = int(rhs) if rhs.isdigit() else bound[rhs]  # rhs is always defined earlier in its chain
        assert value == expected
        assert (hop == 1) == rhs.isdigit()
        bound[lhs] = value


def test_encoding_puts_values_only_at_the_end():
    tok = synthetic.build_tokenizer()
    program = synthetic.ChainTask(2, 4).sample(random.Random(1))
    inputs, targets = synthetic.encode_program(program, tok)
    digits = {tok.encode(d)[0] for d in synthetic.DIGITS}
    assert inputs[0] == synthetic.BOS and targets[0] == synthetic.IGNORE
    assert not digits & set(inputs[1:-1]), "values never appear among the statements"
    assert inputs[-1] in digits and targets[-1] == synthetic.EOS
    assert [tok.decode([t]) for t in targets[1:-1]] == [str(v) for v in program.values]


def test_bad_task_options():
    with pytest.raises(Exception, match="names"):
        synthetic.ChainTask(n_chains=10, length=10)
    with pytest.raises(Exception, match="unknown training task"):
        synthetic.make_task("sudoku")


def test_shipped_task_data_is_what_the_generator_writes(tmp_path):
    fresh = tmp_path / "test.jsonl"
    synthetic.write_task_data(fresh)
    assert fresh.read_text() == (TASKS_DIR / "chains" / "test.jsonl").read_text()


@pytest.fixture(scope="module")
def embedded_depth():
    if not embedded.embedded_names():
        pytest.skip("no embedded checkpoint")
    return depth_report(checkpoint.open_checkpoint(None), r_values=(1, 2, 4, 7, 8, 16, 32), n_programs=64)


def test_embedded_model_needs_its_iterations(embedded_depth):
    by_r = {row["r"]: row for row in embedded_depth["by_r"]}
    hardest = embedded_depth["levels"]
    top = max(by_r)
    plateau = by_r[top]["accuracy_by_hop"][hardest]
    assert plateau - by_r[1]["accuracy_by_hop"][hardest] >= 0.30
    assert plateau - by_r[7]["accuracy_by_hop"][hardest] >= 0.20, "the hardest level needs ≥ 8 iterations"
    assert by_r[32]["accuracy_by_hop"][hardest] >= by_r[16]["accuracy_by_hop"][hardest] - 0.02, "no collapse at 2× mean"
    accs = [by_r[r]["accuracy"] for r in sorted(by_r)]
    assert all(b >= a - 0.01 for a, b in zip(accs, accs[1:])), "accuracy rises with r until it saturates"
    assert by_r[1]["answer_perplexity"] >= 2 * by_r[top]["answer_perplexity"]


def test_embedded_iterates_converge(embedded_depth):
    norms = {row["k"]: row["mean"] for row in embedded_depth["step_norm"]}
    assert norms[max(norms)] <= 0.10 * norms[2]


def test_info_depth_cli_prints_the_tables():
    if not embedded.embedded_names():
        pytest.skip("no embedded checkpoint")
    res = CliRunner().invoke(app, ["info", "--depth", "--programs", "8"])
    assert res.exit_code == 0, res.stderr
    assert "accuracy by hop vs r" in res.stdout and "hop 12" in res.stdout and "step norm" in res.stdout
    res = CliRunner().invoke(app, ["info", "--depth", "--programs", "0"])
    assert res.exit_code == 2 and "--programs" in res.stderr
