"""Trust, round three: what the readers of cells, samples, exit configs and exit models promise.

- a cell is keyed and computed from the same exit-model bytes, whatever happens to the file in between;
- `check` that compared nothing has not passed (exit 2, saying along which dimensions the sweeps differ);
- cells of different models never meet in one check, frontier or report unless one model is picked;
- `check` knows the learned rule by its exit model's content, not by the file's path;
- exit knobs are typed: "no" is not true, 3 is not a boolean, `5e-4` is a number;
- every file a reader takes (cells, samples files) is checked at the door: whatever its fields hold, the
  command ends normally or with one line and exit code 2, never a traceback, and writes nothing.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from exitbench.store import cells
from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.engine.config import ExitConfig

from helpers.cli import assert_one_line_error, explain
from helpers.paths import REPO

runner = CliRunner()
BASELINE = REPO / "results" / "baseline"
EXIT_MODEL = REPO / "results" / "exit-models" / "tiny-raven.json"


def baseline_cells(task: str = "chains_mc", series: tuple[str, ...] = ("fixed", "kl", "oracle")) -> list[Path]:
    """A few committed cells of one task: enough for a frontier, a full depth and an oracle."""
    return sorted(p for p in BASELINE.glob(f"{task}__*.json")
                  if any(p.name.startswith(f"{task}__{s}-") for s in series))


def copy_cells(dst: Path, paths: list[Path], change=None, renamed: bool = False) -> Path:
    """The cells copied into `dst`, each passed through `change(cell)` first (which may edit it in place), under
    its own name, or (`renamed`) under the name its new content gives it."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in paths:
        cell = json.loads(p.read_text())
        if change is not None:
            change(cell)
        (dst / (cells.filename(cell) if renamed else p.name)).write_text(json.dumps(cell))
    return dst


def another_model(cell: dict) -> None:
    """The same cell as if another checkpoint had made it (its own fingerprint, key and id)."""
    cell["model"]["fingerprint"] = "feedfacefeedface"
    cell["model"]["source"] = "/ckpt/other-model"
    cell["model"]["path"] = "/ckpt/other-model"
    cell["key"]["model"] = "feedfacefeedface"
    cell["cell_id"] = cells.cell_id(cell["key"])


def one_line(args: list[str], capfd, words=()) -> str:
    capfd.readouterr()
    res = runner.invoke(app, args)
    return assert_one_line_error(res, words, fd=capfd.readouterr())


# ---- 2. one read of the exit model ---------------------------------------------------------------------------------
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


# ---- 3. a check that compared nothing ---------------------------------------------------------------------------
def test_check_that_compares_nothing_is_exit_2_and_says_why(tmp_path, capfd):
    def other_limit(cell):
        cell["task"]["limit"] = 20
    run = copy_cells(tmp_path / "run", baseline_cells(), other_limit)
    base = copy_cells(tmp_path / "base", baseline_cells())
    for extra in ([], ["--present-only"]):
        line = one_line(["check", str(run), "--baseline", str(base), *extra], capfd, ["nothing to check", "limit"])
        assert "20" in line and "48" in line

    def every_document(cell):
        cell["task"]["limit"] = None
    run = copy_cells(tmp_path / "all", baseline_cells(), every_document)
    line = one_line(["check", str(run), "--baseline", str(base)], capfd, ["nothing to check", "limit"])
    assert "limit (run: all documents; baseline: 48)" in line and "None" not in line


