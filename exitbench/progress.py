"""Rich progress displays for long loops (training, sweeps)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .train import TrainConfig, TrainState, status


@contextmanager
def training_progress(console: Console, cfg: TrainConfig) -> Iterator[Callable[[TrainState, TrainConfig], None]]:
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f} · {task.fields[status]} · {task.fields[tps]:,.0f} tok/s"),
               TimeRemainingColumn()]
    if not console.is_terminal:
        # Logs (CI, nohup) get a plain line every ~5% instead of a live bar.
        every = max(1, cfg.steps // 20)

        def log_step(state: TrainState, _: TrainConfig) -> None:
            if state.step % every == 0 or state.step == cfg.steps:
                tps = state.tokens / state.elapsed if state.elapsed > 0 else 0.0
                console.print(f"step {state.step}/{cfg.steps} loss {state.loss:.3f} {status(state, cfg)} "
                              f"{tps:,.0f} tok/s {state.elapsed:.0f}s", highlight=False)

        yield log_step
        return
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=cfg.steps, loss=float("nan"), status="", tps=0.0)

        def on_step(state: TrainState, _: TrainConfig) -> None:
            tps = state.tokens / state.elapsed if state.elapsed > 0 else 0.0
            progress.update(task, completed=state.step, loss=state.loss, status=status(state, cfg), tps=tps)

        yield on_step


@contextmanager
def batch_progress(console: Console, label: str) -> Iterator[Callable[[int, int], None]]:
    """A transient bar fed (done, total); silent when the console is not a terminal."""
    if not console.is_terminal:
        yield lambda done, total: None
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


class SweepProgress:
    """A bar over the grid's cells and one over the requests inside the current cell."""

    def __init__(self, console: Console, n_cells: int, enabled: bool = True):
        self.console, self.enabled = console, enabled
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), console=console, transient=True, disable=not enabled)
        self.grid = self.progress.add_task("cells", total=n_cells)
        self.inner = self.progress.add_task("requests", total=1, visible=False)

    def __enter__(self) -> "SweepProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def cell_started(self, label: str) -> None:
        self.progress.update(self.grid, description=f"cells · {label}")
        self.progress.update(self.inner, completed=0, total=1, visible=True)

    def cell_skipped(self, label: str) -> None:
        self.progress.advance(self.grid)

    def cell_finished(self, label: str) -> None:
        self.progress.advance(self.grid)
        if not self.console.is_terminal and self.enabled:
            done = int(self.progress.tasks[self.grid].completed)
            self.console.print(f"[{done}/{int(self.progress.tasks[self.grid].total)}] {label}", highlight=False)

    def requests(self, done: int, total: int) -> None:
        self.progress.update(self.inner, completed=done, total=max(total, 1), description="requests")
