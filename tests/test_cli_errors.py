"""Bad input on the command line: each command refused ends with exit code 2 and one line `error: …` naming the
bad thing (never a traceback), before any compute is spent and with no cell written; what a refusal must not
catch passes.

Checkpoints that lie are refused the same way (tests/test_checkpoint_headers.py, tests/test_cli_info.py), as are
bad exit configs (tests/test_exit_config.py) and the cells and samples files a reader takes (tests/test_readers.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.models.embedded import EMBEDDED_DIR
from exitbench.store import cells

from helpers.cli import assert_one_line_error, invoke, run_cli, runner
from helpers.files import model_copy
from helpers.sweeps import SMALL, SMALL_LOUD

EMBEDDED = EMBEDDED_DIR / "tiny-raven"
FIXTURES = Path(__file__).parent / "fixtures"


def broken_cell(directory: Path) -> Path:
    """A file that carries the cell schema tag but lacks a field readers need."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "chains__kl-0.001__0123456789abcdef.json"
    path.write_text(json.dumps({"schema": cells.SCHEMA, "schema_version": cells.SCHEMA_VERSION,
                                "cell_id": "0123456789abcdef", "key": {}, "model": {}, "task": {}}))
    return path


# ---- a table of bad commands ---------------------------------------------------------------------------------------

def _a_file(tmp: Path) -> str:
    (tmp / "a-file").write_text("not a directory")
    return str(tmp / "a-file")


def _bad_yaml(tmp: Path) -> str:
    (tmp / "bad.yaml").write_text("policy: kl\nthreshold: [1e-3\n  min_steps: 2\n")
    return str(tmp / "bad.yaml")


def _broken_cell_dir(tmp: Path) -> str:
    broken_cell(tmp / "broken")
    return str(tmp / "broken")


def _templated(tmp: Path, template) -> str:
    """tiny-raven with `template` as the chat template in its tokenizer_config.json."""
    dst = model_copy(EMBEDDED, tmp / "templated")
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                           "chat_template": template}))
    return str(dst)


def _chat(template, words):
    return (lambda t: ["run", *SMALL, "-c", _templated(t, template), "--apply-chat-template", "--out", str(t / "o")],
            words)


# Not writable even for root: /sys refuses new entries.
UNWRITABLE = "/sys/exitbench-test/out"

def run_with(*args: str):
    """`run` with the small sweep's options, then ARGS."""
    return lambda t: ["run", *SMALL, "--out", str(t / "o"), *args]


def run(*args: str):
    """`run` with the small sweep's options, quiet, then ARGS (a later option wins)."""
    return lambda t: ["run", *SMALL_LOUD, "--quiet", *[a.format(out=t / "o") for a in args]]