# ---- 4. cells of different models ---------------------------------------------------------------------------------
def test_a_directory_of_two_models_is_refused_unless_one_is_picked(tmp_path, capfd):
    mixed = copy_cells(tmp_path / "mixed", baseline_cells())
    copy_cells(mixed, baseline_cells(), another_model, renamed=True)
    assert len(list(mixed.glob("*.json"))) == 2 * len(baseline_cells())
    for args in (["pareto", str(mixed)], ["check", str(mixed), "--baseline", str(BASELINE)],
                 ["report", str(mixed), "--out", str(tmp_path / "r.html")]):
        one_line(args, capfd, ["2 models", "feedfacefeedface", "--model"])
    assert not (tmp_path / "r.html").exists()
    res = runner.invoke(app, ["pareto", str(mixed), "--model", "feedface", "--format", "json"])
    assert res.exit_code == 0, explain(res)
    res = runner.invoke(app, ["check", str(mixed), "--model", "tiny-raven", "--baseline", str(BASELINE),
                              "--present-only"])
    assert res.exit_code == 0, explain(res)
    one_line(["pareto", str(mixed), "--model", "nope"], capfd, ["--model", "'nope'"])


def test_pareto_names_the_model(tmp_path):
    res = runner.invoke(app, ["pareto", str(copy_cells(tmp_path / "c", baseline_cells())), "--format", "json"])
    assert res.exit_code == 0 and "model: embedded:tiny-raven" in res.stderr
    json.loads(res.stdout)  # the model's name goes to stderr: stdout stays the table a script reads


# ---- 5. the learned rule by content --------------------------------------------------------------------------------
def test_check_matches_the_learned_rule_by_its_exit_models_content(tmp_path):
    def learned_at(path):
        def change(cell):
            cell["policy"].update(policy="learned", exit_model=path, exit_model_sha256="ab" * 32)
            cell["key"]["exit"].update(policy="learned", exit_model="sha256:" + "ab" * 32)
        return change
    kl = [p for p in baseline_cells() if "__kl-" in p.name][:1]
    run = copy_cells(tmp_path / "run", baseline_cells(series=("fixed",)) + kl, None)
    base = copy_cells(tmp_path / "base", baseline_cells(series=("fixed",)), None)
    copy_cells(run, kl, learned_at("/home/a/exit.json"), renamed=True)
    copy_cells(base, kl, learned_at("/home/b/copy-of-exit.json"), renamed=True)
    res = runner.invoke(app, ["check", str(run), "--baseline", str(base)])
    assert res.exit_code == 0, explain(res)


# ---- 6. typed exit knobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("policy: second_order\nrelative: \"no\"\n", ["relative", "'no'"]),
    ("policy: second_order\nrelative: no_thanks\n", ["relative"]),
    ("policy: kl\nwarm_start: 3\n", ["warm_start", "3"]),
    ("policy: kl\npatience: true\n", ["patience", "True"]),
    ("policy: kl\nseed: abc\n", ["seed", "'abc'"]),
    ("policy: [kl]\n", ["policy", "['kl']"]),
    ("policy: kl\nmin_steps: 2.5\n", ["min_steps", "2.5"]),
])
def test_exit_config_values_are_typed(tmp_path, capfd, text, words):
    path = tmp_path / "exit.yaml"
    path.write_text(text)
    one_line(["trace", "a=1 b=a", "--exit-config", str(path)], capfd, words)


def test_a_threshold_written_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "exit.yaml"
    path.write_text("policy: kl\nthreshold: 5e-4\n")
    assert ExitConfig.from_yaml(path).threshold == 5e-4


def test_lm_eval_model_args_are_typed():
    """lm-eval's parser turns true/false into booleans and leaves other words as strings."""
    from lm_eval.utils import simple_parse_args_string

    from exitbench.harness.cli import check_model_args

    with pytest.raises(ExitbenchError, match="relative.*'no'"):
        check_model_args(simple_parse_args_string("policy=second_order,relative=no"))
    with pytest.raises(ExitbenchError, match="allow_nonfinite.*'no'"):
        check_model_args(simple_parse_args_string("policy=kl,allow_nonfinite=no"))
    check_model_args(simple_parse_args_string("policy=second_order,relative=True,threshold=1e-3,batch_size=auto"))


