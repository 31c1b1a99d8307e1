"""Which lm-eval tasks a run means: the ones exitbench ships (tasks/), the user's, and lm-eval's built-ins.

lm-eval's own tasks run unmodified. The one change `--data-dir` makes is where their data comes from: a task
whose dataset is `openai/gsm8k` reads DIR/train.jsonl and DIR/test.jsonl instead, for machines without the
hub. Shipped tasks that need local data (gsm8k_text) receive the directory as task metadata.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ExitbenchError

SHIPPED_TASKS = Path(__file__).resolve().parent.parent / "tasks"
GSM8K_HUB = "openai/gsm8k"
NEEDS_DATA_DIR = {"gsm8k_text"}
_IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's task index
_NAMING_KEY = re.compile(r"^\s*-?\s*(task|group|tag)\s*:")


@dataclass
class TaskSet:
    manager: Any
    specs: list[Any]                 # what simple_evaluate gets: names, or config dicts for redirected built-ins
    names: list[str]
    fingerprints: dict[str, str] = field(default_factory=dict)


def check_data_dir(data_dir: str | Path | None) -> Path | None:
    if data_dir is None:
        return None
    path = Path(data_dir).expanduser()
    missing = [f for f in ("train.jsonl", "test.jsonl") if not (path / f).is_file()]
    if missing:
        raise ExitbenchError(f"--data-dir {path} must hold train.jsonl and test.jsonl (GSM8K layout); "
                             f"missing: {', '.join(missing)}")
    return path.resolve()


def _manager(include: list[Path], defaults: bool, data_dir: Path | None):
    from lm_eval.tasks import TaskManager

    metadata = {"data_dir": str(data_dir)} if data_dir else None
    return TaskManager(include_path=[str(p) for p in include], include_defaults=defaults, metadata=metadata)


def resolve_tasks(names: list[str], data_dir: str | Path | None = None,
                  include_paths: list[str | Path] = ()) -> TaskSet:

    if not names:
        raise ExitbenchError("--tasks names no task; give one or more, e.g. --tasks chains")
    data = check_data_dir(data_dir)
    include = [SHIPPED_TASKS, *[Path(p) for p in include_paths]]
    for p in include[1:]:
        if not p.exists():
            raise ExitbenchError(f"--include-path {p} does not exist")
    tm = _manager(include, False, data)
    broken: list[tuple[Path, str]] = []
    missing = [n for n in names if n not in tm.all_tasks]
    if missing:
        broken = unparsed_task_files(include)
        for name in missing:
            for path, error in broken:
                if defines(path, name):
                    raise ExitbenchError(f"task {name!r}: {path} does not parse: {error}")
        tm = _manager(include, True, data)  # lm-eval's own index costs seconds: build it only when needed
    specs, fingerprints = [], {}
    for name in names:
        if name not in tm.all_tasks:
            close = difflib.get_close_matches(name, tm.all_tasks, n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            if broken:
                path, error = broken[0]
                hint += (f"; {len(broken)} task file(s) under the include paths do not parse, "
                         f"e.g. {path}: {error}")
            raise ExitbenchError(f"unknown task {name!r}{hint}")
        if name in NEEDS_DATA_DIR and data is None:
            raise ExitbenchError(f"task {name} reads local GSM8K text: pass --data-dir DIR with test.jsonl")
        entry = tm.task_index[name]
        yaml_path = Path(entry.yaml_path) if entry.yaml_path else None
        if yaml_path is not None:
            _check_loads(name, yaml_path)
        spec: Any = name
        if data is not None and isinstance(entry.cfg, dict) and entry.cfg.get("dataset_path") == GSM8K_HUB:
            spec = _redirect_gsm8k(yaml_path, data)
        fingerprints[name] = task_fingerprint(name, yaml_path, data)
        specs.append(spec)
    return TaskSet(tm, specs, list(names), fingerprints)


# What a task folder's files may hold that changes its numbers: configs and their includes, the Python of
# `!function` entries (custom datasets, filters, metrics), and local data.
TASK_FILE_SUFFIXES = (".yaml", ".yml", ".py", ".jsonl", ".json", ".txt")


def task_fingerprint(name: str, yaml_path: Path | None, data: Path | None) -> str:
    """The content identity of what a task reads from disk: its folder's configs, code and data, and the
    --data-dir files when given (a task lm-eval defines in code alone is named by its name)."""
    from .identity import named_content_fingerprint

    files: dict[str, Path] = {}
    if yaml_path is not None:
        files.update({f"task/{p.name}": p for p in sorted(yaml_path.parent.iterdir())
                      if p.is_file() and p.suffix in TASK_FILE_SUFFIXES})
    if data is not None:
        files.update({f"data/{f}": data / f for f in ("train.jsonl", "test.jsonl")})
    return named_content_fingerprint(files).short if files else name


def unparsed_task_files(roots: list[Path]) -> list[tuple[Path, str]]:
    """(file, error) of each task YAML under `roots` that lm-eval's task index skips.

    The index loads every YAML with lm-eval's own loader (functions unresolved, includes followed) and drops
    one that fails with only a debug log line, so its task would look merely unknown. Same loader, same
    options here; only on the path where a name was not found.
    """
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for root in roots:
        for path in sorted(Path(root).glob("**/*.yaml")):
            if any(part in _IGNORED_DIRS for part in path.parts):
                continue
            try:
                TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, {})
            except Exception as exc:  # noqa: BLE001  (whatever made lm-eval skip the file, reported as it is)
                out.append((path, _one_line(exc)))
    return out


def defines(path: Path, name: str) -> bool:
    """Whether an unparseable task file looks like the definition of `name`: named after it, or a
    task/group/tag line naming it (a guess from the raw text, since the file does not parse)."""
    if path.stem == name:
        return True
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        key = _NAMING_KEY.match(line)
        if key and name in re.findall(r"[\w.\-]+", line[key.end():]):
            return True
    return False


def _check_loads(name: str, yaml_path: Path) -> None:
    """Load the task's YAML as lm-eval will when it builds the task, functions resolved: the index does not
    resolve `!function`, so a missing module or function would otherwise surface as a traceback mid-run."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        load_yaml(yaml_path, resolve_func=True, recursive=True)
    except Exception as exc:  # noqa: BLE001  (a user's YAML and the Python it names can fail in any way)
        raise ExitbenchError(f"task {name!r}: {yaml_path} does not load: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """An error as one line: YAML errors as what went wrong and where, others with their lines joined."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError):
        def at(what: str | None, mark: Any) -> str | None:
            return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if what and mark else what

        return ", ".join(p for p in (at(exc.problem, exc.problem_mark), at(exc.context, exc.context_mark)) if p)
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _redirect_gsm8k(yaml_path: Path, data: Path) -> dict[str, Any]:
    """The built-in task's own config, with only its data source replaced by local JSONL files."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(yaml_path)
    config.update(dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {"train": str(data / "train.jsonl"),
                                                 "test": str(data / "test.jsonl")}})
    return config
