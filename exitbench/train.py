"""`exitbench train`: a Raven model from scratch on the synthetic chains task, the way Huginn was trained.

Recurrence is sampled per batch (Huginn §1.6): τ ~ N(log(mean) − σ²/2, σ), r = 1 + Poisson(e^τ), with
gradients only through the last `backprop_depth` iterations. What makes the iterations matter on a model this
small (shared/reference/depth-recipe.md): no attention outside the core, one token per statement, a target at
every statement, and a hop curriculum that raises the chain length once the current level is learned.

Everything random is drawn from generators keyed by (seed, step), so a run is deterministic for a seed and a
resumed run continues with exactly the batches it would have seen.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .errors import ExitbenchError
from .models import Raven, RavenConfig, save_checkpoint
from .models.checkpoint import CONFIG_FILE
from .provenance import run_metadata
from . import synthetic

TRAINING_DIR = "training"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
# Fields that may differ when a run is resumed: how long to go on, how often to save.
RESUMABLE = {"steps", "time_budget", "save_every", "out", "resume", "threads"}


@dataclass
class TrainConfig:
    out: str
    task: str = "chains"
    n_chains: int = 4
    max_hop: int = 12
    start_hop: int = 2
    level_up_accuracy: float = 0.9
    n_embd: int = 128
    n_heads: int = 4
    intermediate_size: int = 256
    prelude_layers: int = 0
    core_layers: int = 1
    coda_layers: int = 0
    mean_recurrence: int = 16
    max_recurrence: int = 32
    backprop_depth: int = 8
    recurrence_sigma: float = 0.5
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup: int = 50
    steps: int = 1500
    time_budget: float | None = None
    save_every: int | None = None
    seed: int = 0
    threads: int | None = None
    resume: bool = False

    def validate(self) -> None:
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
        if self.max_recurrence < self.mean_recurrence:
            raise ExitbenchError(f"--max-recurrence {self.max_recurrence} is below --mean-recurrence "
                                 f"{self.mean_recurrence}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ExitbenchError(f"--lr must be a positive number, got {self.lr}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ExitbenchError(f"--time-budget must be a positive number of seconds, got {self.time_budget}")
        if self.save_every is not None and self.save_every <= 0:
            raise ExitbenchError(f"--save-every must be a positive number of steps, got {self.save_every}")
        if not 0 < self.level_up_accuracy <= 1:
            raise ExitbenchError(f"--level-up-accuracy must be in (0, 1], got {self.level_up_accuracy}")
        synthetic.make_task(self.task, n_chains=self.n_chains, length=self.max_hop)

    def command(self) -> str:
        """The `exitbench train` command line that reproduces this run (non-default options spelled out)."""
        flags = {"n_chains": "--chains"}
        defaults = TrainConfig(out=self.out)
        parts = ["exitbench", "train", "--out", self.out, "--steps", str(self.steps), "--seed", str(self.seed)]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("out", "steps", "seed") or value == getattr(defaults, f.name):
                continue
            flag = flags.get(f.name, "--" + f.name.replace("_", "-"))
            parts += [flag] if value is True else [flag, str(value)]
        return " ".join(parts)

    def model_config(self, tokenizer: synthetic.Tokenizer) -> RavenConfig:
        return RavenConfig(
            n_embd=self.n_embd, n_heads=self.n_heads, vocab_size=tokenizer.vocab_size,
            intermediate_size=self.intermediate_size, n_layers_in_prelude=self.prelude_layers,
            n_layers_in_recurrent_block=self.core_layers, n_layers_in_coda=self.coda_layers,
            block_size=256, mean_recurrence=self.mean_recurrence,
            mean_backprop_depth=self.backprop_depth, max_recurrence=self.max_recurrence,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)


def sample_recurrence(rng: random.Random, mean: int, backprop_depth: int, sigma: float, cap: int
                      ) -> tuple[int, int]:
    """(no-grad steps, grad steps) from Huginn's log-normal Poisson sampler, capped at `cap` in total."""
    tau = rng.gauss(math.log(mean) - sigma ** 2 / 2, sigma)
    total = min(_poisson(rng, math.exp(tau)) + 1, cap)
    grad = min(backprop_depth, total)
    return total - grad, grad


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method is exact and fast for the small means used here, and keeps all randomness in `rng`.
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _step_rng(seed: int, step: int, stream: int) -> random.Random:
    return random.Random((seed * 1_000_003 + step) * 7 + stream)


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: Raven, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wte" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


@dataclass
class TrainState:
    step: int = 0
    level: int = 2
    level_accuracy: float = 0.0
    elapsed: float = 0.0
    tokens: int = 0
    loss: float = float("nan")
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def check_output(cfg: TrainConfig) -> Path:
    """Fail before training if the output cannot be written, or a resume does not match what is there."""
    out = Path(cfg.out).expanduser()
    state_file = out / TRAINING_DIR / STATE_FILE
    if cfg.resume:
        if not state_file.exists():
            raise ExitbenchError(f"--resume: {out} holds no training state ({TRAINING_DIR}/{STATE_FILE})")
        saved = json.loads(state_file.read_text())["config"]
        for key, value in dataclasses.asdict(cfg).items():
            if key not in RESUMABLE and saved.get(key) != value:
                raise ExitbenchError(f"--resume: {out} was trained with {key}={saved.get(key)!r}, "
                                     f"not {value!r}; resume with the same settings or use a new --out")
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExitbenchError(f"output {out} already exists and is not empty; choose a new --out or pass --resume")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(out.parent) / f".{out.name}.write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ExitbenchError(f"cannot write to {out.parent}: {exc.strerror}") from None
    return out


