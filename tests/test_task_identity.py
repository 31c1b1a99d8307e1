"""A task's identity (the task_fingerprint in every cell key) covers what lm-eval reads for the task, wherever it
lies: data in subfolders, data_files outside the folder, included YAMLs and `!function` modules from other
folders, local dataset folders. A rerun after any of them changed must compute new cells, not reuse the old ones.

Each task here is built under tmp_path and resolved with the shipped tasks' index only (no lm-eval built-ins),
so every case but the end-to-end run takes well under a second.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import exitbench.harness.task_set
from exitbench.store import identity
from exitbench.errors import ExitbenchError
from exitbench.harness.task_set import resolve_tasks

from helpers.cells import load_cells
from helpers.cli import explain, run_cli

NAME = "mytask"
ROWS = [{"prompt": "f=3 X=0 c=X G=3", "answer": "3"}, {"prompt": "a=7 q=3 b=a c=b", "answer": "7"},
        {"prompt": "u=1 v=u w=2", "answer": "1"}, {"prompt": "k=5 m=k n=m", "answer": "5"}]
CONFIG = {"task": NAME, "output_type": "loglikelihood", "test_split": "test", "doc_to_text": "{{prompt}}",
          "doc_to_target": " {{answer}}",
          "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                          {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
          "metadata": {"version": 1.0}}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Digests cached into the test's own directory, never into the developer's ~/.cache."""
    directory = tmp_path / "hash-cache"
    monkeypatch.setenv(identity.CACHE_DIR_ENV, str(directory))
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_task(folder: Path, text: str | None = None, **fields) -> Path:
    """folder/mytask.yaml: CONFIG with `fields` on top, or `text` verbatim (for !function tags)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({**CONFIG, **fields}, sort_keys=False))
    return path


def fingerprint(folder: Path) -> str:
    return resolve_tasks([NAME], include_paths=[folder]).fingerprints[NAME]


def changed_answers(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    write_jsonl(path, [{**r, "answer": str((int(r["answer"]) + 1) % 10)} for r in rows])


def shipped_only(build):
    def manager(include, defaults, data):
        return build(include, False, data)  # lm-eval's own index takes seconds: an unknown name stays unknown
    return manager


def assert_tracks(folder: Path, change, unrelated) -> None:
    """An unrelated change keeps the fingerprint; the change in question gives a new one."""
    before = fingerprint(folder)
    unrelated()
    assert fingerprint(folder) == before, "a file the task does not read changed its identity"
    change()
    assert fingerprint(folder) != before, "a file the task reads changed, its identity did not"


# ---- the shipped tasks keep their identities -------------------------------------------------------------------

# Computed with the fingerprint code before it followed includes, functions and data files (git HEAD b91f74a).
# Users' existing cells carry these in their keys: a change here would make every one of them stale, so these
# values change only with the shipped task files themselves (and then on purpose).
SHIPPED = {"chains": "4796ba1ec61ce2f1", "chains_mc": "4796ba1ec61ce2f1", "chains_lambada": "4796ba1ec61ce2f1"}
WITH_DATA_DIR = {"gsm8k_text": "a88ac3d6b55aa804", "chains": "c9ef27dfb6cabc32"}


def test_the_shipped_tasks_keep_their_fingerprints(tmp_path):
    assert resolve_tasks(list(SHIPPED)).fingerprints == SHIPPED
    data = tmp_path / "gsm8k"
    write_jsonl(data / "train.jsonl", [{"question": "1+1?", "answer": "2"}])
    write_jsonl(data / "test.jsonl", [{"question": "2+2?", "answer": "4"}])
    assert resolve_tasks(list(WITH_DATA_DIR), data_dir=data).fingerprints == WITH_DATA_DIR


# ---- what lm-eval reads, wherever it lies ----------------------------------------------------------------------

def test_data_a_custom_dataset_reads_from_a_subfolder(tmp_path):
    folder = tmp_path / "tasks" / NAME
    write_task(folder, "\n".join([yaml.safe_dump(CONFIG, sort_keys=False),
                                  "custom_dataset: !function loader.load\n"]))
    (folder / "loader.py").write_text(
        "from pathlib import Path\nimport datasets\n\n"
        "def load(**kwargs):\n"
        "    return {'test': datasets.Dataset.from_json(str(Path(__file__).parent / 'data' / 'test.jsonl'))}\n")
    data = write_jsonl(folder / "data" / "test.jsonl", ROWS)
    assert_tracks(folder, change=lambda: changed_answers(data),
                  unrelated=lambda: (folder / "README.md").write_text("notes\n"))


def test_data_files_in_a_subfolder_any_suffix(tmp_path, monkeypatch):
    """data_files relative to where datasets resolves them (the working directory), in a subfolder of the
    task's folder, and a .csv: named by the config, so hashed whatever its suffix."""
    folder = tmp_path / "tasks" / NAME
    write_task(folder, dataset_path="csv", dataset_kwargs={"data_files": {"test": "data/test.csv"}})
    data = folder / "data" / "test.csv"
    data.parent.mkdir()
    data.write_text("prompt,answer\nf=3 X=0,3\n")
    (folder / "data" / "notes.csv").write_text("not read\n")
    monkeypatch.chdir(folder)
    assert_tracks(folder, change=lambda: data.write_text("prompt,answer\nf=3 X=0,4\n"),
                  unrelated=lambda: (folder / "data" / "notes.csv").write_text("still not read\n"))


