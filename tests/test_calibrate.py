"""`exitbench calibrate`: the statistics against closed forms and simulation, the losses against an independent
computation on the engine, and the command's report and errors."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from typer.testing import CliRunner

from exitbench.studies.calibrate import (
    binom_cdf,
    calibrate,
    conservative_order,
    disagreement,
    documents_needed,
    fixed_sequence,
    hb_pvalue,
    split,
)
from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError

from helpers.cli import assert_one_line_error
from helpers.engine import tiny

runner = CliRunner()


# ---- statistics --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,p", [(1, 0.3), (10, 0.05), (40, 0.5), (300, 0.02)])
def test_binom_cdf_matches_the_direct_sum(n, p):
    for k in range(0, n + 1, max(1, n // 7)):
        want = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(want, rel=1e-9, abs=1e-300)
    assert binom_cdf(-1, n, p) == 0.0 and binom_cdf(n, n, p) == 1.0


def test_hb_pvalue_closed_forms():
    # No loss at all: the Hoeffding term is (1 − ε)^n, the Bentkus term e·(1 − ε)^n; the minimum is the first.
    assert hb_pvalue(0.0, 50, 0.05) == pytest.approx(0.95 ** 50, rel=1e-12)
    # At or above ε nothing can be shown.
    assert hb_pvalue(0.05, 1000, 0.05) == 1.0 and hb_pvalue(0.2, 1000, 0.05) == 1.0
    # More documents with the same mean loss give a smaller p-value.
    ps = [hb_pvalue(0.02, n, 0.05) for n in (50, 100, 400, 1600)]
    assert ps == sorted(ps, reverse=True) and ps[-1] < 1e-6
    # Never above the plain Hoeffding bound exp(−2n(ε − r)²).
    for r in (0.0, 0.01, 0.03, 0.049):
        assert hb_pvalue(r, 200, 0.05) <= math.exp(-2 * 200 * (0.05 - r) ** 2) + 1e-15


@pytest.mark.parametrize("eps,delta", [(0.05, 0.1), (0.01, 0.05), (0.2, 0.01)])
def test_documents_needed_is_where_zero_loss_first_passes(eps, delta):
    n = documents_needed(eps, delta)
    assert hb_pvalue(0.0, n, eps) <= delta < hb_pvalue(0.0, n - 1, eps)


def test_fixed_sequence_stops_at_the_first_failure():
    assert fixed_sequence([0.01, 0.02, 0.5, 0.01], 0.1) == 2
    assert fixed_sequence([0.2, 0.01], 0.1) == 0
    assert fixed_sequence([0.1, 0.1], 0.1) == 2
    assert fixed_sequence([], 0.1) == 0


def test_conservative_order_follows_the_rule_direction():
    assert conservative_order("second_order", [1.0, 1e-3, 0.1]) == [1e-3, 0.1, 1.0]  # exits when signal < τ
    assert conservative_order("confidence", [0.5, 0.99, 0.9]) == [0.99, 0.9, 0.5]  # exits when max p ≥ τ
    assert conservative_order("argmax_stability", [2, 5, 3]) == [5, 3, 2]  # exits after τ unchanged steps


def _simulate(true_risks, accept, n_docs=100, trials=600, seed=0):
    """Per trial, draw each threshold's n_docs Bernoulli(risk) document losses and let `accept(mean)` decide in
    fixed sequence; returns how many thresholds each trial got past."""
    gen = torch.Generator().manual_seed(seed)
    reached = []
    for _ in range(trials):
        k = 0
        for r in true_risks:
            if not accept(float(torch.bernoulli(torch.full((n_docs,), r), generator=gen).mean())):
                break
            k += 1
        reached.append(k)
    return reached


def test_the_guarantee_holds_in_simulation():
    """Thresholds with known true risks around ε. Over many calibration draws the chosen threshold's true risk
    exceeds ε in at most δ of them (plus three binomial standard deviations of trial noise). The same check
    catches a procedure without the guarantee (accept while the empirical risk is ≤ ε), and the valid one is
    not vacuous: it usually gets past the clearly safe thresholds."""
    risks = [0.0, 0.01, 0.045, 0.055, 0.07, 0.1]
    eps, delta, n, trials = 0.05, 0.1, 100, 600
    bound = delta + 3 * math.sqrt(delta * (1 - delta) / trials)

    def violation_rate(reached):
        return sum(k > 0 and risks[k - 1] > eps for k in reached) / trials

    valid = _simulate(risks, lambda m: hb_pvalue(m, n, eps) <= delta, n, trials)
    naive = _simulate(risks, lambda m: m <= eps, n, trials)
    assert violation_rate(valid) <= bound
    assert violation_rate(naive) > bound  # the check can fail
    assert sum(k >= 2 for k in valid) / trials > 0.5  # risk 0.01 passes in most draws


def test_split_is_seeded_and_disjoint():
    docs = [[i, i + 1] for i in range(10)]
    cal, test = split(docs, 0.3, seed=1)
    assert len(cal) == 7 and len(test) == 3
    assert sorted(map(tuple, cal + test)) == sorted(map(tuple, docs))
    assert split(docs, 0.3, seed=1) == (cal, test) and split(docs, 0.3, seed=2) != (cal, test)
    assert split(docs, 0.0, seed=1) == (docs, [])


def test_disagreement_per_document():
    assert disagreement([[1, 2, 3, 4], [5]], [[1, 2, 0, 0], [5]]) == [0.5, 0.0]


# ---- on the engine -----------------------------------------------------------------------------------------
def _docs(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 100) for _ in range(length)] for _ in range(n)]


def test_risks_are_the_disagreement_with_full_depth():
    model = tiny(init_scale=1.0)
    docs = _docs(24, 6, 0)
    taus = [1e-30, 0.3, 3.0]
    ticks = []
    rep = calibrate(model, docs, ExitConfig("first_order", max_steps=8), taus, epsilon=0.3, delta=0.2,
                    test_fraction=0.25, seed=3, batch_size=5, on_progress=lambda d, t: ticks.append((d, t)))
    assert [d for d, _ in ticks] == list(range(1, len(ticks) + 1)) and ticks[-1][0] == ticks[-1][1]
    cal, test = split(docs, 0.25, 3)
    assert rep["documents"] == {"calibration": len(cal), "held_out": len(test)}

    def argmaxes(cfg):
        eng = ExitEngine(model, cfg)
        out, its = [], []
        for d in cal:  # one at a time: batching must not matter
            [res] = eng.score([(d, 1)], keep_distributions=True)
            out.append([int(lp.argmax()) for lp in res.distributions])
            its += [r.exit_steps[0] for r in res.records]
        return out, sum(its) / len(its)

    ref, full = argmaxes(ExitConfig("fixed", threshold=8))
    assert rep["full_depth_iterations"] == full == 8
    assert [r["threshold"] for r in rep["thresholds"]] == taus  # exits below τ: smallest first
    for row in rep["thresholds"]:
        preds, mean_its = argmaxes(ExitConfig("first_order", threshold=row["threshold"], max_steps=8))
        want = sum(sum(a != b for a, b in zip(p, r)) / len(r) for p, r in zip(preds, ref)) / len(cal)
        assert row["risk"] == pytest.approx(want, abs=1e-12)
        assert row["mean_iterations"] == pytest.approx(mean_its)
        assert row["p_value"] == pytest.approx(hb_pvalue(want, len(cal), 0.3))
    first = rep["thresholds"][0]
    assert first["risk"] == 0 and first["mean_iterations"] == 8  # τ = 1e-30 never fires: it is full depth
    # The grid spans risks from none to most tokens, so the choice is a real one.
    assert rep["thresholds"][-1]["risk"] > 0.3
    k = fixed_sequence([r["p_value"] for r in rep["thresholds"]], 0.2)
    assert [r["accepted"] for r in rep["thresholds"]] == [i < k for i in range(3)]
    assert rep["chosen"] == (rep["thresholds"][k - 1] if k else None)
    if rep["chosen"] is not None:
        assert rep["held_out"]["documents"] == len(test) and 0 <= rep["held_out"]["risk"] <= 1


def test_replay_calibration_reads_every_threshold_from_one_recording():
    """Same grid, same reference; a one-token document is replayed exactly, so its risks and iterations are the
    exact run's; on whole documents replay reads other tokens at their own iteration (README, "Replay")."""
    model = tiny(init_scale=1.0)
    taus = [1e-30, 0.3, 3.0]
    config = ExitConfig("first_order", max_steps=8)
    pairs = _docs(16, 2, 1)  # two tokens: one scored position per document
    exact = calibrate(model, pairs, config, taus, epsilon=0.3, delta=0.2, test_fraction=0.25, seed=3)
    replayed = calibrate(model, pairs, config, taus, epsilon=0.3, delta=0.2, test_fraction=0.25, seed=3,
                         replay=True)
    assert replayed["mode"] == "replay" and exact["mode"] == "exact"
    for a, b in zip(exact["thresholds"], replayed["thresholds"]):
        assert b["risk"] == pytest.approx(a["risk"], abs=1e-12)
        assert b["mean_iterations"] == pytest.approx(a["mean_iterations"])
    assert replayed["chosen"] == exact["chosen"]


