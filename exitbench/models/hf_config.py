"""What the configs of families named the Hugging Face Llama/Qwen2 way share (Ouro's and those built the same
way): the common fields' checks, the names the rest of exitbench reads, and reading and writing config.json with
unknown fields kept. Each family's dataclass adds its own fields and loop, and says its name for messages
(`family`), its Hugging Face class (`hf_class`) and which of its fields must be positive integers beyond the common
ones. The dataclass is also config.json's schema (models/schema.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from ..errors import CheckpointError
from . import limits

COMMON_POSITIVE = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "num_hidden_layers", "vocab_size", "max_position_embeddings")
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


class HFNames:
    """The names the rest of exitbench reads from every architecture's config, for a config named the Hugging Face
    way (hidden_size, num_attention_heads, num_hidden_layers, max_position_embeddings)."""

    n_embd = property(lambda self: self.hidden_size)
    n_heads = property(lambda self: self.num_attention_heads)
    n_layers = property(lambda self: self.num_hidden_layers)
    block_size = property(lambda self: self.max_position_embeddings)


@dataclass
class HFNamedConfig(HFNames):
    """The common fields; a family redeclares one to change its default (the field keeps its place)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 65536
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    family: ClassVar[str]
    hf_class: ClassVar[str]
    model_type: ClassVar[str]
    # The family's fields beyond the common ones that must be positive integers, in the order checked (a list
    # names the loop's depth fields too); by default just the two depth fields below.
    loop_positive: ClassVar[tuple[str, ...]] = ()
    # The loop: the field of its trained depth, and exitbench's own field of the deepest a run may ask for (None in
    # a hub config: twice the trained). A family whose trained depth is derived overrides `trained_depth`.
    depth_field: ClassVar[str]
    max_depth_field: ClassVar[str]

    def __post_init__(self):
        self.fill_heads()
        self.fill_depth()
        self.validate()

    @property
    def trained_depth(self) -> int:
        return getattr(self, self.depth_field)

    def fill_depth(self) -> None:
        if getattr(self, self.max_depth_field) is None and isinstance(self.trained_depth, int):
            setattr(self, self.max_depth_field, 2 * self.trained_depth)

    def validate(self) -> None:
        """The common fields' checks and the loop's depths; a family adds its own after these."""
        self.validate_common()
        limits.loop_depth(self.depth_field, self.trained_depth, self.max_depth_field,
                          getattr(self, self.max_depth_field))

    def fill_heads(self) -> None:
        """Grouped-query and head-size defaults, as Hugging Face fills them."""
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def validate_common(self) -> None:
        for name in (*COMMON_POSITIVE, *(self.loop_positive or (self.depth_field, self.max_depth_field))):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"config num_attention_heads={self.num_attention_heads} must be a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise CheckpointError(f"config head_dim={self.head_dim} must be even for rotary embeddings")
        limits.rope_base("rope_theta", self.rope_theta)
        limits.norm_eps("rms_norm_eps", self.rms_norm_eps)
        if self.hidden_act != "silu":
            raise CheckpointError(f"config hidden_act={self.hidden_act!r}: {self.family}'s MLP is SiLU-gated; "
                                  "only 'silu' is implemented")
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get("rope_type",
                                                                         self.rope_scaling.get("type")) != "default":
            raise CheckpointError(f"config rope_scaling={self.rope_scaling!r}: only plain RoPE (rope_scaling null) "
                                  f"is implemented, which is what every published {self.family} checkpoint uses")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]):
        cls.refuse(raw)
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in raw.items() if k in known}
        extra = {k: v for k, v in raw.items() if k not in known}
        for required in REQUIRED:
            if required not in kwargs:
                raise CheckpointError(f"config.json lacks the field {required!r}, which a {cls.family} model needs")
        for name in ("rms_norm_eps", "rope_theta"):
            if name in kwargs:
                kwargs[name] = float(kwargs[name])
        return cls(**kwargs, extra=extra)

    @classmethod
    def refuse(cls, raw: dict[str, Any]) -> None:
        """Raise CheckpointError for a config.json setting this family does not implement (default: none)."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update({"model_type": self.model_type, "architectures": [self.hf_class]})
        extra = {k: v for k, v in self.extra.items() if k not in out}
        return {**extra, **out}


def refuse_set(raw: dict[str, Any], names: tuple[str, ...], fact: str) -> None:
    """Refuse in one line the first of the config flags `names` that config.json sets true: `fact` says why the
    family has no such thing."""
    for name in names:
        if raw.get(name):
            raise CheckpointError(f"config {name}=true: {fact}; set {name} false")
