"""The training knobs, defined once.

`TrainSettings`'s fields are the knobs of `exitbench train`: each one's type, default, help text and flag live
here and nowhere else. One flat set serves every family (the recipes read the knobs that concern them), so a
run records them all, `dataclasses.asdict` of the config, in this order: checkpoints' `train_config` and a saved
run's state, which `--resume` compares against. The per-family defaults and the per-family checks belong to
the recipes; `config.TrainConfig` joins the two.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..errors import ExitbenchError


def setting(default: Any = MISSING, help: str | None = None, *, flags: tuple[str, ...] = (),
            command_line: bool = True, resumable: bool = False, command_line_default: Any = MISSING) -> Any:
    """A knob: the dataclass field with its metadata, the one statement of what it is for.

    Metadata keys, every field has them: `help` (the option's help text), `flags` (the option's names where they
    differ from --field-name), `command_line` (`exitbench train` offers it as an option), `resumable` (it may
    differ when a run is resumed: how long to go on, how often to save). `command_line_default`, only where
    given: the default the command line shows where it is not the field's."""
    metadata = {"help": help, "flags": flags, "command_line": command_line, "resumable": resumable}
    if command_line_default is not MISSING:
        metadata["command_line_default"] = command_line_default
    return field(default=default, metadata=metadata)


def off_line(default: Any, help: str) -> Any:
    """A knob the command line does not offer: a recipe default, settable from Python."""
    return setting(default, help, command_line=False)


@dataclass
class TrainSettings:
    """Every knob of a training run, of every family."""

    out: str = setting(help="Directory for the new checkpoint.", flags=("--out", "-o"), resumable=True)
    arch: str = setting("huginn_raven", "huginn_raven or ouro (synthetic chains), looped_gpt2 (GSM8K text).")
    # The chains task and its hop curriculum (huginn_raven, ouro).
    task: str = setting("chains", "huginn_raven: synthetic training task.")
    n_chains: int = setting(4, "huginn_raven: interleaved chains per program.", flags=("--chains",))
    max_hop: int = setting(12, "huginn_raven: chain length, the hardest difficulty level.")
    start_hop: int = off_line(2, "The chain length the hop curriculum starts at.")
    level_up_accuracy: float = off_line(0.9, "The running accuracy at the current chain length that raises it.")
    # The model's layout.
    n_embd: int = setting(128, "Hidden size.")
    n_heads: int = setting(4, "Attention heads.")
    intermediate_size: int = setting(256, "huginn_raven: gated MLP inner size.")
    prelude_layers: int = setting(0, "huginn_raven: prelude layers (attention there lets the loop idle).")
    core_layers: int = setting(1, "huginn_raven: layers in the recurrent core; ouro: layers in the loop (all of "
                                  "them).")
    coda_layers: int = setting(0, "huginn_raven: coda layers.")
    # looped_gpt2: layers, loop groups ("1;2,3;4" = [[1], [2, 3], [4]]), window length, BPE size, text source.
    n_layer: int = setting(6, "looped_gpt2: layers.")
    loop_groups: str = setting("1;2,3;4", "looped_gpt2: loop groups, ';' between groups, ',' between layers.")
    context: int = setting(128, "looped_gpt2: training window length (the model's context is 2×).")
    vocab_size: int = setting(2048, "looped_gpt2: size of the byte-level BPE fitted to the text.")
    gsm8k_dir: str | None = setting(None, "looped_gpt2: local GSM8K (train.jsonl); default: the hub's "
                                          "openai/gsm8k.")
    mean_recurrence: int = setting(16, "Mean sampled r per loop group [huginn_raven 16, looped_gpt2 4].")
    # ouro: the trained depth T, stage I's entropy weight β, stage II's length, learning rate and label shape.
    ut_steps: int = setting(12, "ouro: the trained depth T (every step is scored).")
    entropy_beta: float = setting(0.1, "ouro: stage I's weight on the exit distribution's entropy.")
    gate_steps: int = setting(300, "ouro: stage II steps (the gate alone), after --steps of stage I.")
    gate_lr: float = setting(1e-3, "ouro: stage II's peak learning rate.")
    gate_k: float = setting(50.0, "ouro: stage II label sharpness k in σ(k (I − γ)).")
    gate_gamma: float = setting(0.005, "ouro: stage II's loss improvement γ worth another step.")
    # Depth, and the optimizer.
    max_recurrence: int = setting(32, "Deepest r the checkpoint is meant to run [32, 12].")
    backprop_depth: int = setting(8, "Iterations that keep gradients [8, 12].")
    recurrence_sigma: float = off_line(0.5, "σ of the log-normal depth sampler (Huginn §1.6).")
    batch_size: int = setting(64, "Sequences per step [64, 32].")
    lr: float = setting(2e-3, "Peak learning rate, AdamW with cosine decay [2e-3, 1e-3].")
    weight_decay: float = off_line(0.1, "AdamW's weight decay on matrices (not norms, biases or the embedding).")
    warmup: int = off_line(50, "Steps of linear learning-rate warm-up before the cosine decay.")
    # The run.
    steps: int = setting(1500, "Optimizer steps.", resumable=True, command_line_default=2000)
    time_budget: float | None = setting(None, "Stop after this many seconds.", resumable=True)
    save_every: int | None = setting(None, "Keep a checkpoint every N steps.", resumable=True)
    seed: int = setting(0, "Seed: same seed, same checkpoint.")
    threads: int | None = setting(None, "torch CPU threads.", resumable=True)
    resume: bool = setting(False, "Continue the run saved in --out.", resumable=True)

    @classmethod
    def resumable(cls) -> set[str]:
        """The knobs that may differ when a run is resumed."""
        return {f.name for f in fields(cls) if f.metadata["resumable"]}

    def flag(self, name: str) -> str:
        """The option that sets knob `name`, as a recorded command spells it."""
        return (self.__dataclass_fields__[name].metadata["flags"] or ("--" + name.replace("_", "-"),))[0]

    def check_shared(self) -> None:
        """Refuse the settings every family reads, before anything is written."""
        positive = ["n_chains", "max_hop", "start_hop", "n_embd", "n_heads", "intermediate_size", "core_layers",
                    "mean_recurrence", "max_recurrence", "backprop_depth", "batch_size", "steps", "warmup"]
        for name in positive:
            value = getattr(self, name)
            if name == "warmup" and value == 0:
                continue
            if value <= 0:
                raise ExitbenchError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        for name in ["prelude_layers", "coda_layers"]:
            if getattr(self, name) < 0:
                raise ExitbenchError(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(self, name)}")
        if self.n_embd % self.n_heads or (self.n_embd // self.n_heads) % 2:
            raise ExitbenchError(f"--n-embd {self.n_embd} must split into --n-heads {self.n_heads} even-sized heads")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ExitbenchError(f"--lr must be a positive number, got {self.lr}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ExitbenchError(f"--time-budget must be a positive number of seconds, got {self.time_budget}")
        if self.save_every is not None and self.save_every <= 0:
            raise ExitbenchError(f"--save-every must be a positive number of steps, got {self.save_every}")
        if not 0 < self.level_up_accuracy <= 1:
            raise ExitbenchError(f"--level-up-accuracy must be in (0, 1], got {self.level_up_accuracy}")
