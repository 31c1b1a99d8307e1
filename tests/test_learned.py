"""The learned exit rule: its model file (any field, any value: accepted or one line), how cells key on it (read
once: a cell is computed with the very bytes its key names, also under --verify), and `exitbench fit-exit`
(documents kept apart from the evaluation, labels by the oracle's criterion, the fit, the file). The rule's signal
against its restated formula, and batched ≡ one at a time, run with every other policy in test_policies and
test_gpt2."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.policies.learned import check_fitted_for
from exitbench.studies.fit_exit import (
    drop_evaluation_overlap,
    fit,
    overlapping,
    record_rows,
    risk_of,
    write_exit_model,
)
from exitbench.policies.learned import FEATURES
from exitbench.sweep.config import SweepConfig, grid
from exitbench.sweep.keys import cell_key

from helpers.cli import assert_one_line_error, explain, runner
from helpers.engine import TEST_EXIT_MODEL, direct_trajectory, exit_model_file, learned_risk, tiny
from helpers.paths import GSM8K_DIR, REPO
from helpers.strategies import ANY_JSON

EXIT_MODEL = REPO / "results" / "exit-models" / "tiny-raven.json"  # the committed model fitted on tiny-raven


def _write(tmp_path, name="m.json", **changes):
    path = tmp_path / name
    path.write_text(json.dumps({**TEST_EXIT_MODEL, **changes}))
    return str(path)


# ---- the model file -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,words", [
    ({"schema": "other"}, ["not an exit model"]),
    ({"schema_version": 9}, ["schema version 9", "refit"]),
    ({"kind": "forest"}, ["kind", "forest"]),
    ({"features": ["log_step", "log_magic"] + TEST_EXIT_MODEL["features"][2:]}, ["unknown feature", "log_magic"]),
    ({"weights": [1.0]}, ["'weights'", "shape 4"]),
    ({"mean": [float("nan")] * 13}, ["'mean'"]),
    ({"scale": [0.0] * 13}, ["'scale'", "> 0"]),
    ({"bias": None}, ["'bias'"]),
])
def test_a_bad_exit_model_is_one_line(tmp_path, changes, words):
    with pytest.raises(ExitbenchError) as info:
        ExitConfig("learned", exit_model=_write(tmp_path, **changes))
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_missing_or_unreadable_exit_model(tmp_path):
    for path, words in ((tmp_path / "none.json", ["cannot read", "fit-exit"]), (tmp_path, ["cannot read"])):
        with pytest.raises(ExitbenchError, match="|".join(words)):
            ExitConfig("learned", exit_model=str(path))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ExitbenchError, match="not JSON"):
        ExitConfig("learned", exit_model=str(tmp_path / "x.json"))


def test_the_exit_model_knob_belongs_to_the_learned_rule(tmp_path):
    with pytest.raises(ExitbenchError, match="learned: needs --exit-model FILE"):
        ExitConfig("learned")
    with pytest.raises(ExitbenchError, match="second_order: --exit-model has no meaning.*learned"):
        ExitConfig("second_order", exit_model=exit_model_file())


def test_a_logistic_model_with_some_features_is_the_formula(tmp_path):
    names = ["log_k", "log_step", "prev_cos"]
    raw = {**TEST_EXIT_MODEL, "kind": "logistic", "features": names, "mean": [0.5, -2.0, 0.1],
           "scale": [2.0, 3.0, 0.5], "weights": [0.3, -1.2, 0.7], "bias": -0.4}
    for key in ("hidden_weights", "hidden_bias"):
        raw.pop(key)
    x = np.random.default_rng(1).normal(size=(50, len(FEATURES)))
    cols = [FEATURES.index(n) for n in names]
    z = ((x[:, cols] - raw["mean"]) / raw["scale"]) @ raw["weights"] + raw["bias"]
    np.testing.assert_allclose(risk_of(raw, x), 1 / (1 + np.exp(z)), rtol=1e-12)
    states = np.random.default_rng(2).normal(size=(9, 16)).astype(np.float32)
    got = learned_risk(states, raw)  # the restatement reads the same subset: cross-checks the helper too
    model = ExitConfig("learned", exit_model=_write(tmp_path, **raw)).build_policy()
    memory = model.start(torch.from_numpy(states[:1]), 0)
    want = [float(model.signal(torch.from_numpy(states[k:k + 1]), memory, None)) for k in range(1, 9)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["features", "kind", "mean", "scale", "weights", "bias", "hidden_bias",
                              "hidden_weights", "checkpoint", "schema_version"]), value=ANY_JSON)
def test_any_exit_model_field_is_accepted_or_one_line(tmp_path_factory, field, value):
    raw = json.loads(EXIT_MODEL.read_text())
    raw[field] = value
    path = tmp_path_factory.mktemp("em") / "exit.json"
    path.write_text(json.dumps(raw))
    try:
        ExitConfig("learned", exit_model=str(path))
    except ExitbenchError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)


# ---- cells key on the model's content ----------------------------------------------------------------------------
def test_cells_key_on_the_exit_model_content_not_its_path(tmp_path):
    a, b = _write(tmp_path, "a.json"), _write(tmp_path, "b.json")
    c = _write(tmp_path, "c.json", bias=0.3)
    model = {"fingerprint": "f", "dtype": "float32"}
    cfg = SweepConfig(tasks=["t"], policies=["learned"])
    keys = [cell_key(model, "t", "tf", ExitConfig("learned", threshold=0.1, exit_model=p), cfg, "cpu")
            for p in (a, b, c)]
    assert keys[0] == keys[1] and keys[0] != keys[2]
    assert keys[0]["exit"]["exit_model"].startswith("sha256:")
    # Cells of every other policy keep the key they had before the knob existed.
    assert "exit_model" not in ExitConfig("second_order").to_dict()


def test_all_policies_take_learned_only_with_a_model():
    names = {c.policy for c in grid(SweepConfig(tasks=["t"], policies=["all"]), 8)}
    assert "learned" not in names and "second_order" in names
    cfg = SweepConfig(tasks=["t"], policies=["all"], exit={"exit_model": exit_model_file()})
    configs = grid(cfg, 8)
    assert {c.policy for c in configs if c.exit_model} == {"learned"}
    assert any(c.policy == "second_order" for c in configs)


def test_a_cell_is_keyed_and_computed_from_the_same_exit_model_bytes(tmp_path):
    """The exit model is replaced after the sweep was planned: the cells must be computed with the model their
    key names (the one read at planning), not with the new file's."""
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.schedule import plan, run_cells
    from exitbench.harness.task_set import resolve_tasks

    model_file = tmp_path / "exit.json"
    shutil.copy(EXIT_MODEL, model_file)
    ck, tasks = open_checkpoint(None), resolve_tasks(["chains_lambada"])
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["learned"], thresholds=[0.2], baselines=[16], limit=4,
                      exit={"exit_model": str(model_file)})
    out = tmp_path / "out"
    planned = plan(ck, tasks, cfg, out, "cpu")
    raw = json.loads(model_file.read_text())
    raw["bias"] += 50.0  # a model that says "settled" everywhere: its exits would differ at once
    model_file.write_text(json.dumps(raw))
    made = [c for c in run_cells(ck, tasks, cfg, out, "cpu", sweep=planned) if c["policy"]["policy"] == "learned"]
    assert len(made) == 1
    keyed = made[0]["key"]["exit"]["exit_model"]
    assert keyed == "sha256:" + made[0]["policy"]["exit_model_sha256"], "computed with other bytes than keyed"