BAD_COMMANDS = {
    "run --out is a file": (lambda t: ["run", *SMALL, "--out", _a_file(t)], ["--out", "is a file"]),
    "run --out not writable": (lambda t: ["run", *SMALL, "--out", UNWRITABLE], ["--out", "not writable"]),
    "geometry --out is a file": (lambda t: ["geometry", "--out", _a_file(t), "--steps", "2", "--programs", "2"],
                                 ["--out", "is a file"]),
    "geometry --programs 0": (lambda t: ["geometry", "--programs", "0", "--out", str(t / "g")], ["--programs"]),
    "run --thresholds ''": (lambda t: ["run", *SMALL[:4], "--thresholds", "", "--out", str(t / "o")],
                            ["--thresholds", "empty"]),
    "run fixed with thresholds": (lambda t: ["run", "--tasks", "chains", "--policy", "fixed", "--thresholds",
                                             "0.3,2.7", "--out", str(t / "o")], ["--thresholds", "--baselines"]),
    "run whole-number policy, fractional threshold": (
        lambda t: ["run", "--tasks", "chains", "--policy", "argmax_stability", "--thresholds", "2.7",
                   "--out", str(t / "o")], ["2.7", "argmax_stability", "whole"]),
    "run --device tpu": (lambda t: ["run", *SMALL, "--device", "tpu", "--out", str(t / "o")],
                         ["--device", "'tpu'"]),
    "run --dtype float64": (lambda t: ["run", *SMALL, "--dtype", "float64", "--out", str(t / "o")],
                            ["dtype", "float64"]),
    "trace --exit-config bad YAML": (lambda t: ["trace", "a=1 b=a", "--exit-config", _bad_yaml(t)],
                                     ["bad.yaml", "cannot read", "not valid YAML", "line"]),
    "run into a dir with a broken cell": (lambda t: ["run", *SMALL, "--out", _broken_cell_dir(t)],
                                          ["broken cell", "lacks"]),
    "pareto on a broken cell": (lambda t: ["pareto", _broken_cell_dir(t)], ["broken cell", "lacks"]),
    "check on a broken cell": (lambda t: ["check", _broken_cell_dir(t), "--baseline", _broken_cell_dir(t)],
                               ["broken cell"]),
    "pareto --table nope": (lambda t: ["pareto", str(t), "--table", "nope"], ["--table"]),
    # generation settings, checked before compute
    "run --gen-kwargs max_gen_toks=-5": (run_with("--gen-kwargs", "max_gen_toks=-5"), ["max_gen_toks=-5", "≥ 1"]),
    "run --gen-kwargs max_gen_toks=abc": (run_with("--gen-kwargs", "max_gen_toks=abc"), ["--gen-kwargs", "'abc'"]),
    "run --gen-kwargs '=,,='": (run_with("--gen-kwargs", "=,,="), ["--gen-kwargs", "names no setting"]),
    "run --gen-kwargs do_sample=maybe": (run_with("--gen-kwargs", "do_sample=maybe"), ["do_sample", "true or false"]),
    # bounds where a huge value hung or crashed
    "run --timing-repeats 1000000": (run_with("--timing-repeats", "1000000"), ["--timing-repeats", "at most"]),
    "run --threads 99999999999": (run_with("--threads", "99999999999"), ["--threads", "at most"]),
    "trace --threads 99999999999": (lambda t: ["trace", "a=1 b=a", "--threads", "99999999999"], ["--threads"]),
    "run --verify-cells ''": (run_with("--replay", "--verify-cells", ""), ["--verify-cells", "empty"]),
    "info --plan --memory-gb inf": (lambda t: ["info", "--plan", "--memory-gb", "inf"], ["--memory-gb", "at most"]),
    "info --plan --memory-gb 1e400": (lambda t: ["info", "--plan", "--memory-gb", "1e400"], ["--memory-gb", "inf"]),
    "info --plan --memory-gb 1e300": (lambda t: ["info", "--plan", "--memory-gb", "1e300"], ["--memory-gb", "1e+300"]),
    "fit-exit --tokens 0": (lambda t: ["fit-exit", "--tokens", "0", "--limit", "4", "--out", str(t / "o" / "m.json")],
                            ["--tokens must be ≥ 2", "got 0"]),
    # chat templates that cannot be rendered: named before any compute
    "a chat template that raises": _chat("{{ raise_exception('no chat here') }}", ["chat template", "no chat here"]),
    "a chat template that does not parse": _chat("{% for m in messages %}{{ m.content ", ["chat template",
                                                                                          "TemplateSyntaxError"]),
    "a chat template that is a number": _chat(5, ["chat template", "must be a Jinja string", "int"]),
    # depths, limits and named cells, refused when the sweep is planned (before its first cell)
    "run --limit inf": (run("--limit", "inf", "--out", "{out}"), ["--limit", "inf"]),
    "run --limit nan": (run("--limit", "nan", "--out", "{out}"), ["--limit", "nan"]),
    "fit-exit --batch-size 0": (lambda t: ["fit-exit", "--batch-size", "0", "--limit", "4", "--out",
                                           str(t / "o" / "m.json")], ["--batch-size", "0"]),
    "fit-exit --batch-size -2": (lambda t: ["fit-exit", "--batch-size", "-2", "--limit", "4", "--out",
                                            str(t / "o" / "m.json")], ["--batch-size", "-2"]),
    "fit-exit --seed -5": (lambda t: ["fit-exit", "--seed", "-5", "--limit", "4", "--out", str(t / "o" / "m.json")],
                           ["--seed", "-5"]),
    "geometry --steps 100000": (lambda t: ["geometry", "--steps", "100000", "--programs", "2", "--out", str(t / "o")],
                                ["--steps 100000", "32"]),
    "run --max-steps past the maximum": (run("--max-steps", "1000", "--out", "{out}"), ["--max-steps 1000", "32"]),
    "run --baselines past the maximum": (run("--baselines", "4,1000", "--out", "{out}"), ["--baselines 1000", "32"]),
    "run --min-steps past the depth": (run("--min-steps", "20", "--out", "{out}"), ["min_steps=20", "max_steps=16"]),
    "run --baselines ''": (run("--baselines", "", "--out", "{out}"), ["--baselines", "empty"]),
    "run --horizon late with the oracle alone": (
        lambda t: ["run", "--tasks", "chains", "--policy", "oracle", "--horizon", "late", "--limit", "2", "--out",
                   str(t / "o")], ["--horizon late", "none of the policies", "oracle"]),
    # rules that can never exit before full depth, refused when planned, before a cell (tests/test_run.py: more)
    "run the default second_order on two loops": (lambda t: ["run", "-c", str(FIXTURES / "nanbeige-tiny"), "--tasks",
                                                             "chains", "--limit", "2", "--out", str(t / "o")],
                                                   ["second_order can first exit at iteration 3", "--max-steps 4"]),
    "trace the default second_order on two cycles": (
        lambda t: ["trace", "a b c", "-c", str(FIXTURES / "hrm-text-tiny")], ["second_order can first exit at iteration 3"]),
    "calibrate at a τ that cannot exit": (lambda t: ["calibrate", "-p", "argmax_stability", "--thresholds", "3,15",
                                                     "--programs", "8", "--out", str(t / "c.json")],
                                          ["calibrate: argmax_stability at τ=15", "iteration 16", "at most 14"]),
    "run --verify-cells policy not swept": (
        run("--replay", "--verify", "--verify-cells", "kl:1e-3", "--out", "{out}"),
        ["--verify-cells kl:0.001", "'kl' is not in this sweep", "second_order at 0.1", "fixed at 16"]),
    "run --verify-cells threshold not swept": (
        run("--replay", "--verify", "--verify-cells", "second_order:0.5", "--out", "{out}"),
        ["--verify-cells second_order:0.5", "no threshold 0.5", "second_order at 0.1"]),
}
if not torch.cuda.is_available():
    BAD_COMMANDS["run --device cuda without CUDA"] = (
        lambda t: ["run", *SMALL, "--device", "cuda", "--out", str(t / "o")], ["--device cuda", "no CUDA"])