# ---- every reader at its door: mutated cells and samples files ---------------------------------------------------------
# A value of each kind a JSON field can hold, none of them of a cell's own types everywhere.
WRONG_VALUES = st.sampled_from(["0.9", "", None, True, [], [1, 2], {}, {"a": 1}, -1, 1e308, "kl"])
# Fields readers use (section, field): each mutation replaces one of them.
FIELDS = [("quality", "value"), ("quality", "metric"), ("quality", "higher_is_better"), ("policy", "policy"),
          ("policy", "threshold"), ("policy", "relative"), ("policy", "max_steps"), ("task", "name"),
          ("task", "limit"), ("task", "metrics"), ("task", "primary_metric"), ("iterations", "mean"),
          ("iterations", "tokens"), ("iterations", "histogram"), ("wall_clock", "per_token_s"),
          ("flops", "per_token"), ("model", "fingerprint"), ("run", "started"), ("", "cell_id"), ("", "model"),
          ("", "mode"), ("numerics", "nonfinite_tokens")]
READERS = {
    "pareto": lambda d, t: ["pareto", str(d)],
    "check": lambda d, t: ["check", str(d), "--baseline", str(BASELINE), "--present-only"],
    "report": lambda d, t: ["report", str(d), "--out", str(t / "report.html")],
}


def assert_clean_end(res, fd, written: Path | None = None, verdicts=(0,)):
    """Ended with one of `verdicts` (check's 1 is "regressed", a verdict), or with exactly one `error:` line and
    exit 2; never a traceback."""
    text = res.stdout + res.stderr + fd.out + fd.err
    assert "Traceback" not in text, explain(res)
    if res.exit_code not in verdicts:
        assert_one_line_error(res, fd=fd)
        if written is not None:
            assert not written.exists()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=WRONG_VALUES, reader=st.sampled_from(sorted(READERS)))
def test_a_mutated_cell_never_crashes_a_reader(tmp_path_factory, capfd, field, value, reader):
    tmp = tmp_path_factory.mktemp("mutated")

    def mutate(cell):
        section, name = field
        (cell if not section else cell[section])[name] = value
    d = copy_cells(tmp / "cells", baseline_cells()[:1])
    copy_cells(d, baseline_cells()[1:])
    copy_cells(d, baseline_cells()[:1], mutate)
    capfd.readouterr()
    res = runner.invoke(app, READERS[reader](d, tmp))
    assert_clean_end(res, capfd.readouterr(), tmp / "report.html", (0, 1) if reader == "check" else (0,))


def test_a_cell_of_the_wrong_type_is_named(tmp_path, capfd):
    def quality_text(cell):
        cell["quality"]["value"] = "0.9"
    d = copy_cells(tmp_path / "c", baseline_cells(), quality_text)
    one_line(["pareto", str(d)], capfd, ["broken cell", "quality.value", "'0.9'"])


def test_a_reusing_run_names_a_broken_cell(tmp_path, capfd):
    """The run summary reads reused cells too: a cell of the wrong type there is one line before compute."""
    def policy_number(cell):
        cell["policy"]["policy"] = 7
    d = copy_cells(tmp_path / "c", baseline_cells(series=("fixed",)), policy_number)
    one_line(["run", "--tasks", "chains_mc", "--policy", "kl", "--baselines", "16", "--limit", "4", "--quiet",
              "--out", str(d)], capfd, ["broken cell", "policy.policy"])


