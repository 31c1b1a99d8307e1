"""Exit configs checked and typed at the door: every knob of ExitConfig against its rule (one line naming the knob,
never a traceback), and the values an exit-config YAML file or lm-eval's `--model_args` give it of the knob's own
type ("no" is not true, 3 is not a boolean, `5e-4` is a number). Exit model files: tests/test_learned.py."""
from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError

from helpers.cli import one_line
from helpers.engine import ALL_POLICIES, INTEGER_THRESHOLD, RELATIVE, tiny
from helpers.strategies import ANY_JSON


# ---- bad knobs -------------------------------------------------------------------------------------------

def _error(**kwargs) -> str:
    with pytest.raises(ExitbenchError) as info:
        ExitConfig(**kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


def test_unknown_policy_names_valid_ones_and_closest():
    msg = _error(policy="second_ordr")
    assert "second_ordr" in msg
    assert "did you mean second_order?" in msg
    for name in ALL_POLICIES:
        assert name in msg
    assert "did you mean" not in _error(policy="zzzzzz")


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("bad", [0, -1e-3, float("nan"), float("inf"), float("-inf")])
def test_threshold_must_be_finite_positive(policy, bad):
    msg = _error(policy=policy, threshold=bad)
    assert "threshold" in msg and policy in msg


def test_step_knobs():
    assert "min_steps" in _error(policy="kl", min_steps=5, max_steps=3)
    assert "min_steps" in _error(policy="first_order", min_steps=0)
    assert "max_steps" in _error(policy="first_order", max_steps=0)
    assert "patience" in _error(policy="kl", patience=0)
    assert "patience" in _error(policy="second_order", patience=-2)
    ExitConfig(policy="kl", min_steps=3, max_steps=3)  # equal is fine


def test_max_steps_beyond_the_group_or_min_steps_beyond_its_default():
    model = tiny(mean=4, max_rec=8)
    with pytest.raises(ExitbenchError, match="max_steps=9 exceeds"):
        ExitEngine(model, ExitConfig(policy="kl", max_steps=9))
    with pytest.raises(ExitbenchError, match="min_steps=5 is greater than max_steps=4"):
        ExitEngine(model, ExitConfig(policy="kl", min_steps=5))  # max_steps left open: the group's 4


@pytest.mark.parametrize("policy", [p for p in ALL_POLICIES if p not in RELATIVE])
def test_relative_only_where_it_means_something(policy):
    msg = _error(policy=policy, relative=True)
    assert "relative" in msg and policy in msg
    for name in RELATIVE:
        assert name in msg


@pytest.mark.parametrize("policy", sorted(RELATIVE))
def test_relative_accepted(policy):
    assert ExitConfig(policy=policy, relative=True).build_policy().relative


def test_confidence_threshold_is_a_probability():
    msg = _error(policy="confidence", threshold=1.5)
    assert "confidence" in msg and "1.5" in msg
    ExitConfig(policy="confidence", threshold=1.0)


@pytest.mark.parametrize("policy", sorted(INTEGER_THRESHOLD))
def test_integer_thresholds(policy):
    msg = _error(policy=policy, threshold=2.5)
    assert policy in msg and "2.5" in msg
    assert ExitConfig(policy=policy, threshold=3.0).build_policy().threshold == 3.0


def test_prefill_mode_checked():
    assert "prefill" in _error(prefill="partial")


def test_from_dict_rejects_unknown_key():
    with pytest.raises(ExitbenchError) as info:
        ExitConfig.from_dict({"policy": "kl", "treshold": 1e-3})
    msg = str(info.value)
    assert "treshold" in msg and "threshold" in msg and "\n" not in msg


# ---- exit-config files and lm-eval's model args: typed values --------------------------------------------------

def test_from_yaml_round_trip(tmp_path):
    cfg = ExitConfig(policy="second_order", threshold=2e-3, min_steps=3, max_steps=20, patience=3, relative=True,
                     prefill="exit", warm_start=True, record_signals=True, seed=7)
    path = tmp_path / "exit.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    back = ExitConfig.from_yaml(path)
    assert back == cfg
    assert back.build_policy().knobs() == cfg.build_policy().knobs()
    # A partial file keeps the defaults for the rest.
    path.write_text("policy: kl\nthreshold: 1.0e-4\n")
    part = ExitConfig.from_yaml(path)
    assert (part.policy, part.threshold, part.min_steps, part.prefill) == ("kl", 1e-4, 1, "full")


def test_from_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ExitbenchError, match="mapping"):
        ExitConfig.from_yaml(bad)
    bad.write_text("policy: kl\nthreshold: -1\n")
    with pytest.raises(ExitbenchError, match="threshold"):
        ExitConfig.from_yaml(bad)
    bad.write_text("policy: [unclosed\n")
    with pytest.raises(ExitbenchError, match="cannot read"):
        ExitConfig.from_yaml(bad)
    with pytest.raises(ExitbenchError, match="cannot read"):
        ExitConfig.from_yaml(tmp_path / "missing.yaml")


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


