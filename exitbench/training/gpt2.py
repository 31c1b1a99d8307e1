"""`looped_gpt2` on natural text (the embedded tiny-looped-gpt2), as the two-scale paper trained on FineWeb:
GSM8K's training split, a byte-level BPE fitted to it, next-token loss on random windows, at sampled depth
per loop group."""
from __future__ import annotations

import math

import torch

from ..errors import ExitbenchError
from ..models import LoopedGPT2, LoopedGPT2Config
from . import textcorpus
from .recipe import SampledDepth, TrainState, step_rng
from .settings import TrainSettings


def loop_groups(cfg: TrainSettings) -> list[list[int]]:
    """--loop-groups as layer indices: "1;2,3;4" = [[1], [2, 3], [4]]."""
    try:
        return [[int(i) for i in part.split(",")] for part in cfg.loop_groups.split(";")]
    except ValueError:
        raise ExitbenchError(f"--loop-groups {cfg.loop_groups!r} must be layer indices, groups separated by "
                             "';' and layers by ',', e.g. '1;2,3;4'") from None


class Gpt2Recipe(SampledDepth):
    """Looped GPT-2 on GSM8K's training text: next-token loss on random windows."""

    defaults = {"mean_recurrence": 4, "max_recurrence": 12, "backprop_depth": 12, "batch_size": 32,
                "lr": 1e-3, "warmup": 100, "recurrence_sigma": 0.5}

    def __init__(self, cfg: TrainSettings):
        self.cfg = cfg
        texts = textcorpus.gsm8k_texts("train", cfg.gsm8k_dir)
        self.tokenizer = textcorpus.fit_tokenizer(texts, cfg.vocab_size)
        self.stream = textcorpus.TokenStream(texts, self.tokenizer)

    @classmethod
    def validate(cls, cfg: TrainSettings) -> None:
        super().validate(cfg)
        for name in ("n_layer", "context", "vocab_size"):
            if getattr(cfg, name) <= 0:
                raise ExitbenchError(f"--{name.replace('_', '-')} must be a positive integer, got "
                                     f"{getattr(cfg, name)}")
        try:
            cls.model_config(cfg, None)
        except ExitbenchError as exc:
            raise ExitbenchError(f"--loop-groups {cfg.loop_groups!r}: {exc}") from None

    @classmethod
    def status(cls, cfg: TrainSettings, state: TrainState) -> str:
        return f"ppl {math.exp(min(state.loss, 50)):.1f}"

    @classmethod
    def model_config(cls, cfg: TrainSettings, tokenizer) -> LoopedGPT2Config:
        """The model's config; without a tokenizer (None), the one --vocab-size asks for, to check the layout."""
        groups = loop_groups(cfg)
        # Default depth a little past the sampled mean (E[K] = mean + 1): where held-out quality stops improving.
        default = min(cfg.mean_recurrence + 2, cfg.max_recurrence)
        return LoopedGPT2Config(
            vocab_size=tokenizer.vocab_size if tokenizer else cfg.vocab_size, n_embd=cfg.n_embd,
            n_layer=cfg.n_layer, n_head=cfg.n_heads, n_positions=2 * cfg.context, loop_groups=groups,
            loop_steps=[default] * len(groups), max_loop_steps=[cfg.max_recurrence] * len(groups),
            bos_token_id=tokenizer.bos_token_id if tokenizer else None,
            eos_token_id=tokenizer.eos_token_id if tokenizer else None,
            pad_token_id=tokenizer.pad_token_id if tokenizer else None)

    def build_model(self, generator: torch.Generator) -> LoopedGPT2:
        model = LoopedGPT2(self.model_config(self.cfg, self.tokenizer))
        model.init_weights(generator)
        return model

    def batch(self, state: TrainState):
        inputs, targets = self.stream.batch(step_rng(self.cfg.seed, state.step, 0), self.cfg.batch_size,
                                            self.cfg.context)
        return inputs, targets, None
