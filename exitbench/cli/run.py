"""`exitbench run` (a sweep) and `exitbench lm-eval` (lm-eval's own CLI with the exitbench model)."""
from __future__ import annotations

from pathlib import Path

import typer

from ..sweep.backends import backend
from ..sweep.config import RunOptions, SweepConfig
from .app import (KNOBS_SHARED_BY_A_SWEEP, app, console, err_console, exit_knobs, given_on_command_line,
                  one_line_errors, options_from, say)


@app.command()
@one_line_errors
@exit_knobs(*KNOBS_SHARED_BY_A_SWEEP)
@options_from(RunOptions)
def run(options: RunOptions = None, knobs: dict = None, ctx: typer.Context = None):
    """Run lm-eval tasks under each exit policy and threshold (plus fixed depths): one result cell each.

    The exit knobs (--min-steps, --patience, …) apply to every policy of the sweep that takes them."""
    from ..runtime.devices import use_threads
    from ..runtime.distributed import finish_distributed
    from ..runtime.progress import SweepProgress
    from ..runtime.signals import Terminated, terminate_raises
    from ..sweep.run import execute, open_sweep

    use_threads(options.threads)
    cfg = SweepConfig.from_options(options, knobs, given_on_command_line(ctx))
    sweep = open_sweep(cfg, warn=say)
    try:
        with terminate_raises(), SweepProgress(console, err_console, len(sweep.plan.cells), enabled=sweep.rank0,
                                               quiet=cfg.quiet) as progress:
            outcome = execute(sweep, progress)
    except (KeyboardInterrupt, Terminated) as stop:
        if sweep.rank0:
            say(interrupted_note(sweep.out, [key for _, _, key in sweep.plan.cells]))
        raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
    if sweep.rank0:
        show_outcome(sweep, outcome)
    backend(cfg.backend).teardown()
    finish_distributed()


def show_outcome(sweep, outcome) -> None:
    """The run table, its timing warnings and, when verified, replay vs exact."""
    from ..analysis.notes import timing_notes
    from ..analysis.tables import replay_table, summary_table
    from ..sweep.run import summary_rows

    reused = {c["cell_id"] for c in sweep.plan.reused()}
    title = f"{len(outcome.cells)} cells in {sweep.out}{backend(sweep.cfg.backend).title()}"
    console.print(summary_table(summary_rows(outcome.cells, reused), title=title))
    for note in timing_notes(outcome.cells):
        say(str(note))
    if outcome.verified is not None:
        console.print(replay_table(outcome.verified["rows"], title=f"replay vs exact ({sweep.out / 'verify'})"))
    if not sweep.cfg.quiet:
        say(f"next: exitbench pareto {sweep.out} --plot pareto.png   (frontiers, the matched-quality table)\n"
            f"      exitbench report {sweep.out}   (one HTML page of the sweep)")


def interrupted_note(out: Path, keys: list[dict]) -> str:
    """What Ctrl-C (or SIGTERM) leaves: how many of the sweep's cells are on disk (each written whole,
    atomically), and how the rest is run."""
    from ..store import cells, disk

    ids = [cells.cell_id(key) for key in keys]
    kept = len(disk.written(out, ids))
    return (f"interrupted: {kept} of the sweep's {len(ids)} cells are finished and kept in {out}; rerun the same "
            "command to resume (finished cells are reused, the rest run)")


# No help option of its own: `--help` belongs to lm-eval, which prints its options.
@app.command(name="lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@one_line_errors
def lm_eval_passthrough(ctx: typer.Context):
    """lm-eval's own CLI with the `exitbench` model registered: `exitbench lm-eval run --model exitbench …`."""
    from ..harness.cli import run_lm_eval

    run_lm_eval(ctx.args)
