"""What lm-eval prints around `simple_evaluate`, and the switches exitbench uses to keep it off the console.

Always (quiet or not), via `silence_git_lookup()`, what every `simple_evaluate` records about its environment:
- "fatal: not a git repository": each call records `git describe --always` of the working directory
  (`lm_eval.loggers.utils.get_git_commit_hash`), with git's stderr inherited, so each call made outside a
  checkout prints git's complaint. The lookup's answer is kept, looked up once per working directory; only
  git's stderr is dropped.
- the environment report (`add_env_info`): torch's `collect_env`, which spawns a dozen programs (`pip list`,
  `nvidia-smi`, `lscpu`, …) on every call, 2 of a small cell's 3 seconds. A sweep calls lm-eval once per cell
  and never reads the report (each cell keeps its own provenance), so it is replaced by a short one built from
  that provenance, once per process: same keys, no programs.

Always, inside `lm_eval_output`: the bootstrap of a stderr (perplexity's, bleu's, …) runs in this process, not in
lm-eval's pool of forked workers (a pool per metric per cell; and a fork of a process with threads running, torch's
or pytest-xdist's, can hang the child on a lock another thread held). Its resamples are the same either way (chunk
i draws from random.Random(i)), so are its numbers.

Under `lm_eval_output(quiet=True)`, or with `progress_bars=False` (a sweep showing its own progress):
- "bootstrapping for stddev: NAME", a print() to stdout, and its tqdm bar on stderr, once per bootstrapped
  metric (perplexity, f1, bleu, …) per task per call.
- lm-eval's per-task "building requests" bar and its request-cache bar (tqdm): a bar per task per cell.
- datasets' "Generating train split" bar, drawn whenever a task's data is prepared into a new cache (so on every
  CI run); a download's bar goes with it, since the sweep's own progress says what runs.

Always, inside `lm_eval_output`: lm-eval's WARNING "Custom kwargs can be passed to `--metadata`", which every
task with a `custom_dataset` (all of exitbench's shipped tasks) logs when it loads its data: advice for lm-eval's
own command line, which exitbench's has no use for.

Only under `lm_eval_output(quiet=True)`:
- lm-eval's other log records below ERROR.

Errors stay visible: ERROR records still print, and exceptions leave the context untouched.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=None)
def _described(cwd: str) -> str | None:
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        described = subprocess.run(["git", "describe", "--always"], stdout=subprocess.PIPE,  # noqa: S607
                                   stderr=subprocess.DEVNULL, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(cwd)
    return described.strip().decode()


def _git_describe_without_stderr() -> str | None:
    """`lm_eval.loggers.utils.get_git_commit_hash` (lm-eval 0.4.13), with git's stderr discarded; git runs once
    per working directory and process, not once per cell."""
    return _described(os.getcwd())


@functools.lru_cache(maxsize=1)
def _environment() -> dict[str, Any]:
    """lm-eval's environment keys, filled from exitbench's own provenance. `pretty_env_info` keeps the lines of
    torch's report that a reader compares runs by (versions, OS, CPU, threads), without spawning anything."""
    import torch

    from ..runtime.provenance import cpu_capability, cpu_model, package_version

    lines = [f"PyTorch version: {torch.__version__}",
             f"CUDA used to build PyTorch: {torch.version.cuda or 'None'}",
             f"OS: {platform.platform()}",
             f"Python version: {platform.python_version()}",
             f"CPU: {cpu_model() or 'unknown'} ({cpu_capability() or 'unknown'}, {os.cpu_count()} cores)",
             f"Intra-op threads: {torch.get_num_threads()}",
             "(torch.utils.collect_env not run: it spawns a dozen programs per call; see exitbench.harness.quiet)"]
    return {"pretty_env_info": "\n".join(lines),
            "transformers_version": package_version("transformers") or "N/A",
            "lm_eval_version": package_version("lm_eval") or package_version("lm-eval") or "N/A"}


def _environment_report(storage: dict[str, Any]) -> None:
    """`lm_eval.loggers.utils.add_env_info` (lm-eval 0.4.13) without the programs torch's report spawns."""
    from lm_eval.loggers.utils import get_commit_from_path

    storage.update(_environment())
    # a file read, not a program: the enclosing checkout's commit, in case this one is a submodule
    storage["upper_git_hash"] = get_commit_from_path(Path(os.getcwd(), ".."))


def silence_git_lookup() -> None:
    """Make every later `simple_evaluate` look up the git revision without printing git's errors, and record its
    environment without spawning programs.

    Idempotent. Only the names the evaluator calls are replaced, with the same keys and the same fallback:
    redirecting file descriptor 2 around the call would also hide whatever else the process wrote there, and
    a shim `git` on PATH or a patched `subprocess` would reach far beyond these lookups.
    """
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = _git_describe_without_stderr
    lm_eval.evaluator.add_env_info = _environment_report


@contextlib.contextmanager
def _attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


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
    with _bootstrap_in_process(), _filtered("lm_eval.api.task", _not_for_exitbench):
        if not quiet and progress_bars:
            yield
            return
        with _quieter(quiet):
            yield


def _not_for_exitbench(record: logging.LogRecord) -> bool:
    """False for lm-eval's hint that a task's `custom_dataset` takes kwargs through `--metadata`: every shipped
    task has one, so the hint printed on every run, and exitbench has no `--metadata` (its data directory reaches
    the tasks by --data-dir)."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def _filtered(name: str, keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """`keep` as a filter of the logger `name` (its own records: where lm-eval logs the hint) for the block."""
    logger = logging.getLogger(name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def _bootstrap_in_process() -> Iterator[None]:
    """lm-eval's bootstrap without its process pool (lm-eval reads DISABLE_MULTIPROC at each call)."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


@contextlib.contextmanager
def _quieter(quiet: bool) -> Iterator[None]:
    """lm-eval's bars and bootstrap banners off; with `quiet`, its warnings and datasets' bars too."""
    import datasets
    import lm_eval.api.metrics
    import lm_eval.api.model
    import lm_eval.api.task
    from tqdm import tqdm

    def silent_tqdm(*args: Any, **kwargs: Any) -> tqdm:
        kwargs["disable"] = True  # over any disable= the caller passes
        return tqdm(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        if quiet:
            logger = logging.getLogger("lm_eval")
            stack.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.ERROR)
        # datasets' "Generating … split" bar, drawn whenever a task's data is prepared afresh (a new cache: every
        # CI run), between exitbench's own progress lines
        if datasets.is_progress_bar_enabled():
            stack.callback(datasets.enable_progress_bars)
        datasets.disable_progress_bars()
        # The banner and the bar live inside this one function; it computes a number and prints nothing else.
        # Swapping the module's name works because stderr_for_metric looks it up at call time.
        stack.enter_context(_attribute(lm_eval.api.metrics, "bootstrap_stderr",
                                       _without_console_output(lm_eval.api.metrics.bootstrap_stderr)))
        # Both modules bind `from tqdm import tqdm` at import, and every bar they draw goes through that name.
        stack.enter_context(_attribute(lm_eval.api.task, "tqdm", silent_tqdm))
        stack.enter_context(_attribute(lm_eval.api.model, "tqdm", silent_tqdm))
        yield
