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

from pydantic import BaseModel, ConfigDict

from ..errors import ExitbenchError
from ..runtime.validation import one_line, parse
from ..store.task_fingerprint import IGNORED_DIRS, load_task_config, task_fingerprint

_PACKAGE = Path(__file__).resolve().parents[1]
# A wheel carries the tasks inside the package (setup.py copies them there at build); a checkout, or an
# editable install of one, reads the top-level tasks/ folder itself.
SHIPPED_TASKS = _PACKAGE / "tasks" if (_PACKAGE / "tasks").is_dir() else _PACKAGE.parent / "tasks"
GSM8K_HUB = "openai/gsm8k"
NEEDS_DATA_DIR = {"gsm8k_text"}
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
    try:
        return TaskManager(include_path=[str(p) for p in include], include_defaults=defaults, metadata=metadata)
    except Exception as exc:  # noqa: BLE001  (a task file the index took in but cannot sort, e.g. `task: 3`)
        raise ExitbenchError(_index_failure(include, exc)) from None


class _TaskNames(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    task: str = ""
    tag: str | list[str] | None = None


class _GroupNames(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    group: str = ""


def _index_failure(roots: list[Path], exc: BaseException) -> str:
    """Why lm-eval's task index failed, naming the file: it keys tasks, groups and tags by whatever a YAML
    holds there and then sorts the keys, so one `task: null` among the include paths fails every run."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in _task_yamls(roots):
        try:
            cfg = load_yaml(path, resolve_func=False, recursive=True)
        except Exception:  # noqa: BLE001  (the index skips such a file: not what failed it)
            continue
        if not isinstance(cfg, dict):
            continue
        # Which name the index keys the file by, as TaskIndex._kind_of decides: a class or task by `task`
        # (and its tags), a group by `group`.
        model = _GroupNames if "group" in cfg and "class" not in cfg else _TaskNames
        parse(model, {k: cfg[k] for k in model.model_fields if k in cfg}, f"task file {path}")
    return f"lm-eval's task index over {', '.join(map(str, roots))} failed: {one_line(exc)}"


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
        config = load_task_config(name, yaml_path) if yaml_path is not None else None
        spec: Any = name
        redirected = data is not None and isinstance(entry.cfg, dict) and entry.cfg.get("dataset_path") == GSM8K_HUB
        if redirected:
            spec = _redirect_gsm8k(yaml_path, data)
        fingerprints[name] = task_fingerprint(name, yaml_path, data, config, redirected)
        specs.append(spec)
    return TaskSet(tm, specs, list(names), fingerprints)


def output_type(tasks: TaskSet, name: str) -> str | None:
    """The lm-eval output type a task's config declares (generate_until, loglikelihood, multiple_choice, …), from
    the task index without building the task; None for a group or tag, which declares none of its own."""
    entry = tasks.manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None)
    return cfg.get("output_type") if isinstance(cfg, dict) else None


def unparsed_task_files(roots: list[Path]) -> list[tuple[Path, str]]:
    """(file, error) of each task YAML under `roots` that lm-eval's task index skips.

    The index loads every YAML with lm-eval's own loader (functions unresolved, includes followed) and drops
    one that fails with only a debug log line, so its task would look merely unknown. Same loader, same
    options here; only on the path where a name was not found.
    """
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for path in _task_yamls(roots):
        try:
            TaskIndex.process_cfg(load_yaml(path, resolve_func=False, recursive=True), path, {})
        except Exception as exc:  # noqa: BLE001  (whatever made lm-eval skip the file, reported as it is)
            out.append((path, one_line(exc)))
    return out


def _task_yamls(roots: list[Path]):
    """The YAML files lm-eval's task index reads under `roots`."""
    for root in roots:
        for path in sorted(Path(root).glob("**/*.yaml")):
            if not any(part in IGNORED_DIRS for part in path.parts):
                yield path


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


def _redirect_gsm8k(yaml_path: Path, data: Path) -> dict[str, Any]:
    """The built-in task's own config, with only its data source replaced by local JSONL files."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(yaml_path)
    config.update(dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {"train": str(data / "train.jsonl"),
                                                 "test": str(data / "test.jsonl")}})
    return config
