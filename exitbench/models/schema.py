"""config.json's types, built from the family's own config class (as transformers' config classes are its schema).

A family declares its fields once, in its config dataclass; `schema_for` turns them into a strict pydantic model
(an int is no "1" and no true, a float no NaN, a flag no "no"), beside the fields every config.json may carry
(`ConfigCommon`: model_type, dtype, exitbench's provenance block, the vocabulary and the token ids in it). A
field the class declares without None may be absent (the class's default applies) but not null: null is not a
width or a flag. What a family reads from config.json under another name (an alias, a field read only to refuse
it) it lists in its class's `read_also`, with its type. Value rules that need the architecture (positive widths,
heads that split, loop groups in layer order) stay with the class; the types are checked here, once, before
anything reads a field. Fields no family reads (dropout rates, auto_map, transformers_version) pass untyped.
"""
from __future__ import annotations

import types
import typing
from dataclasses import fields
from functools import lru_cache
from typing import Annotated, Any, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationInfo, create_model,
                      field_validator)
from pydantic_core import PydanticCustomError

# JSON writes 50000 and 50000.0 for the same number; NaN and Infinity, which Python's json accepts, are not
# a norm epsilon or a RoPE base.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]
_STRICT = {int: StrictInt, float: Number, bool: StrictBool, str: StrictStr, dict: dict, Any: Any}
# Dataclass fields that are no config.json field: what a class keeps of unknown fields, and where it was read from.
_NOT_IN_FILE = {"extra", "variant"}
# Declared once, in ConfigCommon, so the vocabulary check sees vocab_size first.
_COMMON = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}


class _Strict(BaseModel):
    # Strict: "1" is not an id and "no" not a bool. Extra fields allowed: real configs carry many that no
    # architecture here reads, and their types are not ours.
    model_config = ConfigDict(strict=True, extra="allow")


class TrainConfigRecord(_Strict):
    """What documents.synthetic_training reads back to rebuild the task a checkpoint was trained on."""

    arch: StrictStr = None
    task: StrictStr | None = None
    n_chains: StrictInt = None
    max_hop: StrictInt = None


class TrainingRecord(_Strict):
    command: StrictStr | None = None
    seed: StrictInt | None = None
    steps_done: StrictInt | None = None
    training_seconds: Number | None = None
    train_config: TrainConfigRecord | None = None


class RunRecord(_Strict):
    git_revision: StrictStr | None = None
    host: StrictStr | None = None
    started: StrictStr | None = None


class ProvenanceRecord(_Strict):
    """config.json's `exitbench` block: how exitbench made the checkpoint (info, depth and geometry read it)."""

    training: TrainingRecord = None
    run: RunRecord = None


class ConfigCommon(_Strict):
    """The fields every config.json may carry, whatever its family."""

    model_type: StrictStr | None = None
    architectures: list[StrictStr] | None = None
    torch_dtype: StrictStr | None = None
    dtype: StrictStr | None = None
    exitbench: ProvenanceRecord = None
    # The vocabulary the token ids must lie in (Raven's padded rows beyond it are padding).
    vocab_size: StrictInt = None
    # Declared after vocab_size, so the validator below sees it.
    bos_token_id: TokenId | None = None
    eos_token_id: TokenId | None = None
    pad_token_id: TokenId | None = None

    @field_validator("bos_token_id", "eos_token_id", "pad_token_id")
    @classmethod
    def _in_vocabulary(cls, value: int | None, info: ValidationInfo) -> int | None:
        # An id past the vocabulary is a token the model can never emit: an <eos> there never stops generation.
        vocab = info.data.get("vocab_size")
        if value is not None and isinstance(vocab, int) and value >= vocab:
            raise PydanticCustomError("token_id", "must be a token id below vocab_size {vocab} (0…{last})",
                                      {"vocab": vocab, "last": vocab - 1})
        return value


def strict(tp: Any) -> tuple[Any, bool]:
    """The strict pydantic type of a dataclass field's annotation, and whether it admits None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        typed = strict(inner[0])[0] if len(inner) == 1 else Union[tuple(strict(a)[0] for a in inner)]
        return typed, len(inner) < len(args)
    if origin is list:
        return list[strict(args[0])[0]] if args else list, False
    if origin is dict:
        return dict, False
    if tp in _STRICT:
        return _STRICT[tp], False
    raise TypeError(f"no config.json type for the annotation {tp!r}")


@lru_cache(maxsize=None)
def schema_for(config_class: type) -> type[BaseModel]:
    """config.json's model for a family: its config class's fields and its `read_also`, beside ConfigCommon."""
    hints = typing.get_type_hints(config_class)
    declared = {f.name: hints[f.name] for f in fields(config_class)
                if f.name not in _NOT_IN_FILE and f.name not in _COMMON}
    declared.update(getattr(config_class, "read_also", {}))
    model_fields = {}
    for name, annotation in declared.items():
        typed, nullable = strict(annotation)
        model_fields[name] = (Optional[typed] if nullable else typed, None)
    return create_model(f"{config_class.__name__}File", __base__=ConfigCommon, **model_fields)