@pytest.mark.parametrize("spelling", ["absolute", "parent", "glob"])
def test_data_files_outside_the_folder(tmp_path, monkeypatch, spelling):
    folder = tmp_path / "tasks" / NAME
    outside = tmp_path / "shared_data"
    data = write_jsonl(outside / "test.jsonl", ROWS)
    other = write_jsonl(outside / "other.json", ROWS)
    pattern = {"absolute": str(data), "parent": "../../shared_data/test.jsonl",
               "glob": "../../shared_data/*.jsonl"}[spelling]
    write_task(folder, dataset_path="json", dataset_kwargs={"data_files": {"test": [pattern]}})
    monkeypatch.chdir(folder)  # relative data_files are the working directory's, as datasets resolves them
    assert_tracks(folder, change=lambda: changed_answers(data), unrelated=lambda: changed_answers(other))


def test_a_yaml_included_from_another_folder(tmp_path):
    folder = tmp_path / "tasks" / NAME
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "base.yaml").write_text(yaml.safe_dump({k: v for k, v in CONFIG.items() if k != "task"}))
    (shared / "unused.yaml").write_text("doc_to_text: '{{prompt}}'\n")
    write_task(folder, text=f"include: ../../shared/base.yaml\ntask: {NAME}\n"
                            f"dataset_path: json\ndataset_kwargs: {{data_files: {{test: {folder / 'x.jsonl'}}}}}\n")
    write_jsonl(folder / "x.jsonl", ROWS)
    assert_tracks(folder,
                  change=lambda: (shared / "base.yaml").write_text(
                      (shared / "base.yaml").read_text().replace("' {{answer}}'", "'{{answer}}'")),
                  unrelated=lambda: (shared / "unused.yaml").write_text("doc_to_text: '{{answer}}'\n"))


def test_a_function_module_beside_an_included_yaml_elsewhere(tmp_path):
    folder = tmp_path / "tasks" / NAME
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "base.yaml").write_text("custom_dataset: !function loader.load\n"
                                      "process_docs: !function helpers.docs.keep\n")
    (shared / "loader.py").write_text(
        f"import datasets\n\ndef load(**kwargs):\n    return {{'test': datasets.Dataset.from_list({ROWS!r})}}\n")
    (shared / "helpers").mkdir()
    (shared / "helpers" / "docs.py").write_text("def keep(dataset):\n    return dataset\n")
    (shared / "other.py").write_text("X = 1\n")
    write_task(folder, text="include: ../../shared/base.yaml\n" + yaml.safe_dump(CONFIG, sort_keys=False))
    loader = shared / "loader.py"
    assert_tracks(folder, change=lambda: loader.write_text(loader.read_text().replace("'3'", "'4'")),
                  unrelated=lambda: (shared / "other.py").write_text("X = 2\n"))
    docs = shared / "helpers" / "docs.py"
    before = fingerprint(folder)
    docs.write_text("def keep(dataset):\n    return dataset.select(range(1))\n")
    assert fingerprint(folder) != before


