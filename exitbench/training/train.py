"""`exitbench train`: a looped model from scratch, the way recurrent-depth models are trained.

One loop trains every family; a recipe per family says what differs (recipe.py): `huginn_raven` on the synthetic
chains task (raven.py), `looped_gpt2` on GSM8K text (gpt2.py), and `ouro`'s two stages on the chains task
(ouro.py). `config.RECIPES` names them by --arch. The loop: AdamW, gradient clipping, a running loss, the
training state saved beside the checkpoints so that --resume continues exactly, checkpoints every --save-every
steps and at the end, each recording the command that reproduces it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..errors import ExitbenchError
from ..models import LoopedLM, save_checkpoint
from ..runtime.provenance import run_metadata
from .config import TrainConfig
from .recipe import Recipe, TrainState

TRAINING_DIR = "training"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def _decayed(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices, not on norms, biases or the (tied) token embedding."""
    return p.dim() >= 2 and "wte" not in name and "embed_tokens" not in name


def _optimizer(model: LoopedLM, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if _decayed(n, p)]
    rest = [p for n, p in model.named_parameters() if not _decayed(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def check_output(cfg: TrainConfig) -> Path:
    """Fail before training if the output cannot be written, or a resume does not match what is there."""
    out = Path(cfg.out).expanduser()
    state_file = out / TRAINING_DIR / STATE_FILE
    if cfg.resume:
        if not state_file.exists():
            raise ExitbenchError(f"--resume: {out} holds no training state ({TRAINING_DIR}/{STATE_FILE})")
        saved, resumable = json.loads(state_file.read_text())["config"], TrainConfig.resumable()
        for key, value in dataclasses.asdict(cfg).items():
            if key not in resumable and saved.get(key) != value:
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


def _load_training_state(out: Path, model: LoopedLM, opt: torch.optim.Optimizer) -> TrainState:
    from ..models import load_checkpoint

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


def status(state: TrainState, cfg: TrainConfig) -> str:
    """What a progress line shows beside the loss."""
    return cfg.recipe.status(cfg, state)


def train(cfg: TrainConfig, command: str | None = None,
          on_step: Callable[[TrainState], None] | None = None) -> Path:
    """Train, save intermediate checkpoints under OUT/training/, and the final model in OUT itself."""
    cfg.validate()
    out = check_output(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    recipe = cfg.recipe(cfg)
    model = recipe.build_model(torch.Generator().manual_seed(cfg.seed))
    model.train()
    opt = _optimizer(model, cfg)
    state = TrainState(level=min(cfg.start_hop, cfg.max_hop))
    if cfg.resume:
        state = _load_training_state(out, model, opt)
    started = time.perf_counter() - state.elapsed
    ema_loss = None

    while state.step < cfg.total_steps:
        if cfg.time_budget is not None and time.perf_counter() - started >= cfg.time_budget:
            break
        inputs, targets, hops = recipe.batch(state)
        for group in opt.param_groups:
            group["lr"] = recipe.lr_at(state.step)
        loss, logits, steps = recipe.loss(model, inputs, targets, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        state.step += 1
        state.tokens += inputs.numel()
        state.elapsed = time.perf_counter() - started
        if recipe.restarts_loss_average(state.step):
            ema_loss = None
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        state.loss = ema_loss
        recipe.after_step(state, logits, targets, hops, steps)
        kept = recipe.kept_checkpoint(state.step)
        if kept is not None:
            _checkpoint(model, recipe, out / kept, state, command)
        if on_step:
            on_step(state)
        if cfg.save_every and state.step % cfg.save_every == 0:
            _checkpoint(model, recipe, out / TRAINING_DIR / f"step-{state.step:06d}", state, command)
            _checkpoint(model, recipe, out / TRAINING_DIR / "latest", state, command)
            _save_training_state(out, cfg, state, opt)

    model.eval()
    _checkpoint(model, recipe, out, state, command)
    _checkpoint(model, recipe, out / TRAINING_DIR / "latest", state, command)
    _save_training_state(out, cfg, state, opt)
    return out


def _checkpoint(model: LoopedLM, recipe: Recipe, path: Path, state: TrainState, command: str | None) -> None:
    cfg = recipe.cfg
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
        **recipe.record(state),
    }
    extra = {"exitbench": {"training": training, "run": run_metadata(seed=cfg.seed)}}
    save_checkpoint(model, path, recipe.tokenizer, extra_config=extra, overwrite=True)
