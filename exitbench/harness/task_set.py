"""Which lm-eval tasks a run means: the ones exitbench ships (tasks/), the user's, and lm-eval's built-ins.

lm-eval's own tasks run unmodified. The one change `--data-dir` makes is where their data comes from: a task
whose dataset is `openai/gsm8k` reads DIR/train.jsonl and DIR/test.jsonl instead, for machines without the
hub. Shipped tasks that need local data (gsm8k_text) receive the directory as task metadata.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from ..errors import ExitbenchError
from ..runtime.validation import parse

_PACKAGE = Path(__file__).resolve().parents[1]
# A wheel carries the tasks inside the package (setup.py copies them there at build); a checkout, or an
# editable install of one, reads the top-level tasks/ folder itself.
SHIPPED_TASKS = _PACKAGE / "tasks" if (_PACKAGE / "tasks").is_dir() else _PACKAGE.parent / "tasks"
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
    return f"lm-eval's task index over {', '.join(map(str, roots))} failed: {_one_line(exc)}"


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
        config = _check_loads(name, yaml_path) if yaml_path is not None else None
        spec: Any = name
        redirected = data is not None and isinstance(entry.cfg, dict) and entry.cfg.get("dataset_path") == GSM8K_HUB
        if redirected:
            spec = _redirect_gsm8k(yaml_path, data)
        fingerprints[name] = task_fingerprint(name, yaml_path, data, config, redirected)
        specs.append(spec)
    return TaskSet(tm, specs, list(names), fingerprints)


# What a task folder's files may hold that changes its numbers: configs and their includes, the Python of
# `!function` entries (custom datasets, filters, metrics), and local data. Files the config names itself (an
# include, a function's module, data_files) are hashed whatever their suffix.
TASK_FILE_SUFFIXES = (".yaml", ".yml", ".py", ".jsonl", ".json", ".txt")


def task_fingerprint(name: str, yaml_path: Path | None, data: Path | None,
                     config: dict[str, Any] | None = None, redirected: bool = False) -> str:
    """The content identity of what a task reads from disk, wherever it lies: every file under its folder
    (subfolders too) with a task suffix, every YAML its include chain reads, the module of every `!function`
    in them, the local data its dataset fields name, and the --data-dir files when given (a task lm-eval
    defines in code alone is named by its name).

    `config` is the task's config as lm-eval builds it (functions resolved; loaded here when not given).
    `redirected`: the run replaces the config's dataset by the --data-dir files (_redirect_gsm8k), so the
    config's own dataset fields are not read.

    Names, not paths, enter the digest (identity.named_content_fingerprint), so they are chosen to stay put
    when a checkout moves: files under the task folder are `task/<path in the folder>` (for the folder's own
    files the names every earlier version gave, so existing cells keep their ids), the --data-dir files
    `data/<file>`, includes and modules reached by relative references `task/<path from the folder>` (`..`
    and all), data reached by relative references `dataset/<path from where datasets resolves it>`, an
    importable module `module/<dotted name>`, and anything the config reaches through an absolute path by
    that path (already spelled out in the hashed YAML, so it moves with nothing).
    """
    from ..store.identity import named_content_fingerprint

    files = _Files(yaml_path.parent if yaml_path is not None else None)
    if yaml_path is not None:
        for path in _walk(yaml_path.parent):
            if path.suffix in TASK_FILE_SUFFIXES:
                files.add(f"task/{path.relative_to(yaml_path.parent).as_posix()}", path)
        for yaml_file, absolute, functions in _include_chain(name, yaml_path):
            files.add_referenced(yaml_file, absolute)
            for base, spec in functions:
                _add_function_module(files, base, spec, absolute)
        if not redirected:
            if config is None:
                config = _check_loads(name, yaml_path)
            _add_dataset_files(files, name, yaml_path, config)
    if data is not None:
        files.add_named({f"data/{f}": data / f for f in ("train.jsonl", "test.jsonl")})
    return named_content_fingerprint(files.named).short if files.named else name


class _Files:
    """The named files of one task identity; each name stands for one file."""

    def __init__(self, folder: Path | None):
        self.named: dict[str, Path] = {}
        self.folder = Path(os.path.realpath(folder)) if folder is not None else None

    def add(self, name: str, path: Path) -> None:
        real = os.path.realpath(path)
        taken = self.named.get(name)
        if taken is not None and os.path.realpath(taken) != real:
            # Two derivations naming two files alike (symlinks can do it): neither may drop the other.
            n = 2
            while f"{name}#{n}" in self.named and os.path.realpath(self.named[f"{name}#{n}"]) != real:
                n += 1
            name = f"{name}#{n}"
        self.named.setdefault(name, path)

    def add_named(self, files: dict[str, Path]) -> None:
        for name, path in files.items():
            self.add(name, path)

    def in_folder(self, path: Path) -> str | None:
        if self.folder is None:
            return None
        rel = os.path.relpath(os.path.realpath(path), self.folder)
        return None if rel == ".." or rel.startswith("../") else Path(rel).as_posix()

    def add_referenced(self, path: Path, absolute: bool, relative_name: str | None = None) -> None:
        """A file the config names: by its place in the task folder if it lies there, else by the
        absolute path the config spells, else by `relative_name` (default: its path from the folder)."""
        if not path.is_file():
            return  # what lm-eval cannot read it does not read; _check_loads reports the configs that need it
        inside = self.in_folder(path)
        if inside is not None:
            self.add(f"task/{inside}", path)
        elif absolute:
            self.add(os.path.normpath(os.path.abspath(path)), path)
        elif relative_name is not None:
            self.add(relative_name, path)
        elif self.folder is not None:
            self.add(f"task/{os.path.relpath(os.path.realpath(path), self.folder)}", path)


def _walk(root: Path, data: bool = False):
    """Every file under `root` once, in a stable order, following symlinked folders (data is often linked
    in) without looping. Hidden folders (.git, .venv) and lm-eval's ignored ones are skipped; for a dataset
    folder (`data`) hidden files too, as datasets skips them."""
    seen: set[str] = set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if d not in _IGNORED_DIRS and not d.startswith("."))
        for n in sorted(names):
            path = Path(top) / n
            if (data and n.startswith(".")) or not path.is_file():
                continue
            yield path


class _IncludeField(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include: str | list[str] = []


def _recording_loader(base: Path, functions: list[tuple[Path, str]]):
    """lm-eval's YAML loader class (_yaml_loader._Base) with `!function` recorded instead of resolved."""
    import yaml
    from lm_eval.tasks._yaml_loader import _Base

    class Loader(_Base):  # type: ignore[misc, valid-type]
        pass

    def function(loader: Any, node: Any) -> str:
        spec = loader.construct_scalar(node)
        functions.append((base, spec))
        return str(base.expanduser() / spec)  # what lm-eval's loader gives when not resolving

    yaml.add_constructor("!function", function, Loader=Loader)
    return Loader


