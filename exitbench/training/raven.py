"""`huginn_raven` on the synthetic chains task (the embedded tiny-raven).

What makes the iterations matter on a model this small (measured in the README, "The embedded default"): no
attention outside the core, one token per statement, a target at every statement, and a hop curriculum that
raises the chain length once the current level is learned. The chains task with its curriculum
(`ChainsTask`) is Ouro's too.
"""
from __future__ import annotations

import torch

from ..models import Raven, RavenConfig
from . import synthetic
from .recipe import Recipe, SampledDepth, TrainState, step_rng
from .settings import TrainSettings


class ChainsTask(Recipe):
    """The synthetic chains task, with the hop curriculum: programs of `n_chains` interleaved chains, as long
    as the current hop level, which rises once the running accuracy at it passes `level_up_accuracy`."""

    def __init__(self, cfg: TrainSettings):
        self.cfg = cfg
        self.tokenizer = synthetic.build_tokenizer()

    @classmethod
    def validate(cls, cfg: TrainSettings) -> None:
        super().validate(cfg)
        synthetic.make_task(cfg.task, n_chains=cfg.n_chains, length=cfg.max_hop)

    @classmethod
    def status(cls, cfg: TrainSettings, state: TrainState) -> str:
        return f"hop {state.level}/{cfg.max_hop}"

    def batch(self, state: TrainState):
        task = synthetic.make_task(self.cfg.task, n_chains=self.cfg.n_chains, length=state.level)
        return synthetic.batch(task, self.tokenizer, self.cfg.batch_size, step_rng(self.cfg.seed, state.step, 0))

    def after_step(self, state: TrainState, logits: torch.Tensor, targets: torch.Tensor, hops, steps: list[int]
                   ) -> None:
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


class RavenRecipe(ChainsTask, SampledDepth):
    """Raven on the chains task at sampled depth, its token embedding factored by statement part."""

    defaults = {}

    @classmethod
    def model_config(cls, cfg: TrainSettings, tokenizer: synthetic.Tokenizer) -> RavenConfig:
        return RavenConfig(
            n_embd=cfg.n_embd, n_heads=cfg.n_heads, vocab_size=tokenizer.vocab_size,
            intermediate_size=cfg.intermediate_size, n_layers_in_prelude=cfg.prelude_layers,
            n_layers_in_recurrent_block=cfg.core_layers, n_layers_in_coda=cfg.coda_layers,
            block_size=256, mean_recurrence=cfg.mean_recurrence,
            mean_backprop_depth=cfg.backprop_depth, max_recurrence=cfg.max_recurrence,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)

    def build_model(self, generator: torch.Generator) -> Raven:
        cfg = self.cfg
        model = Raven(self.model_config(cfg, self.tokenizer))
        model.init_weights(generator)
        with torch.no_grad():
            std = model.transformer.wte.weight.std().item()
            table = synthetic.factored_embedding(self.tokenizer, cfg.n_embd, std, generator)
            model.transformer.wte.weight[: table.shape[0]] = table
        return model
