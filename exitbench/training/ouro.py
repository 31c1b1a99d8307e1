"""`ouro` on the chains task (the embedded tiny-ouro): every layer in the loop, the final norm after each step,
an exit gate, and Ouro's two stages (gate_objectives.py): `steps` of stage I (LM and gate on the loss expected
under the gate's exit distribution, minus β × its entropy) at a fixed T, then `gate_steps` of stage II (the
gate alone). The stage-I checkpoint is kept as OUT/stage-1, the "untrained gate" Ouro compares against.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ExitbenchError
from ..models import Ouro, OuroConfig
from ..models.attention import AttnContext
from . import gate_objectives, synthetic
from .raven import ChainsTask
from .recipe import TrainState, cosine, step_rng, warmup_cosine
from .settings import TrainSettings

STAGE_ONE_DIR = "stage-1"
OURO_BRANCH_SCALE = 0.1  # OuroRecipe.build_model says why


class OuroRecipe(ChainsTask):
    """Ouro on the chains task: all T steps every batch, every step's logits and gate, Ouro's two stages.

    The hop curriculum is the chains recipe's, judged at the last step. Stage II (steps ≥ cfg.steps) runs the
    LM without gradients and trains only the gate; parameters without a gradient are left alone by AdamW, so
    the LM is exactly stage I's.
    """

    # Ouro trains at one fixed depth T (ut_steps) with gradients through every step; max_recurrence is only
    # how deep a run may go (twice T, as the Ouro loader's default).
    defaults = {"max_recurrence": 24, "batch_size": 32}

    @classmethod
    def validate(cls, cfg: TrainSettings) -> None:
        if cfg.ut_steps <= 0 or cfg.gate_steps < 0:
            raise ExitbenchError(f"--ut-steps must be positive and --gate-steps ≥ 0, got {cfg.ut_steps} and "
                                 f"{cfg.gate_steps}")
        if cfg.max_recurrence < cfg.ut_steps:
            raise ExitbenchError(f"--max-recurrence {cfg.max_recurrence} is below --ut-steps {cfg.ut_steps}")
        for name in ("entropy_beta", "gate_k", "gate_gamma"):
            if not (getattr(cfg, name) >= 0 and math.isfinite(getattr(cfg, name))):
                raise ExitbenchError(f"--{name.replace('_', '-')} must be a number ≥ 0, got {getattr(cfg, name)}")
        if not (cfg.gate_lr > 0 and math.isfinite(cfg.gate_lr)):
            raise ExitbenchError(f"--gate-lr must be a positive number, got {cfg.gate_lr}")
        super().validate(cfg)

    @classmethod
    def total_steps(cls, cfg: TrainSettings) -> int:
        """Stage II comes after the `steps` of stage I."""
        return cfg.steps + cfg.gate_steps

    @classmethod
    def status(cls, cfg: TrainSettings, state: TrainState) -> str:
        stage, nan = state.gate.get("stage", 1), float("nan")
        part = (f"exit {state.gate.get('mean_exit', nan):.1f}" if stage == 1 else
                f"continue {state.gate.get('continue_prob', nan):.2f}/{state.gate.get('continue_label', nan):.2f}")
        return f"stage {stage} hop {state.level}/{cfg.max_hop} {part}"

    @classmethod
    def model_config(cls, cfg: TrainSettings, tokenizer: synthetic.Tokenizer) -> OuroConfig:
        # Tied head: the statement vocabulary is ~3,200 tokens, and an untied head would double the model.
        return OuroConfig(
            hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.n_heads,
            num_hidden_layers=cfg.core_layers, vocab_size=tokenizer.vocab_size, max_position_embeddings=256,
            rope_theta=10000.0, tie_word_embeddings=True, total_ut_steps=cfg.ut_steps,
            max_ut_steps=cfg.max_recurrence, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    def build_model(self, generator: torch.Generator) -> Ouro:
        """Ouro's layout, with an init that lets the token survive the first step. Ouro adds every sublayer
        through a norm of unit weight, so with Qwen's N(0, 0.02) embedding the state after step 1 holds ~2% of
        the token it started from, and the loop never learned a second lookup (measured: hop 3 at chance for
        700 steps). Here the embedding and both branch norms start at the same scale (0.1), so the token and the
        two updates enter step 1 equally and later steps add to the state instead of replacing it."""
        cfg = self.cfg
        model = Ouro(self.model_config(cfg, self.tokenizer))
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
        rng = step_rng(self.cfg.seed, state.step, 2)
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
            return warmup_cosine(cfg, step)
        return cosine(cfg.gate_lr, (step - cfg.steps) / max(1, cfg.gate_steps))

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

    def restarts_loss_average(self, step: int) -> bool:
        return step == self.cfg.steps + 1  # stage II's loss is the gate's cross-entropy, not the LM's

    def kept_checkpoint(self, step: int) -> str | None:
        return STAGE_ONE_DIR if step == self.cfg.steps else None  # the untrained gate

    def record(self, state: TrainState) -> dict[str, Any]:
        return {"stage": 1 if state.step <= self.cfg.steps else 2, "gate_objective": state.gate}
