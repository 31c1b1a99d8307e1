"""The `exitbench` command: each command parses its options into a config, makes one library call and renders
what it returns.

app.py      the Typer app, consoles, shared options, option groups made from config dataclasses
run.py      run (a sweep), and lm-eval's own CLI with the exitbench model
results.py  pareto, report, check, export: reading result cells
studies.py  trace, geometry, calibrate, fit-exit: studies of one checkpoint's loop
train.py    train
models.py   info, presets, policies
"""
# Each module registers its commands on `app`, in the order `exitbench --help` lists them.
from . import run, results, studies, train, models  # noqa: F401, I001
from .app import app, main

__all__ = ["app", "main"]
