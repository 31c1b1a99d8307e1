"""What lm-eval prints around `simple_evaluate`, and the switches exitbench uses to keep it off the console.

Always (quiet or not), via `silence_git_lookup()`:
- "fatal: not a git repository": every `simple_evaluate` records `git describe --always` of the working
  directory (`lm_eval.loggers.utils.get_git_commit_hash`), with git's stderr inherited, so each call made
  outside a checkout prints git's complaint. The lookup's answer is kept; only git's stderr is dropped.

Under `lm_eval_output(quiet=True)`, or with `progress_bars=False` (a sweep showing its own progress):
- "bootstrapping for stddev: NAME", a print() to stdout, and its tqdm bar on stderr, once per bootstrapped
  metric (perplexity, f1, bleu, …) per task per call.
- lm-eval's per-task "building requests" bar and its request-cache bar (tqdm): a bar per task per cell.

Only under `lm_eval_output(quiet=True)`:
- lm-eval's log records below ERROR, e.g. the WARNING "Custom kwargs can be passed to `--metadata`" that every
  task with a `custom_dataset` (all of exitbench's shipped tasks) logs when it loads its data.
- datasets' "Generating train split" bar (drawn once per dataset, when it is first prepared; outside quiet it
  is the only sign of a download's progress).

Errors stay visible: ERROR records still print, and exceptions leave the context untouched.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any


def _git_describe_without_stderr() -> str | None:
    """`lm_eval.loggers.utils.get_git_commit_hash` (lm-eval 0.4.13), with git's stderr discarded."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        described = subprocess.run(["git", "describe", "--always"], stdout=subprocess.PIPE,  # noqa: S607
                                   stderr=subprocess.DEVNULL, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())
    return described.strip().decode()


def silence_git_lookup() -> None:
    """Make every later `simple_evaluate` look up the git revision without printing git's errors.

    Idempotent. Only the name the evaluator calls is replaced, with the same command and the same fallback:
    redirecting file descriptor 2 around the call would also hide whatever else the process wrote there, and
    a shim `git` on PATH or a patched `subprocess` would reach far beyond this one lookup.
    """
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = _git_describe_without_stderr


@contextlib.contextmanager
def _attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def _logger_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


@contextlib.contextmanager
def _datasets_progress_bars_off() -> Iterator[None]:
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _without_console_output(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with stdout and stderr discarded while it runs; what it returns or raises is unchanged."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def lm_eval_output(quiet: bool = True, progress_bars: bool = True) -> Iterator[None]:
    """Wrap each `lm_eval.simple_evaluate` call: `with lm_eval_output(quiet): results = simple_evaluate(...)`.

    With quiet=False only git's noise goes (it never carries information), and lm-eval's progress bars and
    bootstrap banners too when `progress_bars` is false; with quiet=True also lm-eval's warnings and
    datasets' bars, for the duration of the block.
    """
    silence_git_lookup()
    if not quiet and progress_bars:
        yield
        return
    import lm_eval.api.metrics
    import lm_eval.api.model
    import lm_eval.api.task
    from tqdm import tqdm

    def silent_tqdm(*args: Any, **kwargs: Any) -> tqdm:
        kwargs["disable"] = True  # over any disable= the caller passes
        return tqdm(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(_logger_level("lm_eval", logging.ERROR))
            stack.enter_context(_datasets_progress_bars_off())
        # The banner and the bar live inside this one function; it computes a number and prints nothing else.
        # Swapping the module's name works because stderr_for_metric looks it up at call time.
        stack.enter_context(_attribute(lm_eval.api.metrics, "bootstrap_stderr",
                                       _without_console_output(lm_eval.api.metrics.bootstrap_stderr)))
        # Both modules bind `from tqdm import tqdm` at import, and every bar they draw goes through that name.
        stack.enter_context(_attribute(lm_eval.api.task, "tqdm", silent_tqdm))
        stack.enter_context(_attribute(lm_eval.api.model, "tqdm", silent_tqdm))
        yield