# ---- one reader of --exit-config: every command, one rule -------------------------------------------------------

def _file(tmp_path, **knobs):
    path = tmp_path / "exit.yaml"
    path.write_text(yaml.safe_dump(knobs))
    return str(path)


# Each command that takes exit knobs, with --exit-config FILE and the flags after it.
EXIT_COMMANDS = {
    "run": lambda f, t: ["run", "--tasks", "chains", "--limit", "2", "--out", str(t / "o"), "--exit-config", f],
    "trace": lambda f, t: ["trace", "a=1 b=a", "--exit-config", f],
    "calibrate": lambda f, t: ["calibrate", "--programs", "8", "--out", str(t / "c.json"), "--exit-config", f],
    "fit-exit": lambda f, t: ["fit-exit", "--limit", "4", "--out", str(t / "m.json"), "--exit-config", f],
}


@pytest.mark.parametrize("command", list(EXIT_COMMANDS))
def test_a_knob_in_the_file_and_on_the_command_line_is_refused_by_every_command(command, tmp_path, capfd):
    path = _file(tmp_path, policy="kl", max_steps=4)
    one_line([*EXIT_COMMANDS[command](path, tmp_path), "--max-steps", "2"], capfd,
             ["max_steps is set both in exit config", "exit.yaml", "by --max-steps"])


@pytest.mark.parametrize("flag,value,knob", [("--thresholds", "1e-3,1e-2", "threshold"), ("--seed", "3", "seed"),
                                             ("--policy", "kl", "policy")])
def test_run_spells_a_knob_by_its_own_option(tmp_path, capfd, flag, value, knob):
    path = _file(tmp_path, policy="kl", threshold=1e-3, seed=1)
    one_line([*EXIT_COMMANDS["run"](path, tmp_path), flag, value], capfd,
             [f"{knob} is set both in exit config", f"by {flag}"])


def test_an_empty_exit_config_is_refused(tmp_path, capfd):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    one_line(EXIT_COMMANDS["trace"](str(path), tmp_path), capfd, ["empty.yaml", "sets no knob"])


def test_calibrate_refuses_a_threshold_it_would_choose(tmp_path, capfd):
    one_line(EXIT_COMMANDS["calibrate"](_file(tmp_path, policy="kl", threshold=1e-3), tmp_path), capfd,
             ["calibrate chooses the threshold", "threshold 0.001"])


class _Reached(Exception):
    """Raised where a command would start its work, carrying what it was handed."""


@pytest.mark.parametrize("command,work", [("trace", "exitbench.studies.trace.trace_prompt"),
                                          ("calibrate", "exitbench.studies.calibrate.calibrate"),
                                          ("fit-exit", "exitbench.studies.fit_exit.fit_learned")])
def test_flags_beside_an_exit_config_reach_the_work(command, work, tmp_path, monkeypatch):
    """The flags typed beside a file are kept (trace and calibrate built their config from the file alone and
    dropped `--max-steps 3 --exit-mode freeze`); the file's own knobs and the command's defaults fill the rest."""
    from helpers.cli import runner

    from exitbench.cli import app

    def reached(*args, **kwargs):
        raise _Reached(args, kwargs)

    module, name = work.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, reached)
    flags = ["--max-steps", "3"] + ([] if command == "fit-exit" else ["--exit-mode", "freeze", "--patience", "1"])
    res = runner.invoke(app, [*EXIT_COMMANDS[command](_file(tmp_path, policy="kl", min_steps=2, seed=5), tmp_path),
                              *flags])
    assert isinstance(res.exception, _Reached), res.stdout + res.stderr
    args, kwargs = res.exception.args
    if command == "fit-exit":
        assert kwargs["steps"] == [3] and kwargs["seed"] == 5
        return
    config = next(a for a in args if isinstance(a, ExitConfig))
    assert (config.policy, config.min_steps, config.seed) == ("kl", 2, 5)  # the file's
    assert (config.max_steps, config.exit_mode, config.patience) == (3, "freeze", 1)  # the flags'