@pytest.mark.parametrize("case", list(BAD_COMMANDS))
def test_bad_command_is_one_line_and_exit_2(case, tmp_path, capfd):
    make_args, needles = BAD_COMMANDS[case]
    capfd.readouterr()
    res = runner.invoke(app, make_args(tmp_path))
    assert_one_line_error(res, needles, fd=capfd.readouterr())
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").rglob("*.json"))


def test_unwritable_out_fails_before_any_compute(tmp_path, capfd, monkeypatch):
    """The writability check comes before the checkpoint is even read."""
    import exitbench.models.checkpoint as checkpoint

    def no_loading(*a, **k):
        raise AssertionError("the checkpoint was loaded before --out was checked")

    monkeypatch.setattr(checkpoint, "open_checkpoint", no_loading)
    code, lines, _ = invoke(["run", *SMALL, "--out", UNWRITABLE], capfd)
    assert code == 2 and "not writable" in lines[0]


def test_verify_cells_of_the_sweep_are_accepted():
    """The refusal above is of cells the sweep lacks: named cells that are in it pass, whatever the spelling of
    their threshold (1e-1 is 0.1; an iteration count 3 is 3.0)."""
    from exitbench.engine import ExitConfig
    from exitbench.sweep.config import check_named, parse_named

    configs = [ExitConfig("fixed", threshold=16), ExitConfig("second_order", threshold=0.1),
               ExitConfig("argmax_stability", threshold=3)]
    check_named(parse_named("second_order:1e-1,fixed:16,argmax_stability:3.0"), configs)
    with pytest.raises(ExitbenchError, match="argmax_stability has no threshold 4"):
        check_named(parse_named("argmax_stability:4"), configs)


