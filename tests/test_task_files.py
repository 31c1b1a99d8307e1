"""Task YAMLs that lm-eval cannot use: reported as one line naming the file and the error, not as an unknown
task (lm-eval's index skips a file that does not parse) or a traceback mid-run (it resolves `!function` only
when it builds the task).

Everything here fails before lm-eval's own task index is built, so each case takes well under a second.
"""
from __future__ import annotations

import pytest

import exitbench.harness.task_set
from exitbench.errors import ExitbenchError
from exitbench.harness.task_set import defines, resolve_tasks, unparsed_task_files

from helpers.cli import assert_one_line_error, run_cli

GOOD = """task: {name}
custom_dataset: !function {function}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
"""
# An unterminated quoted scalar: the YAML error points at the end of the file and at the scalar's start.
BROKEN = 'task: {name}\noutput_type: generate_until\ndoc_to_text: "{{{{prompt}}\n'


@pytest.fixture
def user_tasks(tmp_path):
    """A user's --include-path folder: a broken YAML, a task whose !function names a missing module, and one
    good task beside them."""
    root = tmp_path / "my_tasks"
    (root / "broken").mkdir(parents=True)
    (root / "broken" / "broken_task.yaml").write_text(BROKEN.format(name="broken_task"))
    (root / "nofunc").mkdir()
    (root / "nofunc" / "nofunc_task.yaml").write_text(GOOD.format(name="nofunc_task", function="nosuchmodule.load"))
    (root / "good").mkdir()
    (root / "good" / "good_task.yaml").write_text(GOOD.format(name="good_task", function="utils.load"))
    (root / "good" / "utils.py").write_text("def load(**kwargs):\n    return {}\n")
    return root


CASES = {
    "does-not-parse": ("broken_task", "broken/broken_task.yaml", ["does not parse", "line 4, column 1",
                                                                  "quoted scalar (line 3"]),
    "missing-function-module": ("nofunc_task", "nofunc/nofunc_task.yaml", ["does not load", "'nosuchmodule'"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unusable_task_file_is_one_line_naming_it(case, user_tasks, tmp_path, capfd):
    name, file, needles = CASES[case]
    capfd.readouterr()
    res, _ = run_cli("--tasks", name, "--include-path", str(user_tasks), "--limit", "2", "--baselines", "1",
                     "--policy", "second_order", "--thresholds", "0.1", "--out", str(tmp_path / "out"))
    line = assert_one_line_error(res, [f"'{name}'", str(user_tasks / file), *needles], fd=capfd.readouterr())
    assert "unknown task" not in line


def test_a_good_task_beside_broken_files_resolves(user_tasks):
    task_set = resolve_tasks(["good_task", "chains"], include_paths=[user_tasks])
    assert task_set.names == ["good_task", "chains"]


def test_unparsed_files_are_the_ones_lm_eval_skips(user_tasks):
    """The broken YAML, not the one with a missing function: lm-eval's index does not resolve functions."""
    (found, error), = unparsed_task_files([user_tasks])
    assert found == user_tasks / "broken" / "broken_task.yaml"
    assert "\n" not in error and "line 4" in error


def test_which_broken_file_defines_a_name(tmp_path):
    path = tmp_path / "variant.yaml"
    path.write_text('task: my_gsm8k\ndataset_path: openai/gsm8k\ntag: [math, gsm8k_family]\n  bad: "\n')
    assert defines(path, "my_gsm8k") and defines(path, "gsm8k_family") and defines(path, "variant")
    assert not defines(path, "gsm8k")  # named in a value, not as the task, group or tag


def test_an_unknown_task_names_the_closest_ones(monkeypatch):
    """The hint an unknown name gets. A name the shipped tasks lack sends resolve_tasks to lm-eval's own index
    (8 s to build: test_cli_errors' unknown-task case runs it, marked slow); a shipped-only index in its place reaches
    the same code in a fraction of a second."""
    build = exitbench.harness.task_set._manager
    built = []

    def shipped_only(include, defaults, data):
        built.append(defaults)
        return build(include, False, data)

    monkeypatch.setattr(exitbench.harness.task_set, "_manager", shipped_only)
    with pytest.raises(ExitbenchError) as err:
        resolve_tasks(["chain"])
    assert str(err.value) == "unknown task 'chain'; closest: chains, chains_mc"
    assert built == [False, True]  # the shipped tasks first, then (here, in name only) lm-eval's too
