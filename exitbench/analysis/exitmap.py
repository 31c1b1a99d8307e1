"""Exit maps: the text of a document with every exited token shaded by the step it exited at.

A table of mean iterations says how much a policy spends; a map says *where*: which tokens one rule stops early on
that another does not, and whether the early ones are the tokens the model gets wrong. One `ExitMap` is one
policy's tokens over one text; several maps of the same text are drawn as rows side by side, one row per
(policy, loop group), so a multi-group model shows each group's depth separately rather than a sum that hides
which group did the work.

Maps come from `exitbench trace` (every token of a prompt, with the policy's signal at each step) or from a
sweep's samples file (`--log-samples`: the scored or generated tokens of each document, after a context that was
prefilled at full depth and so has no exit to show). They are drawn as HTML (self-contained: inline styles, hover
text per token) or as a PNG (matplotlib, monospace layout).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store.cells import series
from .labels import config_label, metric_name, series_label

CMAP = "YlGnBu"  # light = early exit, dark = deep: the eye finds the expensive tokens first
MISS_COLOR = "#d62728"


@dataclass
class MapToken:
    text: str
    exit_steps: list[int]                     # one exit step per loop group
    logprob: float | None = None
    greedy: bool | None = None                # False: the model's argmax was another token (a greedy miss)
    signals: list[list[float]] | None = None  # the policy's signal at every step, per loop group (trace only)


@dataclass
class ExitMap:
    label: str                      # e.g. "second_order τ=0.316"
    tokens: list[MapToken]
    max_steps: int                  # the policy's deepest step: the dark end of the colour scale
    context: str = ""               # text before the exited tokens (prefilled at full depth: no exits)
    note: str = ""                  # e.g. the sample's score
    group_names: list[str] = field(default_factory=list)

    @property
    def groups(self) -> int:
        return max((len(t.exit_steps) for t in self.tokens), default=1)

    @property
    def mean_iterations(self) -> float | None:
        return sum(sum(t.exit_steps) for t in self.tokens) / len(self.tokens) if self.tokens else None

    def row_label(self, g: int) -> tuple[str, str]:
        """(title, numbers) of the row that draws loop group g: a group's own mean, and the total beside it."""
        if self.groups == 1:
            mean = self.mean_iterations
            return self.label, ("" if mean is None else f"mean {mean:.2f} it.")
        steps = [t.exit_steps[g] for t in self.tokens if g < len(t.exit_steps)]
        mean = sum(steps) / len(steps) if steps else 0.0
        return f"{self.label} · group {g + 1}", f"mean {mean:.2f} of {self.mean_iterations:.2f} it."


# ---- building maps --------------------------------------------------------------------------------------------
def from_trace(report: dict[str, Any]) -> ExitMap:
    """The map of `exitbench trace`'s report (exitbench/trace.py): the token each position predicts, shaded by
    the exit step of the position that predicted it."""
    knobs = report["policy"]
    tokens = [MapToken(row.get("text", row["next"]), list(row["exit_steps"]), row["logprob"], row["greedy"],
                       row.get("signals"))
              for row in report["tokens"]]
    return ExitMap(label=policy_label(knobs), tokens=tokens, max_steps=_scale(knobs.get("max_steps"), tokens),
                   context=report.get("context", ""), note=f"{report['mode']}, mean iterations "
                   f"{report['mean_iterations']:.2f}")


def from_sample(sample: dict[str, Any], knobs: dict[str, Any], metric: str | None = None) -> ExitMap:
    """The map of one lm-eval sample that `exitbench run --log-samples` joined its exits into. Samples from before
    exitbench kept each token's text have no text to show: their tokens are drawn as numbered blanks."""
    ex = sample.get("exitbench") or {}
    steps = ex.get("exit_steps") or []
    texts = ex.get("token_text") or [f"[{i}]" for i in range(len(steps))]
    logprobs = ex.get("logprobs") or [None] * len(steps)
    greedy = ex.get("greedy") or [None] * len(steps)
    tokens = [MapToken(t, list(s), lp, g) for t, s, lp, g in zip(texts, steps, logprobs, greedy)]
    note = ""
    if metric is not None and isinstance(sample.get(metric), (int, float)):
        note = f"{metric_name(metric)} {sample[metric]:.4g}"
    return ExitMap(label=policy_label(knobs), tokens=tokens, max_steps=_scale(knobs.get("max_steps"), tokens),
                   context=sample_context(sample), note=note)


def sample_context(sample: dict[str, Any]) -> str:
    """The request text lm-eval sent for a sample: its first argument (a context, or a rolling document)."""
    args = sample.get("arguments")
    first = None
    if isinstance(args, dict) and args:  # lm-eval ≥ 0.4.5: {"gen_args_0": {"arg_0": context, "arg_1": …}}
        first = next(iter(args.values()))
        first = first.get("arg_0") if isinstance(first, dict) else first
    elif isinstance(args, list) and args:  # older lm-eval: [[context, continuation], …]
        first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
    return first if isinstance(first, str) else ""


