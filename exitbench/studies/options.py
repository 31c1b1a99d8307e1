"""The study commands' options, each command's as one dataclass, as `exitbench run` has RunOptions: the CLI
derives their flags from these fields (cli/app.py `options_from`), and a notebook or a bench builds the same
object. The exit knobs a study takes come from ExitConfig, as for `run`; the options several commands share are
runtime/options.py's."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..runtime.options import (checkpoint_option, compile_option, data_dir_option, dtype_option, nonfinite_option,
                               option, threads_option)

EXIT_CONFIG_HELP = "YAML file of exit knobs, beside the flags (a knob set in both is refused)."
DATA_DIR_HELP = "Local GSM8K for gsm8k tasks."


@dataclass
class TraceOptions:
    """`exitbench trace PROMPT`'s options."""
    checkpoint: Optional[str] = checkpoint_option()
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()
    generate: int = field(default=0, metadata=option("Generate this many tokens instead of scoring the prompt."))
    exit_config: Optional[Path] = field(default=None, metadata=option(EXIT_CONFIG_HELP))
    seed: int = field(default=0, metadata=option("Seed of the initial-state noise."))
    compile_step: bool = compile_option()
    threads: Optional[int] = threads_option()
    vs: list[str] = field(default_factory=list, metadata=option(
        "Also trace this policy (POLICY or POLICY:τ, repeatable), drawn beside the first.", "--vs"))
    html: Optional[Path] = field(default=None, metadata=option("Also draw the exit map to this HTML file.", "--html"))
    png: Optional[Path] = field(default=None, metadata=option("Also draw the exit map to this PNG file.", "--png"))
    json_out: Optional[Path] = field(default=None, metadata=option(
        "Also write the traces (token ids and text, exit steps, log-probs, signals per step) to this JSON file.",
        "--json"))
    add_bos_token: Optional[bool] = field(default=None, metadata=option(
        "Force BOS on (or off) the prompt, as run's option (default: the tokenizer decides, as run does).",
        "--add-bos-token/--no-add-bos-token"))


@dataclass
class GeometryOptions:
    """`exitbench geometry`'s options."""
    checkpoint: Optional[str] = checkpoint_option()
    checkpoints: Optional[str] = field(default=None, metadata=option(
        "Comma-separated checkpoints of one model across training; DIR:training expands to the step-N "
        "checkpoints `exitbench train --save-every` kept.", "--checkpoints"))
    task: Optional[str] = field(default=None, metadata=option("Measure on this lm-eval task's documents.",
                                                              "--task", "-t"))
    text: Optional[str] = field(default=None, metadata=option(
        "Measure on this text file (blank-line separated documents).", "--text"))
    data_dir: Optional[str] = data_dir_option(DATA_DIR_HELP)
    steps: Optional[int] = field(default=None, metadata=option("Iterations per loop group [the group's max].",
                                                               "--steps", "-n"))
    tokens: int = field(default=4096, metadata=option("Tokens of --task/--text to measure on.", "--tokens"))
    programs: int = field(default=128, metadata=option(
        "Held-out programs (chains-trained checkpoints, no --task/--text).", "--programs"))
    seed: int = field(default=0, metadata=option("Seed of held-out programs and initial states.", "--seed"))
    out: Path = field(default=Path("results/geometry"), metadata=option(
        "Directory for geometry.json and the figures.", "--out", "-o"))
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()


@dataclass
class CalibrateOptions:
    """`exitbench calibrate`'s options."""
    epsilon: float = field(default=0.05, metadata=option(
        "Tolerated risk: the share of a document's tokens whose prediction differs from full depth.", "--epsilon"))
    delta: float = field(default=0.1, metadata=option(
        "Allowed probability that the chosen threshold's risk exceeds epsilon.", "--delta"))
    thresholds: Optional[str] = field(default=None, metadata=option(
        "Comma-separated thresholds (default: the policy's grid)."))
    checkpoint: Optional[str] = checkpoint_option()
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()
    task: Optional[str] = field(default=None, metadata=option("Calibrate on this lm-eval task's documents.",
                                                              "--task", "-t"))
    text: Optional[str] = field(default=None, metadata=option(
        "Calibrate on this text file (blank-line separated documents).", "--text"))
    data_dir: Optional[str] = data_dir_option(DATA_DIR_HELP)
    tokens: int = field(default=8192, metadata=option("Tokens of --task/--text to use.", "--tokens"))
    programs: int = field(default=256, metadata=option(
        "Held-out programs (chains-trained checkpoints, no --task/--text).", "--programs"))
    test_fraction: float = field(default=0.5, metadata=option(
        "Documents held out to check the chosen threshold.", "--test-fraction"))
    batch_size: int = field(default=16, metadata=option("Sequences run together (never changes answers)."))
    seed: int = field(default=0, metadata=option("Seed of the held-out split, programs and initial-state noise."))
    replay: bool = field(default=False, metadata=option(
        "Every threshold from one recording pass per split instead of one run each (docs/sweeps.md on replay).",
        "--replay"))
    out: Optional[Path] = field(default=None, metadata=option(
        "JSON report [results/calibrate/<checkpoint>-<policy>.json].", "--out", "-o"))
    threads: Optional[int] = threads_option()
    exit_config: Optional[Path] = field(default=None, metadata=option(EXIT_CONFIG_HELP))


@dataclass
class FitExitOptions:
    """`exitbench fit-exit`'s options."""
    checkpoint: Optional[str] = checkpoint_option()
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()
    task: Optional[str] = field(default=None, metadata=option(
        "Fit on this lm-eval task's training (else validation) split, never the split it evaluates.",
        "--task", "-t"))
    text: Optional[str] = field(default=None, metadata=option(
        "Fit on this text file (blank-line separated documents).", "--text"))
    data_dir: Optional[str] = data_dir_option(DATA_DIR_HELP)
    limit: int = field(default=256, metadata=option("Documents (or held-out programs) to fit on.", "--limit"))
    tokens: int = field(default=65536, metadata=option("Cap on the tokens of those documents.", "--tokens"))
    disjoint_from: Optional[str] = field(default=None, metadata=option(
        "Drop documents that begin with an evaluation document of these tasks (default: --task, or chains for "
        "held-out programs).", "--disjoint-from"))
    kind: str = field(default="mlp", metadata=option(
        "mlp (one hidden tanh layer of 32) or logistic (regression).", "--kind"))
    batch_size: int = field(default=16, metadata=option("Sequences recorded together."))
    seed: int = field(default=0, metadata=option("Seed of the programs, the validation split and the noise."))
    out: Optional[Path] = field(default=None, metadata=option(
        "Exit-model JSON [results/exit-models/<checkpoint>.json].", "--out", "-o"))
    exit_config: Optional[Path] = field(default=None, metadata=option(EXIT_CONFIG_HELP))
