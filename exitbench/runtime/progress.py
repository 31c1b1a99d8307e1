"""Progress displays for long loops (training, sweeps, calibration, geometry).

On a terminal they are live bars; anywhere else (CI logs, pipes, nohup) they print a few plain lines instead,
because a bar redrawn into a file is dozens of lines of noise.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def duration(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 02 min: a reader's resolution at each scale."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@contextmanager
def training_progress(console: Console, total_steps: int, describe: Callable[[Any], str]
                      ) -> Iterator[Callable[[Any], None]]:
    """A bar over optimizer steps. `describe(state)` is the text beside it; `state` has step, loss, tokens and
    elapsed (exitbench.training.train.TrainState)."""
    def tokens_per_s(state) -> float:
        return state.tokens / state.elapsed if state.elapsed > 0 else 0.0

    if not console.is_terminal:
        every = max(1, total_steps // 20)  # a plain line every ~5%

        def log_step(state) -> None:
            if state.step % every == 0 or state.step == total_steps:
                console.print(f"step {state.step}/{total_steps} loss {state.loss:.3f} {describe(state)} "
                              f"{tokens_per_s(state):,.0f} tok/s {state.elapsed:.0f}s", highlight=False)

        yield log_step
        return
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f} · {task.fields[status]} · {task.fields[tps]:,.0f} tok/s"),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total_steps, loss=float("nan"), status="", tps=0.0)

        def on_step(state) -> None:
            progress.update(task, completed=state.step, loss=state.loss, status=describe(state),
                            tps=tokens_per_s(state))

        yield on_step


@contextmanager
def batch_progress(console: Console, label: str) -> Iterator[Callable[[int, int], None]]:
    """A transient bar fed (done, total); elsewhere a line at each quarter."""
    if not console.is_terminal:
        printed = set()

        def log(done: int, total: int) -> None:
            quarter = 4 * done // max(total, 1)
            if quarter not in printed:
                printed.add(quarter)
                console.print(f"{label}: {done}/{total}", highlight=False)

        yield log
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


class SweepProgress:
    """A bar over the grid's cells and one over the requests inside the current cell, with the time spent and an
    estimate of the time left (a line per finished cell saying the same when the console is not a terminal, so
    a slow machine never looks like a hung one); warnings always reach `errors`, quiet or not."""

    def __init__(self, console: Console, errors: Console, n_cells: int, enabled: bool = True, quiet: bool = False):
        self.console, self.errors, self.enabled, self.quiet = console, errors, enabled, quiet
        self.live = enabled and not quiet and console.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("·"), TimeRemainingColumn(), console=console,
                                 transient=True, disable=not self.live)
        self.grid = self.progress.add_task("cells", total=n_cells)
        self.inner = self.progress.add_task("requests", total=1, visible=False)
        self.started = time.perf_counter()
        self.reused = 0  # cells already on disk: they cost nothing, so they do not count toward the estimate

    def __enter__(self) -> "SweepProgress":
        self.started = time.perf_counter()
        self.progress.__enter__()
        return self

    def timing(self) -> str:
        """'12 s elapsed, about 1 min 40 s left': the time per cell computed so far times the cells to do."""
        grid = self.progress.tasks[self.grid]
        done, total = int(grid.completed), int(grid.total or 0)
        elapsed = time.perf_counter() - self.started
        if done >= total:
            return f"{duration(elapsed)} elapsed"
        computed = done - self.reused
        left = elapsed / computed * (total - done) if computed > 0 else None
        return f"{duration(elapsed)} elapsed" + (f", about {duration(left)} left" if left is not None else "")

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def cell_started(self, label: str) -> None:
        self.progress.update(self.grid, description=f"cells · {label}")
        self.progress.update(self.inner, completed=0, total=1, visible=True)

    def cell_skipped(self, label: str) -> None:
        self.reused += 1
        self.progress.advance(self.grid)

    def cell_finished(self, label: str) -> None:
        self.progress.advance(self.grid)
        if self.enabled and not self.quiet and not self.live:
            done = int(self.progress.tasks[self.grid].completed)
            self.console.print(f"[{done}/{int(self.progress.tasks[self.grid].total)}] {label} · {self.timing()}",
                               highlight=False)

    def note(self, text: str) -> None:
        """A line of its own off a terminal (on one the bars say it): work the cell count does not cover."""
        if self.enabled and not self.quiet and not self.live:
            self.console.print(text, highlight=False)

    def requests(self, done: int, total: int) -> None:
        self.progress.update(self.inner, completed=done, total=max(total, 1), description="requests")

    def warn(self, message: str) -> None:
        if self.enabled:
            self.errors.print(f"warning: {message}", highlight=False, soft_wrap=True)