def test_calibration_under_a_kv_window_compares_with_full_depth_under_the_same_window():
    model = tiny(init_scale=1.0)
    docs = _docs(12, 6, 0)
    config = ExitConfig("first_order", max_steps=8, kv_window=2)
    rep = calibrate(model, docs, config, [1e-30, 3.0], epsilon=0.3, delta=0.2, test_fraction=0.25, seed=3)
    assert rep["config"]["kv_window"] == 2
    assert rep["reference"]["policy"] == "fixed" and rep["reference"]["threshold"] == 8
    assert rep["reference"]["kv_window"] == 2
    # τ = 1e-30 never fires: full depth under the window, the reference itself, so no token disagrees.
    assert rep["thresholds"][0]["risk"] == 0 and rep["thresholds"][0]["mean_iterations"] == 8
    with pytest.raises(ExitbenchError, match="cannot replay --kv-window"):
        calibrate(model, docs, config, [0.3], epsilon=0.3, delta=0.2, replay=True)


@pytest.mark.parametrize("kwargs,words", [
    (dict(epsilon=0.0), ["--epsilon", "between 0 and 1"]),
    (dict(epsilon=1.5), ["--epsilon"]),
    (dict(delta=1.0), ["--delta"]),
    (dict(test_fraction=1.0), ["--test-fraction"]),
    (dict(batch_size=0), ["--batch-size"]),
    (dict(thresholds=[]), ["no threshold grid"]),
    (dict(policy="oracle"), ["oracle", "cannot be calibrated"]),
    (dict(policy="fixed"), ["fixed", "no threshold"]),
    (dict(thresholds=[-1.0]), ["threshold", "> 0"]),
])
def test_bad_arguments(kwargs, words):
    model = tiny()
    args = dict(epsilon=0.1, delta=0.1, test_fraction=0.5, batch_size=4, thresholds=[0.1])
    args.update(kwargs)
    policy, thresholds = args.pop("policy", "first_order"), args.pop("thresholds")
    with pytest.raises(ExitbenchError) as err:
        calibrate(model, _docs(4, 4, 0), ExitConfig(policy), thresholds, **args)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ---- the command -------------------------------------------------------------------------------------------
