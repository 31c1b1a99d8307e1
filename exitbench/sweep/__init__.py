"""Threshold sweeps: tasks × policies × thresholds, plus fixed-depth baselines, one result cell each.

config.py    SweepConfig (and RunOptions, the command line's text form), every refusal of the options
keys.py      the model record and a cell's key: what names a cell
exact.py     one exit config through lm-eval
schedule.py  the plan of a shard's cells, claims between processes, ranks under torchrun
replay/      every cell from one recording pass, and its check against exact reruns
run.py       the one entry: open_sweep, execute, run_sweep
"""
from .config import RunOptions, SweepConfig
from .run import Sweep, SweepOutcome, execute, open_sweep, run_sweep

__all__ = ["RunOptions", "Sweep", "SweepConfig", "SweepOutcome", "execute", "open_sweep", "run_sweep"]