def test_a_function_in_an_importable_module(tmp_path, monkeypatch):
    """No file beside the YAML: lm-eval imports the module by name, and its file is what runs."""
    folder = tmp_path / "tasks" / NAME
    lib = tmp_path / "lib"
    lib.mkdir()
    module = lib / "exitbench_test_docs_module.py"
    module.write_text("def keep(dataset):\n    return dataset\n")
    monkeypatch.syspath_prepend(str(lib))
    write_task(folder, text=yaml.safe_dump({**CONFIG, "dataset_path": "json",
                                           "dataset_kwargs": {"data_files": str(folder / "t.jsonl")}})
               + "process_docs: !function exitbench_test_docs_module.keep\n")
    write_jsonl(folder / "t.jsonl", ROWS)
    try:
        assert_tracks(folder, change=lambda: module.write_text("def keep(dataset):\n    return dataset.select([0])\n"),
                      unrelated=lambda: (lib / "README.md").write_text("x\n"))
    finally:
        sys.modules.pop("exitbench_test_docs_module", None)


@pytest.mark.parametrize("where", ["dataset_path", "data_dir"])
def test_a_local_dataset_folder(tmp_path, monkeypatch, where):
    """`dataset_path: DIR` (datasets reads the folder: its data files and README card), or a packaged
    builder with `data_dir: DIR` and no data_files (datasets infers the files from DIR)."""
    folder = tmp_path / "tasks" / NAME
    ds = tmp_path / "datasets" / "chains_local"
    data = write_jsonl(ds / "test.jsonl", ROWS)
    (ds / ".cache").mkdir()
    (ds / ".cache" / "state.json").write_text("{}")
    fields = ({"dataset_path": "../../datasets/chains_local"} if where == "dataset_path"
              else {"dataset_path": "json", "dataset_kwargs": {"data_dir": str(ds)}})
    write_task(folder, **fields)
    monkeypatch.chdir(folder)
    assert_tracks(folder, change=lambda: changed_answers(data),
                  unrelated=lambda: (ds / ".cache" / "state.json").write_text('{"a": 1}'))


def test_the_same_layout_elsewhere_has_the_same_identity(tmp_path, monkeypatch):
    """Files are named by where the config reaches them from, never by where the checkout lies."""
    def build(root: Path) -> Path:
        folder = root / "tasks" / NAME
        shared = root / "shared"
        shared.mkdir(parents=True)
        (shared / "base.yaml").write_text("process_docs: !function helpers.keep\n"
                                          + yaml.safe_dump({k: v for k, v in CONFIG.items() if k != "task"}))
        (shared / "helpers.py").write_text("def keep(dataset):\n    return dataset\n")
        write_jsonl(root / "data" / "test.jsonl", ROWS)
        write_jsonl(folder / "sub" / "extra.jsonl", ROWS)
        write_task(folder, text=f"include: ../../shared/base.yaml\ntask: {NAME}\ndataset_path: json\n"
                                "dataset_kwargs: {data_files: {test: ../../data/test.jsonl}}\n")
        return folder

    prints = []
    for where in ("one", "two/deeper"):
        folder = build(tmp_path / where)
        monkeypatch.chdir(folder)
        prints.append(fingerprint(folder))
    assert prints[0] == prints[1]


def test_an_include_cycle_or_a_missing_include_is_one_line(tmp_path):
    folder = tmp_path / "tasks" / NAME
    write_task(folder, text=f"include: other.yaml\ntask: {NAME}\n")
    (folder / "other.yaml").write_text(f"include: {NAME}.yaml\n")
    with pytest.raises(ExitbenchError, match="cycle"):
        fingerprint(folder)
    (folder / "other.yaml").unlink()
    with pytest.raises(ExitbenchError, match="other.yaml"):
        fingerprint(folder)


def test_a_wrong_typed_data_files_is_one_line_naming_the_field(tmp_path):
    folder = tmp_path / "tasks" / NAME
    write_task(folder, dataset_path="json", dataset_kwargs={"data_files": {"test": 5}})
    with pytest.raises(ExitbenchError) as err:
        fingerprint(folder)
    assert "dataset_kwargs.data_files" in str(err.value) and str(folder / f"{NAME}.yaml") in str(err.value)
    assert "\n" not in str(err.value)


