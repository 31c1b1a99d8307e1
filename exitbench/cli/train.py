"""`exitbench train`: a looped model from scratch. Its options are TrainConfig's fields (training/settings.py)."""
from __future__ import annotations

from pathlib import Path

from ..training.config import TrainConfig
from .app import command, console, option_specs


def _train_options():
    """TrainConfig's command-line knobs; --out is a path, as the recorded command has always spelled it."""
    return [(name, Path if name == "out" else kind, default, meta) for name, kind, default, meta in TrainConfig.options()]


@command()
@option_specs(_train_options(), into="given")
def train(given: dict = None):
    """Train a looped model from scratch: Raven or Ouro on synthetic chains, or looped GPT-2 on GSM8K text
    (CPU-sized)."""
    from ..runtime.progress import training_progress
    from ..training.train import status
    from ..training.train import train as run_training

    out, arch = given.pop("out"), given.pop("arch")
    cfg = TrainConfig.for_arch(str(out), arch, **given)
    with training_progress(console, cfg.total_steps, lambda state: status(state, cfg)) as on_step:
        path = run_training(cfg, on_step=on_step)
    console.print(f"saved {path}")