def sampled_sweep(tmp: Path) -> Path:
    """A small sweep with samples files: two policies on one task."""
    out = tmp / "sampled"
    res = runner.invoke(app, ["run", "--tasks", "chains_lambada", "--policy", "kl", "--thresholds", "1e-3",
                              "--baselines", "16", "--limit", "3", "--log-samples", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, explain(res)
    return out


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> Path:
    return sampled_sweep(tmp_path_factory.mktemp("sweep"))


SAMPLE_DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "binary": lambda b: bytes(range(256)) * 4,
    "a list per line": lambda b: b"[1, 2, 3]\n",
    "exit steps as text": lambda b: b.replace(b'"exit_steps": [', b'"exit_steps": "x", "was": ['),
    "no doc id": lambda b: b.replace(b'"doc_id"', b'"doc"'),
}


@pytest.mark.parametrize("damage", list(SAMPLE_DAMAGE))
def test_a_damaged_samples_file_is_one_line_in_report(sampled, tmp_path, capfd, damage):
    d = tmp_path / "copy"
    shutil.copytree(sampled, d)
    victim = next(p for p in sorted(d.glob("*.samples.jsonl")) if "__kl-" in p.name)
    victim.write_bytes(SAMPLE_DAMAGE[damage](victim.read_bytes()))
    one_line(["report", str(d), "--out", str(tmp_path / "r.html")], capfd, ["samples file", victim.name])
    assert not (tmp_path / "r.html").exists()


# ---- non-finite cells, however they got here ---------------------------------------------------------------------
def test_pareto_and_check_say_when_a_cell_had_nonfinite_tokens(tmp_path):
    def broke(cell):
        cell["numerics"]["nonfinite_tokens"] = 3
    victim = [p for p in baseline_cells() if "__kl-" in p.name][:1]
    d = copy_cells(tmp_path / "c", [p for p in baseline_cells() if p not in victim])
    copy_cells(d, victim, broke)
    res = runner.invoke(app, ["pareto", str(d), "--format", "md"])
    assert res.exit_code == 0 and "NaN or infinite" in res.stderr and victim[0].name in res.stderr, explain(res)
    res = runner.invoke(app, ["check", str(d), "--baseline", str(BASELINE), "--present-only"])
    assert "1 of the run's cells" in res.stdout and "NaN or infinite" in res.stdout, explain(res)


def test_a_reused_cell_with_nonfinite_tokens_is_warned_about(tmp_path):
    from exitbench.analysis.tables import reuse_note

    def broke(cell):
        cell["numerics"]["nonfinite_tokens"] = 2
    d = copy_cells(tmp_path / "c", baseline_cells(series=("kl",))[:1], broke)
    reused = [json.loads(p.read_text()) for p in d.glob("*.json")]
    note = reuse_note(reused, d)
    assert "warning: 1 reused cell(s)" in note and "NaN or infinite" in note


# ---- exit configs and exit models under mutation --------------------------------------------------------------
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True)
                        | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(knob=st.sampled_from(sorted(f for f in ExitConfig().to_dict()) + ["exit_model", "kv_window"]),
       value=ANY_JSON)
def test_any_exit_config_value_is_accepted_or_one_line(tmp_path_factory, knob, value):
    import yaml
    path = tmp_path_factory.mktemp("cfg") / "exit.yaml"
    path.write_text(yaml.safe_dump({"policy": "second_order", knob: value}))
    try:
        cfg = ExitConfig.from_yaml(path)
    except ExitbenchError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:  # what was accepted is of the knob's own type, uncoerced
        got = getattr(cfg, knob)
        kind = KNOB_TYPES[knob]
        if got is not None:
            assert (type(got) is kind) or (kind is float and type(got) is int), (knob, value, got)


KNOB_TYPES = {name: next(t for t in (bool, int, float, str) if t.__name__ in str(hint))
              for name, hint, *_ in ExitConfig.knobs()}


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


def test_a_crash_in_check_is_not_read_as_a_regression(tmp_path, monkeypatch):
    """Python exits 1 on an uncaught exception, which is check's "regressed": a crash must be told apart."""
    import exitbench.analysis.check as check

    def bug(*a, **k):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(check, "compare", bug)
    res = runner.invoke(app, ["check", str(BASELINE), "--baseline", str(BASELINE)])
    assert res.exit_code == 3 and "crashed" in res.stderr, explain(res)


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