def test_a_task_file_the_index_cannot_sort_is_named(tmp_path, monkeypatch):
    """lm-eval's index keys tasks by whatever `task:` holds, then sorts the names: `task: null` in any file
    under the include paths fails the index itself, for every task."""
    monkeypatch.setattr(exitbench.harness.task_set, "_manager", shipped_only(exitbench.harness.task_set._manager))
    folder = tmp_path / "tasks"
    write_task(folder / NAME)
    (folder / "other").mkdir()
    (folder / "other" / "other.yaml").write_text("task: null\noutput_type: generate_until\n")
    with pytest.raises(ExitbenchError) as err:
        resolve_tasks([NAME], include_paths=[folder])
    bad = folder / "other" / "other.yaml"
    assert str(err.value) == f"task file {bad}: task: input should be a valid string, got None"


# ---- any YAML: a one-line error or a task, never a traceback -------------------------------------------------

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, width=16),
                     st.sampled_from(["", ".", "..", "x.yaml", "../nowhere.yaml", "/", "hf://x/y", "data/*.jsonl",
                                      "json", "utils.load", "test", "{{prompt}}", "mytask.yaml"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.sampled_from(["test", "path", "split", 1]),
                                                                         inner, max_size=3)), max_leaves=6)
_KEYS = ["include", "task", "dataset_path", "dataset_name", "dataset_kwargs", "dataset_kwargs.data_files",
         "dataset_kwargs.data_dir", "output_type", "test_split", "doc_to_text", "metric_list", "tag",
         "custom_dataset", "metadata"]


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(_KEYS), value=_VALUES, function=st.booleans())
# What the search found once (lm-eval's index sorts task and tag names, so `task: null` failed inside it) and
# the shapes issue 29 named, tried on every run.
@example(key="task", value=None, function=False)
@example(key="tag", value=3, function=False)
@example(key="include", value=3, function=False)
@example(key="dataset_kwargs", value=[1], function=True)
@example(key="dataset_kwargs.data_files", value={"test": 5}, function=False)
def test_a_mutated_task_yaml_resolves_or_fails_in_one_line(key, value, function):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(exitbench.harness.task_set, "_manager", shipped_only(exitbench.harness.task_set._manager))
        mp.setenv(identity.CACHE_DIR_ENV, str(Path(tmp) / "cache"))
        mp.chdir(tmp)
        folder = Path(tmp) / "tasks" / NAME
        write_jsonl(folder / "test.jsonl", ROWS)
        config = {**CONFIG, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "test.jsonl"}}}
        if "." in key:
            outer, inner = key.split(".")
            config[outer] = {**config[outer], inner: value}
        else:
            config[key] = value
        text = yaml.safe_dump(config)
        if function:  # a !function beside the mutation, so the recording loader meets both
            (folder / "utils.py").write_text("def keep(dataset):\n    return dataset\n")
            text += "process_docs: !function utils.keep\n"
        write_task(folder, text=text)
        try:
            task_set = resolve_tasks([NAME], include_paths=[folder])
        except ExitbenchError as exc:
            assert "\n" not in str(exc), str(exc)
        else:
            assert len(task_set.fingerprints[NAME]) == 16


# ---- end to end ------------------------------------------------------------------------------------------------

# Two tiny-raven runs through lm-eval (about 5 s); test_data_files_in_a_subfolder_any_suffix covers the
# fingerprint itself in the fast suite.
@pytest.mark.slow
def test_a_rerun_after_subfolder_data_changed_computes_a_new_cell(tmp_path, monkeypatch):
    folder = tmp_path / "tasks" / NAME
    write_task(folder, dataset_path="json", dataset_kwargs={"data_files": {"test": "data/test.jsonl"}})
    data = write_jsonl(folder / "data" / "test.jsonl", ROWS)
    monkeypatch.chdir(folder)
    out = tmp_path / "out"
    args = ("-c", "tiny-raven", "--tasks", NAME, "--include-path", str(folder), "--policy", "fixed",
            "--baselines", "16", "--limit", "4", "--out", str(out))

    res, _ = run_cli(*args)
    assert res.exit_code == 0, explain(res)
    (first_file, first), = load_cells(out).items()
    changed_answers(data)
    res, _ = run_cli(*args)
    assert res.exit_code == 0, explain(res)
    cells = load_cells(out)
    assert len(cells) == 2, "the rerun reused the cell of the old answers"
    (second,) = [c for f, c in cells.items() if f != first_file]
    assert second["key"]["task_fingerprint"] != first["key"]["task_fingerprint"]
    assert second["quality"]["value"] != first["quality"]["value"]
