"""`exitbench train`: a looped model from scratch, the way recurrent-depth models are trained.

Three recipes share one loop:
- `huginn_raven` on the synthetic chains task (the embedded tiny-raven). What makes the iterations matter on a
  model this small (measured in the README, "The embedded default"): no attention outside the core, one token per statement, a
  target at every statement, and a hop curriculum that raises the chain length once the current level is learned.
- `looped_gpt2` on natural text (the embedded tiny-looped-gpt2), as the two-scale paper trained on FineWeb: GSM8K's
  training split, a byte-level BPE fitted to it, next-token loss on random windows.
- `ouro` on the chains task (the embedded tiny-ouro): every layer in the loop, the final norm after each step,
  an exit gate, and Ouro's two stages (gate_objectives.py): `steps` of stage I (LM and gate on the loss
  expected under the gate's exit distribution, minus β × its entropy) at a fixed T, then `gate_steps` of stage II
  (the gate alone). The stage-I checkpoint is kept as OUT/stage-1, the "untrained gate" Ouro compares against.

For the first two, recurrence is sampled per batch and per loop group (Huginn §1.6): τ ~ N(log(mean) − σ²/2, σ),
r = 1 + Poisson(e^τ), with gradients only through the last `backprop_depth` iterations of each group.

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

from ..errors import ExitbenchError
from ..models import LoopedGPT2, LoopedGPT2Config, LoopedLM, Ouro, OuroConfig, Raven, RavenConfig, save_checkpoint
from ..models.attention import AttnContext
from ..runtime.provenance import run_metadata
from . import gate_objectives, synthetic, textcorpus

TRAINING_DIR = "training"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
# Fields that may differ when a run is resumed: how long to go on, how often to save.
RESUMABLE = {"steps", "time_budget", "save_every", "out", "resume", "threads"}
STAGE_ONE_DIR = "stage-1"
OURO_BRANCH_SCALE = 0.1  # OuroRecipe.build_model says why


ARCHS = ("huginn_raven", "looped_gpt2", "ouro")
CHAINS_ARCHS = ("huginn_raven", "ouro")  # trained on the synthetic chains task
# Where the two recipes differ in their defaults; everything else is shared.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "huginn_raven": {},
    "looped_gpt2": {"mean_recurrence": 4, "max_recurrence": 12, "backprop_depth": 12, "batch_size": 32,
                    "lr": 1e-3, "warmup": 100, "recurrence_sigma": 0.5},
    # Ouro trains at one fixed depth T (ut_steps) with gradients through every step; max_recurrence is only
    # how deep a run may go (twice T, as the Ouro loader's default).
    "ouro": {"max_recurrence": 24, "batch_size": 32},
}


@dataclass
class TrainConfig:
    out: str
    arch: str = "huginn_raven"
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
    # looped_gpt2: layers, loop groups ("1;2,3;4" = [[1], [2, 3], [4]]), window length, BPE size, text source.
    n_layer: int = 6
    loop_groups: str = "1;2,3;4"
    context: int = 128
    vocab_size: int = 2048
    gsm8k_dir: str | None = None
    mean_recurrence: int = 16
    # ouro: the trained depth T, stage I's entropy weight β, stage II's length, learning rate and label shape.
    ut_steps: int = 12
    entropy_beta: float = 0.1
    gate_steps: int = 300
    gate_lr: float = 1e-3
    gate_k: float = 50.0
    gate_gamma: float = 0.005
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

    @classmethod
    def for_arch(cls, out: str, arch: str = "huginn_raven", **given: Any) -> "TrainConfig":
        """A config with `arch`'s defaults, overridden by the options the user gave (None = not given)."""
        if arch not in ARCHS:
            raise ExitbenchError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
        values = {**ARCH_DEFAULTS[arch], **{k: v for k, v in given.items() if v is not None}}
        return cls(out=out, arch=arch, **values)

    @property
    def groups(self) -> list[list[int]]:
        try:
            return [[int(i) for i in part.split(",")] for part in self.loop_groups.split(";")]
        except ValueError:
            raise ExitbenchError(f"--loop-groups {self.loop_groups!r} must be layer indices, groups separated by "
                                 "';' and layers by ',', e.g. '1;2,3;4'") from None

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ExitbenchError(f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}")
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
        if self.arch != "ouro" and self.max_recurrence < self.mean_recurrence:
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
        if self.arch == "ouro":
            if self.ut_steps <= 0 or self.gate_steps < 0:
                raise ExitbenchError(f"--ut-steps must be positive and --gate-steps ≥ 0, got {self.ut_steps} and "
                                     f"{self.gate_steps}")
            if self.max_recurrence < self.ut_steps:
                raise ExitbenchError(f"--max-recurrence {self.max_recurrence} is below --ut-steps {self.ut_steps}")
            for name in ("entropy_beta", "gate_k", "gate_gamma"):
                if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                    raise ExitbenchError(f"--{name.replace('_', '-')} must be a number ≥ 0, got {getattr(self, name)}")
            if not (self.gate_lr > 0 and math.isfinite(self.gate_lr)):
                raise ExitbenchError(f"--gate-lr must be a positive number, got {self.gate_lr}")
        if self.arch in CHAINS_ARCHS:
            synthetic.make_task(self.task, n_chains=self.n_chains, length=self.max_hop)
        else:
            for name in ("n_layer", "context", "vocab_size"):
                if getattr(self, name) <= 0:
                    raise ExitbenchError(f"--{name.replace('_', '-')} must be a positive integer, got "
                                         f"{getattr(self, name)}")
            try:
                self.gpt2_config(None)
            except ExitbenchError as exc:
                raise ExitbenchError(f"--loop-groups {self.loop_groups!r}: {exc}") from None

    def command(self) -> str:
        """The `exitbench train` command line that reproduces this run (non-default options spelled out)."""
        flags = {"n_chains": "--chains"}
        defaults = TrainConfig.for_arch(self.out, self.arch)
        parts = ["exitbench", "train", "--out", self.out, "--steps", str(self.steps), "--seed", str(self.seed)]
        if self.arch != "huginn_raven":
            parts += ["--arch", self.arch]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("out", "steps", "seed", "arch") or value == getattr(defaults, f.name):
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

    def ouro_config(self, tokenizer: synthetic.Tokenizer) -> OuroConfig:
        # Tied head: the statement vocabulary is ~3,200 tokens, and an untied head would double the model.
        return OuroConfig(
            hidden_size=self.n_embd, intermediate_size=self.intermediate_size, num_attention_heads=self.n_heads,
            num_hidden_layers=self.core_layers, vocab_size=tokenizer.vocab_size, max_position_embeddings=256,
            rope_theta=10000.0, tie_word_embeddings=True, total_ut_steps=self.ut_steps,
            max_ut_steps=self.max_recurrence, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: Ouro's stage II comes after its `steps` of stage I."""
        return self.steps + (self.gate_steps if self.arch == "ouro" else 0)

    def gpt2_config(self, tokenizer) -> LoopedGPT2Config:
        groups = self.groups
        # Default depth a little past the sampled mean (E[K] = mean + 1): where held-out quality stops improving.
        default = min(self.mean_recurrence + 2, self.max_recurrence)
        return LoopedGPT2Config(
            vocab_size=tokenizer.vocab_size if tokenizer else self.vocab_size, n_embd=self.n_embd,
            n_layer=self.n_layer, n_head=self.n_heads, n_positions=2 * self.context, loop_groups=groups,
            loop_steps=[default] * len(groups), max_loop_steps=[self.max_recurrence] * len(groups),
            bos_token_id=tokenizer.bos_token_id if tokenizer else None,
            eos_token_id=tokenizer.eos_token_id if tokenizer else None,
            pad_token_id=tokenizer.pad_token_id if tokenizer else None)


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


def _cosine(peak: float, progress: float) -> float:
    """Cosine decay from `peak` to a tenth of it over progress 0 … 1."""
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return _cosine(cfg.lr, min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))


