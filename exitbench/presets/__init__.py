"""Presets: each family's published evaluation protocol as one file (`exitbench presets`; `run --preset NAME`),
with the numbers the papers report, so a run made with one shows at once whether it reproduces them.

A preset sets the task, few-shot count, chat template, system instruction, multi-turn flag, BOS rule, dtype,
checkpoint and fixed depths, and for a published sweep its exit rules, their thresholds and shared knobs; flags
given on the command line override it. Its published numbers are keyed
by task, lm-eval metric and depth, in percent, with their source.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from ..errors import ExitbenchError
from ..runtime.validation import parse

PRESET_DIR = Path(__file__).resolve().parent


class Preset(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: StrictStr
    checkpoint: StrictStr
    tasks: list[StrictStr]
    num_fewshot: Optional[StrictInt] = None
    apply_chat_template: StrictBool = False
    fewshot_as_multiturn: Optional[StrictBool] = None
    system_instruction: Optional[StrictStr] = None
    add_bos_token: Optional[StrictBool] = None
    dtype: StrictStr = "auto"
    baselines: list[StrictInt]
    # A published sweep's exit rules, run beside the fixed depths (none: fixed depths only): their thresholds by
    # rule (a rule not named sweeps the model's grid) and the exit knobs the sweep shares (a cap, a relative
    # reading, a minimum depth).
    policies: list[StrictStr] = []
    thresholds: dict[StrictStr, list[float]] = {}
    exit: dict[StrictStr, Any] = {}
    # {"source": str, task: {metric: {depth: percent}}}
    published: dict[StrictStr, Any]

    def numbers(self) -> dict[str, dict[str, dict[int, float]]]:
        return {task: {metric: {int(d): float(v) for d, v in by_depth.items()} for metric, by_depth in m.items()}
                for task, m in self.published.items() if task != "source"}

    @property
    def source(self) -> str:
        return str(self.published.get("source", ""))


def names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load(name: str) -> Preset:
    file = PRESET_DIR / f"{name}.yaml"
    if name not in names():
        raise ExitbenchError(f"unknown preset {name!r}; `exitbench presets` lists them: {', '.join(names())}")
    preset = parse(Preset, yaml.safe_load(file.read_text()), f"preset {file}")
    if preset.name != name:
        raise ExitbenchError(f"preset {file} names itself {preset.name!r}; a preset's name is its file's")
    return preset


def record(preset: Preset, task: str) -> dict[str, Any]:
    """What a cell made with a preset carries: the preset's name and, for the cell's task, the published
    numbers and their source."""
    return {"name": preset.name, "checkpoint": preset.checkpoint, "source": preset.source,
            "published": preset.numbers().get(task, {})}


def published_rows(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fixed-depth cell made with a preset and per metric it has a published number for: the
    published value beside the measured one (both in percent)."""
    rows = []
    for cell in cells:
        made = cell.get("preset")
        if not made or cell["policy"]["policy"] != "fixed":
            continue
        depth = int(cell["policy"]["threshold"])
        for metric, by_depth in made["published"].items():
            published = by_depth.get(str(depth), by_depth.get(depth))
            measured = cell["task"]["metrics"].get(metric)
            if published is None:
                continue
            ran = (cell["model"].get("hub") or {}).get("repo")
            rows.append({"preset": made["name"], "task": cell["task"]["name"], "metric": metric, "depth": depth,
                         "published": float(published), "measured": None if measured is None else 100 * measured,
                         "limit": cell["task"].get("limit"), "source": made["source"],
                         "published_for": made["checkpoint"], "same_model": ran == made["checkpoint"]})
    return sorted(rows, key=lambda r: (r["preset"], r["task"], r["metric"], r["depth"]))


# The `run` options a preset sets, by parameter name, and the value each takes from it.
SETS = {"tasks": lambda p: ",".join(p.tasks), "num_fewshot": lambda p: p.num_fewshot,
        "apply_chat_template": lambda p: p.apply_chat_template, "system_instruction": lambda p: p.system_instruction,
        "fewshot_as_multiturn": lambda p: p.fewshot_as_multiturn, "add_bos_token": lambda p: p.add_bos_token,
        "dtype": lambda p: p.dtype, "baselines": lambda p: ",".join(map(str, p.baselines)),
        "checkpoint": lambda p: p.checkpoint, "policy": lambda p: p.policies or ["fixed"]}


def apply(preset: Preset, options: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """`options` with every option the preset sets and the command line did not (`given`) taken from it. A
    preset runs fixed depth (and a published sweep's own rules) unless --policy names rules: the published numbers
    first, the frontier second."""
    out = dict(options)
    for name, value in SETS.items():
        if name not in given and not (name == "apply_chat_template" and "chat_template" in given):
            out[name] = value(preset)
    return out
