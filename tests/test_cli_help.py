"""What a newcomer reads first: every command's `--help` (flags without type placeholders, no pointer to an option
that does not exist) and `exitbench policies`, which lists every registered policy."""
from __future__ import annotations

import dataclasses
import importlib

import pytest

from exitbench.cli import app

from helpers.cli import runner


COMMANDS = ["info", "train", "trace", "run", "pareto", "geometry", "check", "calibrate", "fit-exit", "policies"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_no_types_on_flags_and_no_missing_options(command):
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output
    assert "--list-policies" not in res.output  # an option trace's help once pointed to, which never existed


def test_policies_lists_every_registered_policy():
    from exitbench.policies import REGISTRY

    res = runner.invoke(app, ["policies"])
    assert res.exit_code == 0
    for name in REGISTRY:
        assert name in res.output


def test_policies_says_each_rule_whole():
    """Each rule's description is its docstring's whole first paragraph: the first line alone cut qexit's mid
    sentence ("(the last step") and learned's before its label."""
    import re

    res = runner.invoke(app, ["policies"], terminal_width=200)
    assert res.exit_code == 0
    text = " ".join(re.sub(r"[│┃]", " ", res.output).split())
    assert "so every token leaves by T" in text and "(label: the oracle's criterion)" in text


def test_every_command_function_is_at_most_40_lines():
    """Commands stay thin (parse → config → one library call → render): the work lives in library modules, where
    tests reach it without a CLI. Counted from the first decorator to the last line, as inspect reads them."""
    import inspect

    lengths = {c.name or c.callback.__name__: len(inspect.getsourcelines(inspect.unwrap(c.callback))[0])
               for c in app.registered_commands}
    assert len(lengths) >= len(COMMANDS) and max(lengths.values()) <= 40, sorted(lengths.items(), key=lambda i: -i[1])


def test_version_is_the_packages_own():
    """Issue 72: `exitbench --version` (a bug report's first line) says the version pyproject.toml declares."""
    import re
    from pathlib import Path

    # (a pattern, not tomllib: the project supports Python 3.10)
    declared = re.search(r'^version = "([^"]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text(),
                         re.M).group(1)
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"exitbench {declared}\n", res.output


@pytest.mark.parametrize("command,options", [
    ("run", "exitbench.sweep.config:RunOptions"), ("trace", "exitbench.studies.options:TraceOptions"),
    ("geometry", "exitbench.studies.options:GeometryOptions"),
    ("calibrate", "exitbench.studies.options:CalibrateOptions"),
    ("fit-exit", "exitbench.studies.options:FitExitOptions"), ("info", "exitbench.models.info:InfoOptions")])
def test_a_commands_options_are_one_dataclass_whose_every_field_is_a_flag(command, options):
    """run and the studies take their options as one object (the library's, which a notebook builds too); the
    command line is derived from its fields, so each field is a flag of the command, spelt as its metadata says."""
    module, name = options.split(":")
    cls = getattr(importlib.import_module(module), name)
    res = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert res.exit_code == 0
    for f in dataclasses.fields(cls):
        if not f.metadata.get("command_line", True):
            continue
        flag = (f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",))[0].split("/")[0]
        assert flag in res.output, (command, f.name, flag)
