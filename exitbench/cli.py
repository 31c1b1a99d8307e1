"""The `exitbench` command: each command is a few lines over library calls."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import ExitbenchError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Benchmark per-token exit policies of recurrent-depth transformers.")
console = Console()
err_console = Console(stderr=True)

CheckpointOpt = typer.Option(None, "--checkpoint", "-c",
                             help="Checkpoint directory or embedded name (default: the embedded tiny-raven).")
DtypeOpt = typer.Option("float32", "--dtype", help="float32 or bfloat16.")


@app.callback()
def _root() -> None:
    """Keeps `exitbench` a command group, so every command is spelled out."""


def one_line_errors(fn):
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ExitbenchError as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    return wrapper


@app.command()
@one_line_errors
def info(checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt,
         as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")):
    """Architecture, parameter count, layer split, loop depths, tokenizer and provenance of a checkpoint."""
    from .embedded import open_checkpoint
    from .info import describe

    report = describe(open_checkpoint(checkpoint, dtype))
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(title=f"exitbench info: {report['source']}", show_header=False)
    for key, value in report.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
