"""`exitbench lm-eval …`: lm-eval's own command line, with the `exitbench` model registered.

lm-eval parses the arguments and runs them; three things happen in between, on the parsed arguments:

- exitbench's shipped task folder (tasks/) joins the include path, so `--tasks chains` needs no
  `--include_path`. lm-eval's `--include_path` holds one value (a second flag replaces the first), so the
  folder cannot simply be appended as another flag; lm-eval's TaskManager takes a list instead.
- with `--model exitbench`, the model arguments are checked before lm-eval starts: a bad policy, threshold,
  key, device or checkpoint file then ends with one line, instead of a traceback after lm-eval has logged its
  setup and spent seconds indexing its tasks. The weights are not read here; the constructor loads them
  once, later. So is `--apply_chat_template`, which the model cannot serve yet (no chat template).
- lm-eval's git lookup stops printing "fatal: not a git repository" outside a checkout.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

from ..errors import ExitbenchError
from .task_set import SHIPPED_TASKS

MODEL = "exitbench"
# lm-eval hands these to every model beside --model_args, so the same key inside --model_args makes the
# constructor fail with "got multiple values for keyword argument".
CLI_MODEL_KEYS = ("batch_size", "max_batch_size", "device")


def run_lm_eval(argv: list[str]) -> None:
    """What `lm-eval ARGV` does, with the differences listed in the module docstring."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from . import model as lm  # noqa: F401  (registers the model)
    from .quiet import silence_git_lookup

    setup_logging()  # as lm-eval's own entry point does, before parsing (parsing may log)
    parser = HarnessCLI()
    saved_argv = sys.argv
    sys.argv = ["lm-eval", *argv]  # HarnessCLI reads sys.argv, and inserts `run` when no command is given
    try:
        args = parser.parse_args()
    finally:
        sys.argv = saved_argv
    prepare(args)
    silence_git_lookup()
    with exits_in_lm_evals_results():
        parser.execute(args)


@contextlib.contextmanager
def exits_in_lm_evals_results():
    """lm-eval's CLI calls `lm_eval.simple_evaluate` and prints and saves what it returns: for the time of one
    CLI run, that function also adds the exitbench models' exit statistics to it (exit_statistics.py)."""
    import lm_eval

    from .exit_statistics import annotate, collecting

    original = lm_eval.simple_evaluate

    @functools.wraps(original)
    def evaluate_and_annotate(*args: Any, **kwargs: Any):
        with collecting() as models:
            results = original(*args, **kwargs)
        if results is not None and models:
            annotate(results, models)
        return results

    lm_eval.simple_evaluate = evaluate_and_annotate
    try:
        yield
    finally:
        lm_eval.simple_evaluate = original


def prepare(args: argparse.Namespace) -> None:
    """Edit lm-eval's parsed arguments in place: the shipped tasks, and the exitbench model's arguments."""
    config = _config_file(args)
    if hasattr(args, "include_path"):
        args.include_path = with_shipped_tasks(args.include_path or config.get("include_path"))
    if getattr(args, "command", None) == "run" and (args.model or config.get("model")) == MODEL:
        _check_exitbench_run(args, config)


def with_shipped_tasks(include: str | Path | list[str | Path] | None) -> list[str]:
    """The user's task folders after exitbench's, unless one of them already holds or lies in it.

    TaskManager lets a later folder win a name clash, so a user's task still overrides a shipped one of the
    same name; and a folder indexed twice would warn about every task in it overriding itself.
    """
    paths = [] if include is None else [include] if isinstance(include, (str, Path)) else list(include)
    for p in paths:
        resolved = Path(p).expanduser().resolve()
        if resolved.is_relative_to(SHIPPED_TASKS) or SHIPPED_TASKS.is_relative_to(resolved):
            return [str(p) for p in paths]
    return [str(SHIPPED_TASKS), *(str(p) for p in paths)]