@pytest.mark.slow  # 17 s: 120 programs at full depth and at four thresholds; the same command on 40 programs
# (test_too_few_documents_says_how_many_are_needed) and on a text file (test_command_on_a_text_file) stay fast
def test_command_on_the_embedded_model(tmp_path):
    out = tmp_path / "cal.json"
    res = runner.invoke(app, ["calibrate", "--policy", "second_order", "--programs", "120", "--thresholds",
                              "1e-3,0.1,0.3,1", "--epsilon", "0.05", "--delta", "0.1", "--out", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(out.read_text())
    assert rep["schema"] == "exitbench.calibration" and rep["checkpoint"].endswith("tiny-raven")
    assert rep["source"] == {"heldout_programs": 120, "seed": 0}
    assert rep["documents"] == {"calibration": 60, "held_out": 60}
    assert {"seed", "versions", "git_revision", "machine"} <= set(rep["run"])
    rows = rep["thresholds"]
    assert [r["threshold"] for r in rows] == [1e-3, 0.1, 0.3, 1.0]
    its = [r["mean_iterations"] for r in rows]
    assert its == sorted(its, reverse=True) and its[0] < 16  # later thresholds exit earlier, all save something
    # On the embedded model τ = 1 disagrees with full depth on a sixth of the tokens: it cannot be safe.
    assert rows[-1]["risk"] > 0.1 and not rows[-1]["accepted"]
    chosen = rep["chosen"]
    assert chosen is not None and chosen["risk"] <= 0.05 and chosen["mean_iterations"] < 12
    assert "chosen" in res.stdout and "held out (60 documents)" in res.stdout


def test_command_on_a_text_file(tmp_path, tiny_checkpoint):
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(["the cat sat on the mat and the dog ran fast"] * 30))
    res = runner.invoke(app, ["calibrate", "-c", str(tiny_checkpoint), "--text", str(text), "--policy", "kl",
                              "--thresholds", "1e-6,1e-2", "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads((tmp_path / "o.json").read_text())
    assert rep["source"] == {"text": str(text)} and rep["documents"]["calibration"] == 15


@pytest.mark.slow  # 4 s of a real run; documents_needed itself is checked fast above
def test_too_few_documents_says_how_many_are_needed(tmp_path):
    res = runner.invoke(app, ["calibrate", "--programs", "40", "--thresholds", "1e-3", "--out",
                              str(tmp_path / "c.json")])
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads((tmp_path / "c.json").read_text())
    assert rep["chosen"] is None and rep["thresholds"][0]["risk"] == 0  # safe, but 20 documents cannot show it
    assert rep["documents_needed"] == 45
    assert "at least 45" in " ".join(res.stdout.split())


@pytest.mark.parametrize("args,words", [
    (["--policy", "oracle"], ["oracle", "cannot be calibrated"]),
    (["--policy", "second_ordr"], ["second_ordr", "second_order"]),
    (["--epsilon", "2"], ["--epsilon"]),
    (["--thresholds", "0.1,x"], ["--thresholds", "'x'"]),
    (["--task", "chains", "--text", "f.txt"], ["--task or --text"]),
    (["--text", "/nonexistent/f.txt"], ["--text", "not a readable file"]),
])
def test_command_errors_are_one_line(args, words):
    res = runner.invoke(app, ["calibrate", *args])
    assert_one_line_error(res, words)


def test_the_default_grid_leaves_out_thresholds_at_which_the_rule_cannot_exit():
    """argmax_stability's grid is 1, 2, 3, 5, 8; on three passes only τ = 1 can exit before the last, so calibrate
    chooses among it alone. A threshold typed that cannot exit is refused (tests/test_cli_errors.py)."""
    from pathlib import Path

    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.studies.calibrate import grid_for

    inkling = open_checkpoint(str(Path(__file__).parent / "fixtures" / "inkling2-tiny")).model
    assert grid_for(inkling, ExitConfig("argmax_stability")) == [1]
    assert grid_for(tiny(), ExitConfig("argmax_stability", max_steps=6)) == [1, 2, 3]