def policy_label(knobs: dict[str, Any]) -> str:
    """`second_order τ=0.316`, `fixed r=16`, with the series' variant in words (`second_order (relative)`)."""
    return config_label(series_label(series(knobs)), knobs.get("threshold"))


def _scale(max_steps: int | None, tokens: list[MapToken]) -> int:
    deepest = max((s for t in tokens for s in t.exit_steps), default=1)
    return max(max_steps or 1, deepest, 1)


# ---- colours and hover text ----------------------------------------------------------------------------------
def _rgb(step: int, max_steps: int) -> tuple[float, float, float]:
    from matplotlib import colormaps

    # Step 1 maps to 0.08, not 0: the palest end of the map is near white and would hide a token's box.
    frac = 0.08 + 0.92 * (step - 1) / max(max_steps - 1, 1)
    r, g, b, _ = colormaps[CMAP](min(max(frac, 0.0), 1.0))
    return r, g, b


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(255 * c):02x}" for c in rgb)


def _dark(rgb: tuple[float, float, float]) -> bool:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.5


def hover(token: MapToken, group: int | None = None) -> str:
    """Exit step (per group), log-probability, greedy miss and the signal at every step, one fact per line."""
    steps = token.exit_steps
    lines = [f"token {token.text!r}"]
    if len(steps) > 1:
        lines.append("exit steps " + " + ".join(map(str, steps)) + f" = {sum(steps)}"
                     + (f" (this row: group {group + 1})" if group is not None else ""))
    else:
        lines.append(f"exit step {steps[0] if steps else '-'}")
    if token.logprob is not None:
        lines.append(f"log p {token.logprob:.4f}")
    if token.greedy is False:
        lines.append("greedy miss: the model's top token was another")
    for g, sig in enumerate(token.signals or []):
        sig = sig[:steps[g]] if g < len(steps) else sig  # the engine pads the steps after the exit with NaN
        if sig:
            name = f"signal (group {g + 1})" if len(token.signals) > 1 else "signal"
            lines.append(f"{name} at steps 1…{len(sig)}: " + ", ".join(_num(v) for v in sig))
    return "\n".join(lines)


def _num(v: Any) -> str:
    if isinstance(v, list):  # a conjunction's step: one value per rule
        return "(" + ", ".join(_num(x) for x in v) + ")"
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.3g}"


def _shown(text: str) -> str:
    """A token's text as drawn: a newline keeps a visible mark, an empty token a placeholder."""
    return text.replace("\n", "↵\n") if text else "∅"


# ---- HTML -----------------------------------------------------------------------------------------------------
STYLE = """
.exitmaps { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
.exitmaps .ctx { color: #777; white-space: pre-wrap; margin: 0 0 .3em 0; }
.exitmaps .row { display: grid; grid-template-columns: 15em 1fr; gap: .6em; align-items: baseline;
                 margin: .15em 0; }
.exitmaps .label { font-family: system-ui, sans-serif; font-size: 12px; color: #333; }
.exitmaps .label small { color: #777; display: block; }
.exitmaps .text { white-space: pre-wrap; line-height: 1.9; }
.exitmaps .tok { padding: 1px 0; border-radius: 2px; cursor: default; }
.exitmaps .tok.miss { outline: 2px solid #d62728; outline-offset: -1px; }
.exitmaps .legend { font-family: system-ui, sans-serif; font-size: 11px; color: #555; margin-top: .3em; }
.exitmaps .legend span { display: inline-block; min-width: 1.6em; text-align: center; }
"""


def html_fragment(maps: list[ExitMap], context: str | None = None, max_context: int = 400) -> str:
    """One block: the shared context (when given) and one row per (map, loop group). Each token is a
    `span.tok` whose hover text holds its facts; the block's `data-tokens` says how many tokens each row has."""
    if not maps:
        return ""
    parts = ['<div class="exitmaps">']
    ctx = maps[0].context if context is None else context
    if ctx:
        shown = ctx if len(ctx) <= max_context else "…" + ctx[-max_context:]
        parts.append(f'<div class="ctx" title="context: prefilled at full depth, no exits">{html.escape(shown)}</div>')
    scale = max(m.max_steps for m in maps)
    for m in maps:
        for g in range(m.groups):
            label, numbers = m.row_label(g)
            label = html.escape(label)
            sub = " · ".join(x for x in (numbers, m.note) if x)
            spans = []
            for t in m.tokens:
                step = t.exit_steps[g] if g < len(t.exit_steps) else 0
                rgb = _rgb(step, scale)
                style = f"background:{_hex(rgb)};color:{'#fff' if _dark(rgb) else '#111'}"
                cls = "tok miss" if t.greedy is False else "tok"
                spans.append(f'<span class="{cls}" style="{style}" data-step="{step}" '
                             f'title="{html.escape(hover(t, g if m.groups > 1 else None))}">'
                             f'{html.escape(_shown(t.text))}</span>')
            parts.append(f'<div class="row" data-tokens="{len(m.tokens)}"><div class="label">{label}'
                         f'<small>{html.escape(sub)}</small></div><div class="text">{"".join(spans)}</div></div>')
    parts.append(_legend(scale))
    parts.append("</div>")
    return "\n".join(parts)


