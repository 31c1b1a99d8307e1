"""The identity of a task: the content of every file lm-eval reads for it, wherever the file lies (the task
folder, the YAMLs its includes reach, the Python of its `!function`s, the local data its dataset fields name, the
--data-dir files). `task_fingerprint` is what every cell key holds as `task_fingerprint`; which tasks a run means
is harness/task_set.py's business.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from ..errors import ExitbenchError
from ..runtime.validation import one_line, parse
from .identity import named_content_fingerprint

IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's task index

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
    `redirected`: the run replaces the config's dataset by the --data-dir files (task_set._redirect_gsm8k), so the
    config's own dataset fields are not read.

    Names, not paths, enter the digest (identity.named_content_fingerprint), so they are chosen to stay put
    when a checkout moves: files under the task folder are `task/<path in the folder>` (for the folder's own
    files the names every earlier version gave, so existing cells keep their ids), the --data-dir files
    `data/<file>`, includes and modules reached by relative references `task/<path from the folder>` (`..`
    and all), data reached by relative references `dataset/<path from where datasets resolves it>`, an
    importable module `module/<dotted name>`, and anything the config reaches through an absolute path by
    that path (already spelled out in the hashed YAML, so it moves with nothing).
    """
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
                config = load_task_config(name, yaml_path)
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
            return  # what lm-eval cannot read it does not read; load_task_config reports the configs that need it
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
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS and not d.startswith("."))
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
            continue  # a cycle or a missing file: lm-eval fails on both, and load_task_config said so first
        seen.add(path)
        functions: list[tuple[Path, str]] = []
        try:
            with path.open("rb") as fh:
                cfg = yaml.load(fh, Loader=_recording_loader(path.parent, functions))  # noqa: S506
        except Exception as exc:  # noqa: BLE001  (lm-eval read it a moment ago; it changed since)
            raise ExitbenchError(f"task {name!r}: {path} does not load: {one_line(exc)}") from None
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
    beside the YAML first, else an importable module (load_task_config has imported it by now)."""
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


def load_task_config(name: str, yaml_path: Path) -> dict[str, Any]:
    """The task's config, loaded as lm-eval will when it builds the task, functions resolved: the index does
    not resolve `!function`, so a missing module or function would otherwise surface as a traceback mid-run."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(yaml_path, resolve_func=True, recursive=True)
    except Exception as exc:  # noqa: BLE001  (a user's YAML and the Python it names can fail in any way)
        raise ExitbenchError(f"task {name!r}: {yaml_path} does not load: {one_line(exc)}") from None