@pytest.mark.slow
def test_verify_reruns_the_learned_rule_with_the_model_it_replayed(tmp_path):
    """A replay cell's key names the exit model by its sha256; --verify must rerun the sweep's own config,
    not one rebuilt from the key (which would look for a file called sha256:…). Slow (5 s): the fast
    `test_a_cell_is_keyed_and_computed_from_the_same_exit_model_bytes` covers the config that holds the model."""
    res = runner.invoke(app, ["run", "--tasks", "chains_lambada", "--policy", "learned", "--exit-model",
                              str(EXIT_MODEL), "--thresholds", "0.2", "--baselines", "16", "--limit", "2",
                              "--replay", "--verify", "--quiet", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, explain(res)
    verified = json.loads((tmp_path / "o" / "verify" / "replay-vs-exact.json").read_text())["rows"]
    assert [r["policy"] for r in verified] == ["learned"]


# ---- fit-exit -----------------------------------------------------------------------------------------------------
def test_documents_that_begin_with_an_evaluation_document_are_dropped():
    docs = [[1, 5, 6, 7, 8], [1, 5, 6], [1, 9, 9, 9], [1, 5, 7]]
    evals = [[1, 5, 6], [1, 2]]
    assert overlapping(docs, evals) == [True, True, False, False]
    kept, record = drop_evaluation_overlap(docs, {"t": evals})
    assert kept == [[1, 9, 9, 9], [1, 5, 7]] and record == {"checked_against": ["t"], "dropped": {"t": 2}}


def _gsm8k_head(folder, lines: int):
    """The first `lines` of each GSM8K split, as a --data-dir."""
    folder.mkdir()
    for split in ("train", "test"):
        head = (GSM8K_DIR / f"{split}.jsonl").read_text().splitlines()[:lines]
        (folder / f"{split}.jsonl").write_text("\n".join(head) + "\n")
    return folder


# All of GSM8K (8,800 documents, 8 s of lm-eval's templating) with the slow tests; its first 40 per split fast.
@pytest.mark.parametrize("lines", [40, pytest.param(None, marks=pytest.mark.slow)], ids=["head", "all"])
def test_fitting_documents_come_from_the_split_that_is_not_evaluated(lines, tmp_path):
    from exitbench.harness.documents import task_documents

    data = GSM8K_DIR if lines is None else _gsm8k_head(tmp_path / "gsm8k", lines)
    fitting = task_documents("gsm8k_text", str(data), split="fitting")
    evaluation = task_documents("gsm8k_text", str(data))
    assert len(evaluation) == len((data / "test.jsonl").read_text().splitlines())
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(fitting) == len(train) and fitting[0].startswith(train[0]["question"])
    assert not set(fitting) & set(evaluation)
    with pytest.raises(ExitbenchError, match="chains has no training or validation split"):
        task_documents("chains", split="fitting")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny(mean=6, max_rec=8)


def test_rows_hold_the_rules_features_and_the_oracles_labels(tiny_model):
    """Position 0 of [t0, t1]: features against the restated formula (through the test model's risk), labels
    against the argmax of a direct trajectory (settled at k: the argmax at k and after equals the one at K)."""
    K = 6
    t0s = [5, 23, 42]
    rows = record_rows(tiny_model, [[t, 7] for t in t0s], seed=0, batch_size=3)
    eng = ExitEngine(tiny_model, ExitConfig("fixed", threshold=K))
    x = tiny_model.embed(torch.zeros(1, 1, dtype=torch.long))
    noise = eng.noise.rows(0, 1, x.dtype, x.device)[0]
    states, logps = direct_trajectory(tiny_model, t0s, K, noise)
    first = rows.token == rows.token.min()  # the three documents' position-0 tokens
    for i in range(3):
        mine = (rows.doc == i) & (rows.token == rows.token[rows.doc == i].min())
        assert first.sum() == K and mine.sum() == K
        top = logps[i].argmax(-1)
        want = [bool(np.all(top[k:] == top[-1])) for k in range(K)]
        assert rows.y[mine].astype(bool).tolist() == want
        np.testing.assert_allclose(risk_of(TEST_EXIT_MODEL, rows.x[mine]), learned_risk(states[i]),
                                   rtol=0, atol=1e-4)  # the batch-shape noise of test_policies' ATOL


def test_fit_writes_a_model_the_rule_reads(tiny_model, tmp_path):
    docs = [[1 + (7 * i + 3 * j) % 40 for j in range(10)] for i in range(12)]
    content = fit(tiny_model, docs, kind="logistic", thresholds=(0.5, 0.1))
    v = content["metrics"]["validation"]
    assert content["data"]["documents"] == 12 and content["data"]["rows"] == 12 * 9 * 6  # 9 predicted positions × 6 iterations
    assert 0 <= v["auc"] <= 1 and v["log_loss"] > 0 and len(v["by_threshold"]) == 2
    assert set(content["metrics"]["permutation_log_loss_increase"]) == set(FEATURES)
    content["checkpoint"] = {"fingerprint": "abc", "path": "somewhere"}
    path = write_exit_model(content, tmp_path / "fit.json")
    ExitEngine(tiny_model, ExitConfig("learned", threshold=0.5, exit_model=str(path))).score([(docs[0], 3)])


def test_an_exit_model_from_another_checkpoint_is_refused(tmp_path):
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    with pytest.raises(ExitbenchError, match="was fitted on checkpoint test .*fit-exit -c"):
        check_fitted_for(ck, exit_model_file())


def test_fit_exit_refuses_too_few_documents_in_one_line(tmp_path):
    res = runner.invoke(__import__("exitbench.cli", fromlist=["app"]).app,
                        ["fit-exit", "--limit", "1", "--out", str(tmp_path / "m.json")])
    assert_one_line_error(res, ["--limit must be ≥ 2"])


@pytest.mark.slow  # 5 s: fit-exit then run through the CLI; fitting and reading the model stay fast (above)
def test_fit_exit_then_run_learned(tmp_path):
    from helpers.cli import run_ok
    from helpers.cells import load_cells
    from exitbench.cli import app

    path = tmp_path / "raven.json"
    res = runner.invoke(app, ["fit-exit", "--limit", "32", "--kind", "logistic", "--out", str(path)])
    assert res.exit_code == 0, res.output
    raw = json.loads(path.read_text())
    assert raw["source"]["disjoint_from_evaluation"]["checked_against"] == ["chains"]
    assert raw["source"]["heldout_programs"] == 32 and len(raw["source"]["sha256"]) == 64
    assert raw["run"]["git_revision"] and raw["checkpoint"]["fingerprint"]
    run_ok("--policy", "learned", "--exit-model", str(path), "--tasks", "chains_lambada", "--limit", "16",
           "--thresholds", "0.3,0.1", "--out", str(tmp_path / "cells"), "--replay")
    cells = [c for c in load_cells(tmp_path / "cells").values() if c["policy"]["policy"] == "learned"]
    assert len(cells) == 2 and all(c["key"]["exit"]["exit_model"].startswith("sha256:") for c in cells)
    assert all(c["policy"]["exit_model_sha256"] == c["key"]["exit"]["exit_model"][7:] for c in cells)