def _save_training_state(out: Path, cfg: TrainConfig, state: TrainState, opt: torch.optim.Optimizer) -> None:
    directory = out / TRAINING_DIR
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (pid, pstate) in enumerate(opt.state_dict()["state"].items()):
        for name, value in pstate.items():
            tensors[f"{pid}.{name}"] = value.reshape(-1) if value.dim() == 0 else value
    tmp = directory / (OPTIMIZER_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(directory / OPTIMIZER_FILE)
    payload = {"config": dataclasses.asdict(cfg), "state": dataclasses.asdict(state)}
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(directory / STATE_FILE)


def _load_training_state(out: Path, model: Raven, opt: torch.optim.Optimizer) -> TrainState:
    from .models import load_checkpoint

    directory = out / TRAINING_DIR
    saved = load_checkpoint(directory / "latest").model
    model.load_state_dict(saved.state_dict())
    opt_state = opt.state_dict()
    tensors = load_file(str(directory / OPTIMIZER_FILE))
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        if name == "step":
            value = value.reshape(())
        opt_state["state"].setdefault(int(pid), {})[name] = value
    opt.load_state_dict(opt_state)
    return TrainState(**json.loads((directory / STATE_FILE).read_text())["state"])


def train(cfg: TrainConfig, command: str | None = None,
          on_step: Callable[[TrainState, TrainConfig], None] | None = None) -> Path:
    """Train, save intermediate checkpoints under OUT/training/, and the final model in OUT itself."""
    cfg.validate()
    out = check_output(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = synthetic.build_tokenizer()
    model = Raven(cfg.model_config(tokenizer))
    init_gen = torch.Generator().manual_seed(cfg.seed)
    model.init_weights(init_gen)
    with torch.no_grad():
        std = model.transformer.wte.weight.std().item()
        table = synthetic.factored_embedding(tokenizer, cfg.n_embd, std, init_gen)
        model.transformer.wte.weight[: table.shape[0]] = table
    model.train()
    opt = _optimizer(model, cfg)
    state = TrainState(level=min(cfg.start_hop, cfg.max_hop))
    if cfg.resume:
        state = _load_training_state(out, model, opt)
    started = time.perf_counter() - state.elapsed
    ema_loss = None

    while state.step < cfg.steps:
        if cfg.time_budget is not None and time.perf_counter() - started >= cfg.time_budget:
            break
        task = synthetic.make_task(cfg.task, n_chains=cfg.n_chains, length=state.level)
        inputs, targets, hops = synthetic.batch(task, tokenizer, cfg.batch_size, _step_rng(cfg.seed, state.step, 0))
        no_grad, grad = sample_recurrence(_step_rng(cfg.seed, state.step, 1), cfg.mean_recurrence,
                                          cfg.backprop_depth, cfg.recurrence_sigma, cfg.max_recurrence)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + state.step)
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, state.step)
        logits = model(inputs, no_grad + grad, backprop_depth=grad, generator=gen)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=synthetic.IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        state.step += 1
        state.tokens += inputs.numel()
        state.elapsed = time.perf_counter() - started
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        state.loss = ema_loss
        if no_grad + grad >= state.level:
            at_level = hops == state.level
            correct = (logits.argmax(-1)[at_level] == targets[at_level]).float().mean().item()
            state.level_accuracy = 0.9 * state.level_accuracy + 0.1 * correct
            if state.level_accuracy >= cfg.level_up_accuracy and state.level < cfg.max_hop:
                state.history.append({"step": state.step, "level": state.level + 1, "elapsed": state.elapsed})
                state.level += 1
                state.level_accuracy = 0.0
        if on_step:
            on_step(state, cfg)
        if cfg.save_every and state.step % cfg.save_every == 0:
            _checkpoint(model, tokenizer, out / TRAINING_DIR / f"step-{state.step:06d}", cfg, state, command)
            _checkpoint(model, tokenizer, out / TRAINING_DIR / "latest", cfg, state, command)
            _save_training_state(out, cfg, state, opt)

    model.eval()
    _checkpoint(model, tokenizer, out, cfg, state, command)
    _checkpoint(model, tokenizer, out / TRAINING_DIR / "latest", cfg, state, command)
    _save_training_state(out, cfg, state, opt)
    return out


def _checkpoint(model: Raven, tokenizer, path: Path, cfg: TrainConfig, state: TrainState,
                command: str | None) -> None:
    training = {
        "command": command or cfg.command(),
        "seed": cfg.seed,
        "train_config": dataclasses.asdict(cfg),
        "steps_done": state.step,
        "training_seconds": round(state.elapsed, 3),
        "tokens_seen": state.tokens,
        "final_level": state.level,
        "curriculum": state.history,
        "final_loss": state.loss,
    }
    extra = {"exitbench": {"training": training, "run": run_metadata(seed=cfg.seed)}}
    save_checkpoint(model, path, tokenizer, extra_config=extra, overwrite=True)