def _legend(scale: int) -> str:
    ticks = sorted({1, *range(max(scale // 4, 1), scale + 1, max(scale // 4, 1)), scale})
    cells = []
    for s in ticks:
        rgb = _rgb(s, scale)
        cells.append(f'<span style="background:{_hex(rgb)};color:{"#fff" if _dark(rgb) else "#111"}">{s}</span>')
    return (f'<div class="legend">exit step {"".join(cells)} · '
            f'<span style="outline:2px solid {MISS_COLOR};outline-offset:-1px">tok</span> greedy miss · '
            'hover a token for its exit step, log p and signals</div>')


def html_page(maps: list[ExitMap], title: str) -> str:
    """A whole HTML page of one set of maps (what `exitbench trace --html` writes)."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>body{{font-family:system-ui,sans-serif;margin:1.5em;max-width:80em}}{STYLE}</style></head>'
            f'<body><h1 style="font-size:1.2em">{html.escape(title)}</h1>\n{html_fragment(maps)}\n</body></html>\n')


def write_html(maps: list[ExitMap], path: Path, title: str) -> Path:
    from ..runtime.files import atomic_write

    page = html_page(maps, title)
    return atomic_write(Path(path), lambda fh: fh.write(page))


# ---- PNG ------------------------------------------------------------------------------------------------------
def draw(maps: list[ExitMap], title: str = "", width: int = 72):
    """A matplotlib figure of the maps: monospace text wrapped at `width` characters, each token on a box in its
    exit step's colour, greedy misses outlined in red, a colour bar of exit steps. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Rectangle
    from matplotlib.textpath import TextPath

    scale = max(m.max_steps for m in maps)
    rows = [(m, g) for m in maps for g in range(m.groups)]
    laid = [_layout(m.tokens, width) for m, _ in rows]
    lines = sum(max(n, 1) for _, n in laid) + len(rows)  # each row's lines plus a label line
    cols = max([40] + [c + len(t) for places, _ in laid for _, c, t in places])
    # Inches per character of the 9-pt monospace font as matplotlib lays it out, and per line; fixed margins
    # (inches) for the title and the colour bar.
    char_w = TextPath((0, 0), "M" * 40, size=9, prop=FontProperties(family="DejaVu Sans Mono")
                      ).get_extents().width / 40 / 72
    line_h, top, bottom = 0.28, 0.45, 0.8
    height = lines * line_h + top + bottom
    fig = plt.figure(figsize=(cols * char_w + 0.5, height))
    ax = fig.add_axes([0.25 / (cols * char_w + 0.5), bottom / height, cols * char_w / (cols * char_w + 0.5),
                       lines * line_h / height])
    ax.set_xlim(0, cols)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    y = 0
    for (m, g), (places, n_lines) in zip(rows, laid):
        label, numbers = m.row_label(g)
        ax.text(0, y + 0.75, " · ".join(x for x in (label, numbers) if x), fontsize=8.5, fontweight="bold",
                family="sans-serif")
        y += 1
        for t, (line, col, shown) in zip(m.tokens, places):
            step = t.exit_steps[g] if g < len(t.exit_steps) else 0
            rgb = _rgb(step, scale)
            miss = t.greedy is False
            ax.add_patch(Rectangle((col, y + line + 0.08), max(len(shown), 1), 0.84, facecolor=rgb,
                                   edgecolor=MISS_COLOR if miss else "white", linewidth=1.6 if miss else 0.4))
            ax.text(col, y + line + 0.72, shown, fontsize=9, family="DejaVu Sans Mono",
                    color="white" if _dark(rgb) else "black")
        y += max(n_lines, 1)
    sm = plt.cm.ScalarMappable(cmap=CMAP, norm=matplotlib.colors.Normalize(1, scale))
    cax = fig.add_axes([0.2, 0.42 / height, 0.6, 0.14 / height])
    bar = fig.colorbar(sm, cax=cax, orientation="horizontal")
    bar.set_label("exit step (red box: greedy miss)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.12 / height)
    return fig


def _layout(tokens: list[MapToken], width: int) -> tuple[list[tuple[int, int, str]], int]:
    """(line, column, drawn text) per token, wrapping at `width` characters and at newlines; and the line count."""
    places, line, col = [], 0, 0
    for t in tokens:
        shown = t.text.replace("\n", "↵") or "∅"
        if col and col + len(shown) > width:
            line, col = line + 1, 0
        places.append((line, col, shown))
        col += len(shown)
        if "\n" in t.text:
            line, col = line + 1, 0
    return places, line + 1


def write_png(maps: list[ExitMap], path: Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    from ..runtime.files import atomic_write

    fig = draw(maps, title)
    try:
        return atomic_write(Path(path), lambda fh: fig.savefig(fh, format="png", dpi=130), mode="wb")
    finally:
        plt.close(fig)
