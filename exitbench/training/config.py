"""A training run's config: the knobs (settings.py) joined to the recipe of the family `arch` names.

RECIPES maps each `--arch` to its recipe; the config takes that recipe's defaults, its checks and its length,
and spells the run as the command line that reproduces it.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from typing import Any, Optional

from ..errors import ExitbenchError
from .gpt2 import Gpt2Recipe
from .ouro import OuroRecipe
from .raven import ChainsTask, RavenRecipe
from .recipe import Recipe
from .settings import TrainSettings

RECIPES: dict[str, type[Recipe]] = {"huginn_raven": RavenRecipe, "looped_gpt2": Gpt2Recipe, "ouro": OuroRecipe}
ARCHS = tuple(RECIPES)
CHAINS_ARCHS = tuple(arch for arch, recipe in RECIPES.items() if issubclass(recipe, ChainsTask))


def recipe_for(arch: str) -> type[Recipe]:
    if arch not in RECIPES:
        raise ExitbenchError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    return RECIPES[arch]


class TrainConfig(TrainSettings):
    """The knobs of one run (TrainSettings' fields, all of them recorded) and the family they train."""

    @classmethod
    def for_arch(cls, out: str, arch: str = "huginn_raven", **given: Any) -> "TrainConfig":
        """A config with `arch`'s defaults, overridden by the options the user gave (None = not given)."""
        values = {**recipe_for(arch).defaults, **{k: v for k, v in given.items() if v is not None}}
        return cls(out=out, arch=arch, **values)

    @classmethod
    def options(cls) -> list[tuple[str, Any, Any, dict[str, Any]]]:
        """(name, type, default, metadata) of each knob `exitbench train` offers, in field order, as the command
        line takes it: a knob some family defaults otherwise is optional with default None (for_arch applies
        the family's), `out` has no default (`...`, required), and `command_line_default` stands where given."""
        hints = typing.get_type_hints(cls)
        per_family = {name for recipe in RECIPES.values() for name in recipe.defaults}
        options = []
        for f in fields(cls):
            if not f.metadata["command_line"]:
                continue
            kind, default = hints[f.name], f.metadata.get("command_line_default", f.default)
            if f.name in per_family:
                kind, default = Optional[kind], None
            options.append((f.name, kind, ... if default is MISSING else default, dict(f.metadata)))
        return options

    @property
    def recipe(self) -> type[Recipe]:
        return recipe_for(self.arch)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return self.recipe.total_steps(self)

    def validate(self) -> None:
        recipe = self.recipe
        self.check_shared()
        recipe.validate(self)

    def command(self) -> str:
        """The `exitbench train` command line that reproduces this run (non-default options spelled out)."""
        defaults = TrainConfig.for_arch(self.out, self.arch)
        parts = ["exitbench", "train", "--out", self.out, "--steps", str(self.steps), "--seed", str(self.seed)]
        if self.arch != TrainSettings.arch:  # the default family goes without
            parts += ["--arch", self.arch]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("out", "steps", "seed", "arch") or value == getattr(defaults, f.name):
                continue
            parts += [self.flag(f.name)] if value is True else [self.flag(f.name), str(value)]
        return " ".join(parts)