def _include_chain(name: str, yaml_path: Path) -> list[tuple[Path, bool, list[tuple[Path, str]]]]:
    """(file, reached through an absolute path, its `!function`s as (base folder, spec)) of every YAML that
    lm-eval's load_yaml reads for the task, resolved the way it resolves them."""
    import yaml

    out: list[tuple[Path, bool, list[tuple[Path, str]]]] = []
    seen: set[Path] = set()
    todo: list[tuple[Path, bool]] = [(yaml_path, False)]
    while todo:
        path, absolute = todo.pop(0)
        path = path.expanduser().resolve()
        if path in seen or not path.is_file():
            continue  # a cycle or a missing file: lm-eval fails on both, and _check_loads said so first
        seen.add(path)
        functions: list[tuple[Path, str]] = []
        try:
            with path.open("rb") as fh:
                cfg = yaml.load(fh, Loader=_recording_loader(path.parent, functions))  # noqa: S506
        except Exception as exc:  # noqa: BLE001  (lm-eval read it a moment ago; it changed since)
            raise ExitbenchError(f"task {name!r}: {path} does not load: {_one_line(exc)}") from None
        out.append((path, absolute, functions))
        if not isinstance(cfg, dict) or "include" not in cfg:
            continue
        includes = parse(_IncludeField, {"include": cfg["include"]}, f"task {name!r}: {path}").include
        for inc in includes if isinstance(includes, list) else [includes]:
            inc_absolute = Path(inc).is_absolute()
            todo.append((Path(inc) if inc_absolute else path.parent / inc, absolute or inc_absolute))
    return out


def _add_function_module(files: _Files, base: Path, spec: str, absolute: bool) -> None:
    """The Python file behind `!function spec`, found as lm-eval's _import_func_in_yml finds it: a file
    beside the YAML first, else an importable module (_check_loads has imported it by now)."""
    mod_path, _, _ = spec.rpartition(".")
    if not mod_path:
        return
    beside = (base / f"{mod_path.replace('.', '/')}.py").resolve()
    if beside.is_file():
        files.add_referenced(beside, absolute)
        return
    module_file = getattr(sys.modules.get(mod_path), "__file__", None)
    if module_file and Path(module_file).is_file():
        files.add_referenced(Path(module_file), False, relative_name=f"module/{mod_path}")