# Typed text a console could misread: rich markup, emoji codes, a backslash before a bracket.
MISREADABLE = {
    "quantiles:abc": lambda t: (["run", "--thresholds", "quantiles:abc"], "--thresholds quantiles:abc: give"),
    "an emoji code in a file name": lambda t: (["run", "--exit-config", str(t / ":fire:.yaml")],
                                               f"{t / ':fire:.yaml'}: No such file"),
    "markup in a path": lambda t: (["trace", "a=1 b=a", "--exit-config", str(t / "[bold]x[/bold]" / ":+1:.yaml")],
                                   f"{t / '[bold]x[/bold]' / ':+1:.yaml'}: No such file"),
    "a backslash before a bracket": lambda t: (["pareto", str(t / "a\\[red]b")], str(t / "a\\[red]b") + " is not"),
}


@pytest.mark.parametrize("case", list(MISREADABLE))
def test_an_error_quotes_what_was_typed_exactly(case, tmp_path, capfd):
    """The error line goes through no markup or emoji codes: it says what the user typed, character for character."""
    args, quoted = MISREADABLE[case](tmp_path)
    capfd.readouterr()
    res = runner.invoke(app, args)
    assert_one_line_error(res, [quoted], fd=capfd.readouterr())


# ---- bad `run` options on top of a base sweep ----------------------------------------------------------------------

BAD_INPUT = {
    "unknown-task": (["--tasks", "chain"], ["unknown task 'chain'", "chains"]),
    "unknown-policy": (["--policy", "secnd_order"], ["unknown policy 'secnd_order'", "second_order"]),
    "threshold-not-a-number": (["--thresholds", "1e-3,abc"], ["--thresholds", "'abc'"]),
    "threshold-negative": (["--thresholds", "-1"], ["--thresholds", "-1"]),
    "shard-out-of-range": (["--shard", "3/2"], ["--shard 3/2"]),
    "data-dir-without-files": (["--data-dir", "{empty}"], ["--data-dir", "train.jsonl", "test.jsonl"]),
    "limit-zero": (["--limit", "0"], ["--limit", "0"]),
    "negative-fewshot": (["--num-fewshot", "-1"], ["--num-fewshot"]),
    "negative-timing-repeats": (["--timing-repeats", "-1"], ["--timing-repeats", "-1"]),
    # issue 72: a value that does not parse as its option's type, quoted with its flag (typer's box quoted neither)
    "timing-repeats-not-a-number": (["--timing-repeats", "abc"], ["--timing-repeats 'abc'", "integer"]),
    "timing-repeats-in-e-notation": (["--timing-repeats", "1e9"], ["--timing-repeats '1e9'", "integer"]),
    "batch-size-not-a-number": (["--batch-size", "abc"], ["--batch-size 'abc'", "integer"]),
    "limit-not-a-number": (["--limit", "abc"], ["--limit 'abc'", "number"]),
    # issue 69's engine knobs
    "stream-shorter-than-the-batch": (["--timing-stream", "8"], ["--timing-stream 8", "--batch-size 16"]),
    "unknown-kv-layout": (["--kv-layout", "rolling"], ["kv_layout", "'rolling'", "first_then_shared"]),
    "first-then-shared-with-the-oracle": (["--policy", "oracle", "--kv-layout", "first_then_shared"],
                                          ["first_then_shared", "oracle", "latest or single"]),
    "coda-batch-without-continuous": (["--refill", "wave", "--coda-batch", "4"], ["coda_batch", "refill wave"]),
}


# An unknown task costs 8 s: naming the closest tasks builds lm-eval's whole task index. The other cases stay fast.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "unknown-task" else c
                                  for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_no_cell(case, tmp_path, capfd):
    """In this process: the CLI's own stderr, plus whatever reaches file descriptor 2 (lm-eval's and
    datasets' loggers write there directly)."""
    empty = tmp_path / "empty-data"
    empty.mkdir()
    out = tmp_path / "out"
    args, needles = BAD_INPUT[case]
    base = ["--tasks", "chains", "--baselines", "1", "--policy", "second_order", "--thresholds", "0.1",
            "--limit", "2"]
    capfd.readouterr()
    res, _ = run_cli(*base, *[a.format(empty=empty) for a in args], "--out", str(out))
    assert_one_line_error(res, needles, fd=capfd.readouterr())
    assert not out.exists() or not list(out.rglob("*.json"))
