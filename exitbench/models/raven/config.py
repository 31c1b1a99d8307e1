"""Raven's config.json, as Huginn-0125 writes it and as the retrofitted-recurrence conversions (McLeish et al.
2025, `smcleish/Recurrent-*`) rewrite it.

The conversions keep Huginn-0125's stale fields (`block_class_name: SandwichBlock`, `mean_recurrence` 32,
`init_values` computed for width 5280) and add the source model's: grouped-query heads, `head_dim`,
`rope_theta`, `rope_scaling`, `max_position_embeddings`, an untied head. Which block a checkpoint holds is
not read from here but told from its keys (variants.py); this file only reads fields, with their Huginn
meanings where the conversion left them alone.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...errors import CheckpointError
from .. import limits

# Huginn's state: trunc-normal with variance 2/5 (huginn-0125.md §1.4): init_values.std = sqrt(2/(5h)) times
# its embed_scale sqrt(h), which Huginn's config derives and never writes.
STATE_STD = math.sqrt(2 / 5)

_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_heads"}
# Huginn-0125's special-token ids. The Llama conversion starts from Huginn-0125's config.json and keeps them
# beside a 32,000- or 128,256-token vocabulary, where they name no token.
HUGINN_TOKEN_IDS = {"bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509}
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Fields only a soft-capped (Gemma-2) checkpoint sets: tanh caps on the attention scores and the logits, which no
# implemented variant applies, so a checkpoint that sets them is refused rather than run uncapped.
SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")
STATE_MODES = ("random", "embed-init")


def stale_token_ids(config: dict[str, Any]) -> list[str]:
    """The special-id fields of a Raven config.json that hold Huginn-0125's ids outside the config's own
    vocabulary: a conversion's leftovers, which the tokenizer's own special tokens replace."""
    vocab = config.get("vocab_size")
    if config.get("model_type") != RavenConfig.model_type or not isinstance(vocab, int):
        return []
    return [name for name, huginn in HUGINN_TOKEN_IDS.items() if config.get(name) == huginn and huginn >= vocab]


@dataclass
class RavenConfig:
    n_embd: int
    n_heads: int
    vocab_size: int
    intermediate_size: int
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    padded_vocab_size: int | None = None
    block_size: int = 4096
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    bias: bool = False
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    # exitbench's own: the deepest r the checkpoint is meant to run (sweeps, policy caps).
    max_recurrence: int | None = None
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # The conversions' fields (absent from Huginn-0125's file, which derives the first two).
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    init_values: dict | None = None
    initial_state_mode: str = "random"
    # Which block the checkpoint's keys hold (variants.VARIANTS); the default is Huginn-0125's.
    variant: str = "huginn"
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "huginn_raven"
    hf_class = "RavenForCausalLM"
    # Read from config.json under other names (Hugging Face's, transformers' re-save, the conversions' context),
    # or only to refuse (a soft-capped Gemma-2 sandwich is not Huginn's: raven/variants.py).
    read_also = {"hidden_size": int, "num_attention_heads": int, "tie_word_embeddings": bool,
                 "max_position_embeddings": int, "attn_logit_softcapping": float | None,
                 "final_logit_softcapping": float | None}

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.max_recurrence is None:
            self.max_recurrence = 2 * self.mean_recurrence
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_heads
        if self.head_dim is None and isinstance(self.n_heads, int) and self.n_heads > 0:
            self.head_dim = self.n_embd // self.n_heads
        self.validate()

    def validate(self) -> None:
        positive = ["n_embd", "n_heads", "vocab_size", "intermediate_size", "block_size", "padded_vocab_size",
                    "n_layers_in_recurrent_block", "mean_recurrence", "max_recurrence", "num_key_value_heads",
                    "head_dim"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        for name in ["n_layers_in_prelude", "n_layers_in_coda", "mean_backprop_depth"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointError(f"config field {name} must be a non-negative integer, got {value!r}")
        if self.n_embd % self.n_heads and self.head_dim == self.n_embd // self.n_heads:
            raise CheckpointError(f"config n_embd={self.n_embd} must split into n_heads={self.n_heads} heads of "
                                  "even size (or config head_dim say how wide a head is)")
        if self.head_dim % 2:
            raise CheckpointError(f"config head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.num_key_value_heads:
            raise CheckpointError(f"config n_heads={self.n_heads} must be a multiple of num_key_value_heads="
                                  f"{self.num_key_value_heads} (grouped-query attention)")
        if self.qk_bias and self.num_key_value_heads != self.n_heads:
            raise CheckpointError(f"config qk_bias=true with num_key_value_heads={self.num_key_value_heads} < "
                                  f"n_heads={self.n_heads}: a key bias per query head fits no grouped keys; "
                                  "set qk_bias false or the heads equal")
        if self.padded_vocab_size < self.vocab_size:
            raise CheckpointError(f"config padded_vocab_size={self.padded_vocab_size} is below "
                                  f"vocab_size={self.vocab_size}")
        if self.bias:
            raise CheckpointError("config bias=true: Raven has no linear biases (only qk_bias); set bias to false")
        if self.max_recurrence < self.mean_recurrence:
            raise CheckpointError(f"config max_recurrence={self.max_recurrence} is below "
                                  f"mean_recurrence={self.mean_recurrence}")
        limits.loop_steps("mean_recurrence", self.mean_recurrence)
        limits.loop_steps("max_recurrence", self.max_recurrence)
        limits.rope_base("rope_base", self.rope_base)
        limits.rope_base("rope_theta", self.rope_theta)
        limits.norm_eps("norm_eps", self.norm_eps)
        capped = [f"{f}={self.extra[f]!r}" for f in SOFTCAP_FIELDS if self.extra.get(f) is not None]
        if capped:
            raise CheckpointError(f"config {', '.join(capped)}: soft-capped attention and logits (the Gemma-2 "
                                  "retrofit) are not implemented, and running the checkpoint uncapped would give "
                                  "other numbers; remove the fields only if the model was trained without them")
        if self.variant != "huginn" and self.init_values is None:
            raise CheckpointError(f"config.json of a retrofitted ({self.variant}) checkpoint lacks init_values: "
                                  "its embed_scale (1.0 in the conversions) and std set how the embedding and the "
                                  "initial state are scaled, and Huginn's derived sqrt(n_embd) would change every "
                                  "output; restore the conversion's init_values")
        if self.init_scale < 0 or not math.isfinite(self.init_scale):
            raise CheckpointError(f"config init_scale must be a finite number ≥ 0, got {self.init_scale}")
        if self.initial_state_mode not in STATE_MODES:
            raise CheckpointError(f"config initial_state_mode={self.initial_state_mode!r} is not implemented; "
                                  f"exitbench runs {' and '.join(STATE_MODES)} (skip-adapter skips the adapter "
                                  "on step 1 only, which no published checkpoint uses)")
        self.rope_scaling_kind()
        for name in ("embed_scale", "std"):
            value = (self.init_values or {}).get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise CheckpointError(f"config init_values.{name} must be a finite number ≥ 0, got {value!r}")

    def rope_scaling_kind(self) -> str | None:
        """None for plain RoPE, "llama3" for Llama 3.x's scaling; any other kind is refused here."""
        scaling = self.rope_scaling
        if not scaling:
            return None
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            return None
        if kind != "llama3":
            raise CheckpointError(f"config rope_scaling has rope_type {kind!r}: exitbench implements llama3 "
                                  "scaling and plain RoPE (rope_scaling null)")
        missing = [f for f in LLAMA3_FIELDS if not isinstance(scaling.get(f), (int, float))
                   or isinstance(scaling.get(f), bool)]
        if missing:
            raise CheckpointError(f"config rope_scaling (llama3) lacks the number {missing[0]!r}; it needs "
                                  f"{', '.join(LLAMA3_FIELDS)}")
        return kind

    @property
    def n_layers(self) -> int:
        return self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda

    @property
    def effective_expected_depth(self) -> int:
        return self.n_layers_in_prelude + self.n_layers_in_coda + \
            self.n_layers_in_recurrent_block * self.mean_recurrence

    @property
    def embed_scale(self) -> float:
        """The embedding's (and the random state's) factor: sqrt(h), which Huginn derives, unless the config's
        init_values says otherwise (the conversions write 1.0: the source model scales nothing)."""
        value = (self.init_values or {}).get("embed_scale")
        return math.sqrt(self.n_embd) if value is None else float(value)

    @property
    def state_std(self) -> float:
        """Standard deviation of the random initial state at init_scale 1: init_values.std × embed_scale, as
        Huginn's code draws it; Huginn's derived values give exactly sqrt(2/5)."""
        values = self.init_values or {}
        if values.get("std") is None and values.get("embed_scale") is None:
            return STATE_STD
        std = values.get("std", math.sqrt(2 / (5 * self.n_embd)))
        return float(std) * self.embed_scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any], variant: str = "huginn") -> "RavenConfig":
        known = {f.name for f in fields(cls)} - {"extra", "variant"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            if key in known:
                kwargs[key] = value
            elif key not in _ALIASES:
                extra[key] = value
        for alias, name in _ALIASES.items():
            if alias in raw and name in raw and raw[alias] != raw[name]:
                raise CheckpointError(f"config.json has {name}={raw[name]!r} but {alias}={raw[alias]!r}; "
                                      "they name the same thing and must agree")
            if alias in raw:
                kwargs.setdefault(name, raw[alias])
        # A config re-saved by transformers carries tie_word_embeddings beside Raven's own tie_embeddings.
        if "tie_word_embeddings" in raw:
            if "tie_embeddings" in raw and raw["tie_embeddings"] != raw["tie_word_embeddings"]:
                raise CheckpointError(f"config.json has tie_embeddings={raw['tie_embeddings']!r} but "
                                      f"tie_word_embeddings={raw['tie_word_embeddings']!r}; they must agree")
            kwargs.setdefault("tie_embeddings", raw["tie_word_embeddings"])
        # The conversions write the source model's context here; their `block_size` is Huginn-0125's 4096,
        # and lm-eval's hf model takes max_position_embeddings as its max_length.
        if isinstance(raw.get("max_position_embeddings"), int):
            kwargs["block_size"] = raw["max_position_embeddings"]
        for required in ("n_embd", "n_heads", "vocab_size", "intermediate_size"):
            if required not in kwargs:
                raise CheckpointError(f"config.json lacks the field {required!r}, which a Raven model needs")
        for name in ("rope_base", "norm_eps", "init_scale", "rope_theta"):
            if kwargs.get(name) is not None:
                value = kwargs[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise CheckpointError(f"config field {name} must be a number, got {value!r}")
                kwargs[name] = float(value)
        for name in ("qk_bias", "bias", "tie_embeddings"):
            if name in kwargs and not isinstance(kwargs[name], bool):
                raise CheckpointError(f"config field {name} must be true or false, got {kwargs[name]!r}")
        return cls(**kwargs, variant=variant, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        # Fields a Huginn-layout config never had are written only when set, so a checkpoint written here
        # reads like the ones it was read from.
        optional = ("rope_theta", "rope_scaling", "init_values")
        out = {k: v for k, v in asdict(self).items()
               if k not in ("extra", "variant") and not (k in optional and v is None)}
        if self.initial_state_mode == "random":
            out.pop("initial_state_mode")
        out.update({
            "model_type": self.model_type,
            "architectures": ["RavenForCausalLM"],
            "n_layers": self.n_layers,
            "hidden_size": self.n_embd,
            "num_attention_heads": self.n_heads,
        })
        extra = {k: v for k, v in self.extra.items() if k not in out}
        return {**extra, **out}
