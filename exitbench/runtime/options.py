"""Command-line options as dataclass fields: a command's options are one dataclass (`exitbench run`'s RunOptions,
the studies' TraceOptions, CalibrateOptions, …), whose fields' metadata give each flag's help and spelling, and the
CLI derives the command's flags from it (cli/app.py `options_from`). The options several commands share are made
here once, so each is stated in one place whichever command takes it."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def option(help: str, *flags: str) -> dict[str, Any]:
    """A command-line option's metadata: its help and, where they differ from --field-name, its flags."""
    return {"help": help, "flags": flags}


def checkpoint_option() -> Any:
    return field(default=None, metadata=option(
        "Checkpoint directory or embedded name (default: the embedded tiny-raven).", "--checkpoint", "-c"))


def dtype_option() -> Any:
    return field(default="auto", metadata=option(
        "auto (the checkpoint's own torch_dtype), float32, bfloat16 or float16."))


def nonfinite_option() -> Any:
    return field(default=False, metadata=option(
        "Load weights that hold NaN or inf (for studying broken checkpoints); refused by default.",
        "--allow-nonfinite"))


def threads_option() -> Any:
    return field(default=None, metadata=option(
        "torch CPU threads for the model (default: torch's, one per core; on a busy machine fewer threads time "
        "more steadily); recorded in each result.", "--threads"))


def compile_option() -> Any:
    return field(default=False, metadata=option(
        "torch.compile each loop group's step (dynamic shapes): faster iterations after a one-off compilation "
        "of tens of seconds.", "--compile"))


def data_dir_option(help: str = "Local GSM8K copy (train.jsonl, test.jsonl).") -> Any:
    return field(default=None, metadata=option(help, "--data-dir"))
