"""How results are named where people read them (tables, figures, the report): metrics in words, a fixed depth
as r, a threshold as τ, and the direction of a metric said in words. Cells and machine-readable output (JSON,
CSV, export) keep lm-eval's own keys.
"""
from __future__ import annotations

from typing import Any

from ..store.cells import series

# lm-eval's metric names, as a reader says them; others read with their underscores as spaces.
METRIC_NAMES = {"exact_match": "exact match", "acc": "accuracy", "acc_norm": "accuracy (length-normalised)",
                "perplexity": "perplexity", "word_perplexity": "word perplexity",
                "byte_perplexity": "byte perplexity", "bits_per_byte": "bits per byte", "f1": "F1", "bleu": "BLEU",
                "mcc": "Matthews correlation"}


def metric_name(metric: str) -> str:
    """`exact_match,none` → `exact match`; a filter other than lm-eval's `none` stays, in brackets."""
    name, _, filtered = metric.partition(",")
    said = METRIC_NAMES.get(name, name.replace("_", " "))
    return f"{said} ({filtered})" if filtered and filtered != "none" else said


def direction(higher_is_better: bool) -> str:
    return "higher is better" if higher_is_better else "lower is better"


def metric_with_direction(metric: str, higher_is_better: bool) -> str:
    """`exact match (higher is better)`: an axis or a table's heading."""
    return f"{metric_name(metric)} ({direction(higher_is_better)})"


def setting(policy: str, threshold: Any) -> str:
    """What a τ column shows for a cell: its threshold, or `r = 16` for a fixed depth (a depth is no threshold)."""
    if threshold is None:
        return "-"
    return f"r = {threshold:g}" if policy.startswith("fixed") else f"{threshold:g}"


def config_label(policy: str, threshold: Any) -> str:
    """A cell's exit config in running text: `second_order τ=0.316`, `fixed r=16`, `oracle`."""
    if threshold is None:
        return policy
    return f"{policy} r={threshold:g}" if policy.startswith("fixed") else f"{policy} τ={threshold:g}"


def exit_config_label(config: Any) -> str:
    """An ExitConfig in running text (progress lines): its series' name, so a conjunction reads as its rules."""
    return config_label(series(config.to_dict()), config.threshold)


def point_label(policy: str, threshold: Any) -> str:
    """A frontier point's label in a figure: `r = 8` for a fixed depth, `second_order τ=1` otherwise (a series'
    variant in words: `second_order (relative) τ=1`)."""
    return f"r = {threshold:g}" if policy.startswith("fixed") else config_label(series_label(policy), threshold)


# A series' suffixes (`store.cells.series`) as a reader says them.
SUFFIXES = ((r"-rel$", "relative"), (r"-kv(\d+)$", "KV window {0}"), (r"-(select|weighted|freeze)$", "exit mode {0}"))


def series_label(name: str) -> str:
    """A series as figures and pages name it: `second_order-rel-kv4` → `second_order (relative, KV window 4)`."""
    import re

    said: list[str] = []
    found = True
    while found:
        found = False
        for pattern, words in SUFFIXES:
            m = re.search(pattern, name)
            if m:
                said.insert(0, words.format(*m.groups()))
                name, found = name[:m.start()], True
    return f"{name} ({', '.join(said)})" if said else name


def overhead(value: float | None, timing: str | None = None) -> str:
    """A cell's overhead (its time ratio to full depth ÷ its FLOP ratio) as `1.07×`, marked `1.07×*` where it
    comes from two cells' own timings (`plain`) rather than repeats paired in one run."""
    if value is None:
        return "-"
    return f"{value:.2f}×" + ("*" if timing == "plain" else "")


# Said under every table that marks one.
PLAIN_OVERHEAD = "overhead: time ratio ÷ FLOP ratio to full depth; * from the cells' own timings, not paired repeats"
# Said under every table with a schedule column (timing/retime.py).
SCHEDULE = ("schedule: loop steps the batches ran per step their tokens' iterations need, against full depth (1.00: "
            "no row waited on a slower one); overhead ÷ schedule: what a step cost beyond a full-depth step")


def depth_said(entry: dict[str, Any]) -> str:
    """The reference depth a group's ratios and ε are against, as a title names it (`r = 16`)."""
    return f"r = {entry['full_depth']:g}" if entry.get("full_depth") is not None else "(none)"


def deeper_said(entry: dict[str, Any]) -> str | None:
    """Where a deeper fixed depth sits beside the reference (policies capped by --max-steps): what it scores."""
    if entry.get("deepest_fixed") is None:
        return None
    return (f"full depth here is r = {entry['full_depth']:g}, the policies' max steps (quality "
            f"{entry['full_depth_quality']:.4g}); r = {entry['deepest_fixed']:g} ran beside them and scores "
            f"{entry['deepest_fixed_quality']:.4g}")