def _decayed(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices, not on norms, biases or the (tied) token embedding."""
    return p.dim() >= 2 and "wte" not in name and "embed_tokens" not in name


def _optimizer(model: LoopedLM, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if _decayed(n, p)]
    rest = [p for n, p in model.named_parameters() if not _decayed(n, p)]
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
    gate: dict[str, float] = dataclasses.field(default_factory=dict)  # ouro: the stage and its objective's parts
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


class SampledDepth:
    """Huginn's training: one depth per loop group and batch from the log-normal Poisson sampler, truncated
    backprop, the next-token loss at the last iterate."""

    cfg: TrainConfig

    def lr_at(self, step: int) -> float:
        return _lr_at(self.cfg, step)

    def loss(self, model: LoopedLM, inputs: torch.Tensor, targets: torch.Tensor, state: TrainState
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        cfg = self.cfg
        # One depth per loop group; the single-group Raven draws exactly what it always drew (stream 1).
        draws = [sample_recurrence(_step_rng(cfg.seed, state.step, 1 + 2 * g), cfg.mean_recurrence,
                                   cfg.backprop_depth, cfg.recurrence_sigma, cfg.max_recurrence)
                 for g in range(len(model.loop_groups()))]
        steps = [a + b for a, b in draws]
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + state.step)
        logits = model(inputs, steps, backprop_depth=[b for _, b in draws], generator=gen)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=synthetic.IGNORE)
        return loss, logits, steps


class ChainsRecipe(SampledDepth):
    """Raven on the synthetic chains task, with the hop curriculum."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.tokenizer = synthetic.build_tokenizer()

    def build_model(self, generator: torch.Generator) -> Raven:
        cfg = self.cfg
        model = Raven(cfg.model_config(self.tokenizer))
        model.init_weights(generator)
        with torch.no_grad():
            std = model.transformer.wte.weight.std().item()
            table = synthetic.factored_embedding(self.tokenizer, cfg.n_embd, std, generator)
            model.transformer.wte.weight[: table.shape[0]] = table
        return model

    def batch(self, state: TrainState):
        task = synthetic.make_task(self.cfg.task, n_chains=self.cfg.n_chains, length=state.level)
        return synthetic.batch(task, self.tokenizer, self.cfg.batch_size, _step_rng(self.cfg.seed, state.step, 0))

    def after_step(self, state: TrainState, logits: torch.Tensor, targets: torch.Tensor, hops, steps: list[int]) -> None:
        """Raise the hop level once the running accuracy at the current one passes the bar."""
        cfg = self.cfg
        if min(steps) < state.level:
            return
        at_level = hops == state.level
        correct = (logits.argmax(-1)[at_level] == targets[at_level]).float().mean().item()
        state.level_accuracy = 0.9 * state.level_accuracy + 0.1 * correct
        if state.level_accuracy >= cfg.level_up_accuracy and state.level < cfg.max_hop:
            state.history.append({"step": state.step, "level": state.level + 1, "elapsed": state.elapsed})
            state.level += 1
            state.level_accuracy = 0.0


class TextRecipe(SampledDepth):
    """Looped GPT-2 on GSM8K's training text: next-token loss on random windows."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        texts = textcorpus.gsm8k_texts("train", cfg.gsm8k_dir)
        self.tokenizer = textcorpus.fit_tokenizer(texts, cfg.vocab_size)
        self.stream = textcorpus.TokenStream(texts, self.tokenizer)

    def build_model(self, generator: torch.Generator) -> LoopedGPT2:
        model = LoopedGPT2(self.cfg.gpt2_config(self.tokenizer))
        model.init_weights(generator)
        return model

    def batch(self, state: TrainState):
        inputs, targets = self.stream.batch(_step_rng(self.cfg.seed, state.step, 0), self.cfg.batch_size,
                                            self.cfg.context)
        return inputs, targets, None

    def after_step(self, state, logits, targets, hops, steps) -> None:
        pass


class OuroRecipe(ChainsRecipe):
    """Ouro on the chains task: all T steps every batch, every step's logits and gate, Ouro's two stages.

    The hop curriculum is the chains recipe's, judged at the last step. Stage II (steps ≥ cfg.steps) runs the
    LM without gradients and trains only the gate; parameters without a gradient are left alone by AdamW, so
    the LM is exactly stage I's.
    """

    def build_model(self, generator: torch.Generator) -> Ouro:
        """Ouro's layout, with an init that lets the token survive the first step. Ouro adds every sublayer
        through a norm of unit weight, so with Qwen's N(0, 0.02) embedding the state after step 1 holds ~2% of
        the token it started from, and the loop never learned a second lookup (measured: hop 3 at chance for
        700 steps). Here the embedding and both branch norms start at the same scale (0.1), so the token and the
        two updates enter step 1 equally and later steps add to the state instead of replacing it."""
        cfg = self.cfg
        model = Ouro(cfg.ouro_config(self.tokenizer))
        model.init_weights(generator)
        with torch.no_grad():
            table = model.model.embed_tokens.weight
            table[:] = synthetic.factored_embedding(self.tokenizer, cfg.n_embd, OURO_BRANCH_SCALE, generator)
            for layer in model.model.layers:
                layer.input_layernorm_2.weight.fill_(OURO_BRANCH_SCALE)
                layer.post_attention_layernorm_2.weight.fill_(OURO_BRANCH_SCALE)
        return model

    def batch(self, state: TrainState):
        """The chains batch, half its rows cut after a random statement (PAD and no target after the cut).
        A full program puts its value token, after which the model says <eos>, only at the very end, and with
        that alone this model learned to stop after a digit only there: generating an answer after a shorter
        prompt went on with a second digit in a third of the documents (measured on `chains`). The cut rows
        are every program prefix followed by its value, what a prompt that stops anywhere asks for."""
        inputs, targets, hops = super().batch(state)
        rng = _step_rng(self.cfg.seed, state.step, 2)
        n = inputs.shape[1] - 2  # statements per program
        for row in range(inputs.shape[0]):
            if rng.random() < 0.5:
                m = rng.randint(1, n)  # keep statements 1 … m, then their value and <eos>
                inputs[row, m + 1] = targets[row, m]  # statement m's value (targets hold token ids)
                inputs[row, m + 2:] = synthetic.PAD
                targets[row, m + 1] = synthetic.EOS
                targets[row, m + 2:] = synthetic.IGNORE
                hops[row, m + 1:] = 0
        return inputs, targets, hops

    def stage(self, step: int) -> int:
        return 1 if step < self.cfg.steps else 2

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if self.stage(step) == 1:
            return _lr_at(cfg, step)
        return _cosine(cfg.gate_lr, (step - cfg.steps) / max(1, cfg.gate_steps))

    def unroll(self, model: Ouro, inputs: torch.Tensor, targets: torch.Tensor, states: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At the trained depth T: every step's loss on the scored tokens (T, N), the gate's logits there
        (T, N) or, with `states`, the states themselves (T, N, d), and the last step's logits (B, L, V). Only
        the per-token rows are kept per step: a stack of every step's (B, L, V) logits would be most of the
        memory traffic."""
        group, ctx, h = model.loop_groups()[0], AttnContext(), model.embed(inputs)
        keep = targets.flatten() != synthetic.IGNORE
        losses, gates = [], []
        for t in range(self.cfg.ut_steps):
            h = group.step(h, None, ctx.at_iteration(t))
            logits = model.head(h)
            losses.append(gate_objectives.token_losses(logits, targets, synthetic.IGNORE))
            gates.append(group.gate(h).flatten()[keep] if not states else h.flatten(0, 1)[keep])
        return torch.stack(losses), torch.stack(gates), logits

    def loss(self, model: Ouro, inputs: torch.Tensor, targets: torch.Tensor, state: TrainState
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        cfg = self.cfg
        stage = self.stage(state.step)
        for name, p in model.named_parameters():
            p.requires_grad_(stage == 1 or name.startswith("model.early_exit_gate."))
        if stage == 1:
            losses, gate_logits, logits = self.unroll(model, inputs, targets)
            loss, stats = gate_objectives.stage_one_loss(losses, torch.sigmoid(gate_logits), cfg.entropy_beta)
        else:
            with torch.no_grad():
                losses, states, logits = self.unroll(model, inputs, targets, states=True)
            loss, stats = gate_objectives.stage_two_loss(losses, model.loop_groups()[0].gate(states),
                                                         cfg.gate_k, cfg.gate_gamma)
        state.gate = {"stage": stage, **{k: round(v, 4) for k, v in stats.items()}}
        return loss, logits, [cfg.ut_steps]

    def after_step(self, state: TrainState, logits, targets, hops, steps) -> None:
        if self.stage(state.step - 1) == 1:  # the curriculum is stage I's; stage II sees the final level
            super().after_step(state, logits, targets, hops, steps)


def make_recipe(cfg: TrainConfig) -> SampledDepth:
    return {"huginn_raven": ChainsRecipe, "looped_gpt2": TextRecipe, "ouro": OuroRecipe}[cfg.arch](cfg)


def status(state: TrainState, cfg: TrainConfig) -> str:
    """What a progress line shows beside the loss."""
    if cfg.arch == "ouro":
        stage, nan = state.gate.get("stage", 1), float("nan")
        part = (f"exit {state.gate.get('mean_exit', nan):.1f}" if stage == 1 else
                f"continue {state.gate.get('continue_prob', nan):.2f}/{state.gate.get('continue_label', nan):.2f}")
        return f"stage {stage} hop {state.level}/{cfg.max_hop} {part}"
    return f"hop {state.level}/{cfg.max_hop}" if cfg.arch == "huginn_raven" else f"ppl {math.exp(min(state.loss, 50)):.1f}"


def train(cfg: TrainConfig, command: str | None = None,
          on_step: Callable[[TrainState], None] | None = None) -> Path:
    """Train, save intermediate checkpoints under OUT/training/, and the final model in OUT itself."""
    cfg.validate()
    out = check_output(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    recipe = make_recipe(cfg)
    tokenizer = recipe.tokenizer
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
        if cfg.arch == "ouro" and state.step == cfg.steps + 1:
            ema_loss = None  # stage II's loss is the gate's cross-entropy, not the LM's
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        state.loss = ema_loss
        recipe.after_step(state, logits, targets, hops, steps)
        if cfg.arch == "ouro" and state.step == cfg.steps:
            _checkpoint(model, tokenizer, out / STAGE_ONE_DIR, cfg, state, command)
        if on_step:
            on_step(state)
        if cfg.save_every and state.step % cfg.save_every == 0:
            _checkpoint(model, tokenizer, out / TRAINING_DIR / f"step-{state.step:06d}", cfg, state, command)
            _checkpoint(model, tokenizer, out / TRAINING_DIR / "latest", cfg, state, command)
            _save_training_state(out, cfg, state, opt)

    model.eval()
    _checkpoint(model, tokenizer, out, cfg, state, command)
    _checkpoint(model, tokenizer, out / TRAINING_DIR / "latest", cfg, state, command)
    _save_training_state(out, cfg, state, opt)
    return out


def _checkpoint(model: LoopedLM, tokenizer, path: Path, cfg: TrainConfig, state: TrainState,
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
    if cfg.arch == "ouro":
        training["stage"] = 1 if state.step <= cfg.steps else 2
        training["gate_objective"] = state.gate
    extra = {"exitbench": {"training": training, "run": run_metadata(seed=cfg.seed)}}
    save_checkpoint(model, path, tokenizer, extra_config=extra, overwrite=True)