def _config_file(args: argparse.Namespace) -> dict[str, Any]:
    """`run --config FILE`: lm-eval fills in from it whatever the command line leaves out."""
    path = getattr(args, "config", None)
    if not path:
        return {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    try:
        return EvaluatorConfig.load_yaml_config(path)
    except (OSError, ValueError, TypeError) as exc:
        first_line = next(iter(str(exc).splitlines()), type(exc).__name__)
        raise ExitbenchError(f"--config {path}: {first_line}") from None


def _check_exitbench_run(args: argparse.Namespace, config: dict[str, Any]) -> None:
    from lm_eval.utils import simple_parse_args_string

    model_args = args.model_args or config.get("model_args") or {}
    if isinstance(model_args, str):
        model_args = simple_parse_args_string(model_args)
    model_args = dict(model_args)
    for key in CLI_MODEL_KEYS:
        if key in model_args:
            value, given = model_args.pop(key), _given(args, config, key)
            if given is not None and str(given) != str(value):
                raise ExitbenchError(f"--model_args {key}={value} and --{key} {given} disagree; give {key} once")
            setattr(args, key, value)
    args.model_args = model_args or None
    check_model_args(model_args)
    template = _given(args, config, "apply_chat_template")
    if template:  # before lm-eval starts: a checkpoint without a template fails here, in one line
        from ..models.embedded import resolve
        from .prompting import Prompting

        named = (model_args or {}).get("checkpoint") or (model_args or {}).get("pretrained")
        Prompting(template if template is True else str(template)).check_for(resolve(named))
    check_device(_given(args, config, "device"))
    if _given(args, config, "device") is None:
        # lm-eval's own default is cuda:0 even on a machine without CUDA; exitbench's is "auto".
        from ..runtime.devices import resolve_device

        args.device = resolve_device("auto")
    from .model import ExitbenchLM

    batch_size = _given(args, config, "batch_size")
    ExitbenchLM._parse_batch_size(1 if batch_size is None else batch_size, _given(args, config, "max_batch_size"))


def _given(args: argparse.Namespace, config: dict[str, Any], key: str) -> Any:
    value = getattr(args, key, None)  # absent, not None, when the flag is left out (argparse.SUPPRESS)
    return config.get(key) if value is None else value


def check_model_args(model_args: dict[str, Any]) -> None:
    """What ExitbenchLM(**model_args) would reject before and while loading, without reading the weights."""
    from ..engine.config import ExitConfig
    from ..models.checkpoint import check_dtype_name
    from ..runtime.validation import parse
    from .model import ExitbenchLM, ModelArgs

    params = inspect.signature(ExitbenchLM.__init__).parameters
    # on_progress is for Python callers; exit_config, on lm-eval's command line, is a file's path
    own = [name for name, p in params.items()
           if name not in ("self", "exit_config", "on_progress") and p.kind is not p.VAR_KEYWORD]
    exit_knobs = [f.name for f in dataclasses.fields(ExitConfig)]
    unknown = sorted(set(model_args) - set(own) - set(exit_knobs) - {"exit_config"})
    if unknown:
        raise ExitbenchError(f"unknown exitbench model argument {unknown[0]!r} in --model_args; "
                             f"known: {', '.join([*own, 'exit_config', *exit_knobs])}")
    bound = {name: model_args.get(name, params[name].default) for name in own}
    parse(ModelArgs, {k: v for k, v in bound.items() if k in ModelArgs.model_fields}, "exitbench model arguments")
    given = {k: v for k, v in model_args.items() if k in exit_knobs}
    if "exit_config" in model_args:
        ExitConfig.with_file(str(model_args["exit_config"]), given, "exitbench model argument")
    else:
        ExitConfig(**given)
    check_dtype_name(bound["dtype"])
    check_checkpoint(bound["checkpoint"])


def check_device(device: Any) -> None:
    """The same rule as every exitbench command: a device that is asked for must be there."""
    from ..runtime.devices import resolve_device

    if device not in (None, ""):
        resolve_device(str(device))


def check_checkpoint(checkpoint: Any) -> None:
    """Every check load_checkpoint makes before it reads a tensor: config, architecture, each shard's
    safetensors header against the file's length, keys and shapes against the config (no weight is read)."""
    from ..models.checkpoint import inspect_checkpoint
    from ..models.embedded import resolve

    inspect_checkpoint(resolve(None if checkpoint is None else str(checkpoint)))