def _data_files_shape(value: Any) -> Any:
    """What datasets' sanitize_patterns accepts: a path, a list of paths, a list of {split, path}, or a
    mapping of split to a path or a list of paths."""
    def paths(v: Any) -> bool:
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, str) for p in v))

    ok = (value is None or paths(value)
          or (isinstance(value, dict) and all(paths(v) for v in value.values()))
          or (isinstance(value, list) and all(isinstance(e, dict) and set(e) == {"split", "path"}
                                              and paths(e["path"]) for e in value)))
    if not ok:
        raise ValueError("data_files must be a path, a list of paths, a list of {split, path}, or a mapping "
                         "of split to a path or a list of paths")
    return value


class _DatasetKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    data_files: Annotated[Any, BeforeValidator(_data_files_shape)] = None
    data_dir: str | None = None


class _DatasetFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    dataset_path: str | None = None
    dataset_kwargs: _DatasetKwargs | None = None


def _add_dataset_files(files: _Files, name: str, yaml_path: Path, config: dict[str, Any]) -> None:
    """The local files `datasets.load_dataset(dataset_path, **dataset_kwargs)` reads, resolved as datasets
    5 resolves them: relative data_files against data_dir, else against the working directory (not the
    YAML's folder); a local dataset_path folder whole (its README can define the data files). Remote
    patterns (hf://, URLs) are the hub's business and skipped.

    A custom_dataset function gets dataset_kwargs as its own arguments, so there they need not be what
    datasets takes: they are hashed where they have its shape and left to the function otherwise."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    custom = callable(config.get("custom_dataset"))
    try:
        fields = parse(_DatasetFields, {k: config[k] for k in _DatasetFields.model_fields if k in config},
                       f"task {name!r}: {yaml_path}")
    except ExitbenchError:
        if custom:
            return
        raise  # datasets would fail on it mid-run, after the model has loaded
    kwargs = fields.dataset_kwargs or _DatasetKwargs()
    path, data_dir, data_files = None if custom else fields.dataset_path, kwargs.data_dir, kwargs.data_files
    if (data_dir and _remote(data_dir)) or (path and _remote(path)):
        return
    cwd = Path.cwd().resolve()
    if path is None or path in _PACKAGED_DATASETS_MODULES:
        root, base = cwd, Path(data_dir or "").expanduser().resolve()
        absolute = bool(data_dir) and Path(data_dir).expanduser().is_absolute()
    elif os.path.isdir(path):
        root = Path(path).expanduser().resolve()
        base = Path(path, data_dir or "").expanduser().resolve()
        absolute = Path(path).expanduser().is_absolute()
        for f in _walk(root, data=True):
            files.add_referenced(f, absolute, relative_name=f"dataset/{f.relative_to(root).as_posix()}")
    else:
        return  # a hub dataset: nothing local
    if data_files is not None:
        from datasets.data_files import sanitize_patterns

        patterns = [p for ps in sanitize_patterns(data_files).values() for p in ps]
    elif data_dir and not custom:
        patterns = _inferred_patterns(base)
    else:
        return  # datasets would infer them from the whole working directory, every file of which would count
    from datasets.data_files import resolve_pattern

    for pattern in patterns:
        if _remote(pattern):
            continue
        try:
            matched = resolve_pattern(pattern, base.as_posix())
        except Exception:  # noqa: BLE001  (no match: datasets will say so when it reads)
            continue
        pattern_absolute = absolute or os.path.isabs(pattern)
        for m in sorted(matched):
            f = Path(os.path.normpath(m))
            files.add_referenced(f, pattern_absolute,
                                 relative_name=f"dataset/{os.path.relpath(os.path.abspath(f), root)}")


def _inferred_patterns(base: Path) -> list[str]:
    """The patterns datasets infers from a data_dir given without data_files."""
    from datasets.data_files import get_data_patterns

    try:
        return [p for ps in get_data_patterns(base.as_posix()).values() for p in ps]
    except Exception:  # noqa: BLE001  (an empty or missing folder: datasets will say so when it reads)
        return []


def _remote(path: str) -> bool:
    return "://" in path or "::" in path


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
            out.append((path, _one_line(exc)))
    return out


def _task_yamls(roots: list[Path]):
    """The YAML files lm-eval's task index reads under `roots`."""
    for root in roots:
        for path in sorted(Path(root).glob("**/*.yaml")):
            if not any(part in _IGNORED_DIRS for part in path.parts):
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


def _check_loads(name: str, yaml_path: Path) -> dict[str, Any]:
    """The task's config, loaded as lm-eval will when it builds the task, functions resolved: the index does
    not resolve `!function`, so a missing module or function would otherwise surface as a traceback mid-run."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(yaml_path, resolve_func=True, recursive=True)
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
