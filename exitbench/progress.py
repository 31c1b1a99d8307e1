"""Rich progress displays for long loops (training, sweeps)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .train import TrainConfig, TrainState


@contextmanager
def training_progress(console: Console, cfg: TrainConfig) -> Iterator[Callable[[TrainState, TrainConfig], None]]:
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f} · hop {task.fields[level]}/{task.fields[max_hop]} "
                          "· {task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn()]
    if not console.is_terminal:
        # Logs (CI, nohup) get a plain line every ~5% instead of a live bar.
        every = max(1, cfg.steps // 20)

        def log_step(state: TrainState, _: TrainConfig) -> None:
            if state.step % every == 0 or state.step == cfg.steps:
                tps = state.tokens / state.elapsed if state.elapsed > 0 else 0.0
                console.print(f"step {state.step}/{cfg.steps} loss {state.loss:.3f} hop {state.level}/{cfg.max_hop} "
                              f"{tps:,.0f} tok/s {state.elapsed:.0f}s", highlight=False)

        yield log_step
        return
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=cfg.steps, loss=float("nan"), level=cfg.start_hop,
                                 max_hop=cfg.max_hop, tps=0.0)

        def on_step(state: TrainState, _: TrainConfig) -> None:
            tps = state.tokens / state.elapsed if state.elapsed > 0 else 0.0
            progress.update(task, completed=state.step, loss=state.loss, level=state.level, tps=tps)

        yield on_step
