"""What there is to run: `info` (a checkpoint, from its headers), `presets` (published protocols), `policies`."""
from __future__ import annotations

import json

import typer
from rich.table import Table

from ..engine.config import ExitConfig
from ..models.info import InfoOptions
from .app import app, command, console, exit_knobs, options_from, say


@command()
@exit_knobs("kv_window")
@options_from(InfoOptions)
def info(options: InfoOptions = None, knobs: dict = None):
    """Architecture, parameter count, layer split, loop depths, tokenizer and provenance of a checkpoint, read
    from its config and safetensors headers (no weight is loaded unless --depth)."""
    from ..engine.memory import device_plan
    from ..models.checkpoint import check_dtype_name, inspect_checkpoint, open_checkpoint, parse_dtype
    from ..models.embedded import resolve
    from ..models.info import describe
    from ..runtime.validation import at_least

    o = options
    at_least("--programs", o.programs)
    kv_window = ExitConfig(**knobs).kv_window  # validated and normalised (0: none) as a run validates it
    layout = inspect_checkpoint(resolve(o.checkpoint))  # headers only
    report = describe(layout, check_dtype_name(o.dtype))
    if o.memory_plan:
        length = layout.model.config.block_size if o.context is None else o.context
        report["plan"] = device_plan(layout.model, parse_dtype(report["dtype"]), o.batch_size, length, o.max_steps,
                                     kv_window, o.device, o.memory_gb)
    if o.depth:
        from ..studies.depth import depth_report

        report["depth"] = depth_report(open_checkpoint(o.checkpoint, o.dtype, allow_nonfinite=o.allow_nonfinite),
                                       n_programs=o.programs, seed=o.seed)
    if o.as_json:
        print(json.dumps(report, indent=2))
    else:
        show_info(report)


def show_info(report: dict) -> None:
    """The checkpoint's table, then its memory plan and depth report where asked for."""
    from ..analysis.tables import depth_tables, plan_table

    table = Table(title=f"exitbench info: {report['source']}", show_header=False)
    for key, value in report.items():
        if key in ("depth", "plan"):
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)
    p = report.get("plan")
    if p is not None:
        console.print(plan_table(p))
        if p["available"] is not None and p["total"] > p["available"]:
            say(f"warning: the plan needs {p['total'] / 1e9:.2f} GB but {p['device']} has "
                f"{p['available'] / 1e9:.2f} GB free; lower --batch-size, --context or --max-steps, or pass a "
                "--kv-window")
    for t in depth_tables(report["depth"]) if "depth" in report else []:
        console.print(t)


@command("presets")
def presets_command(fmt: str = typer.Option("rich", "--format", help="rich (a table per preset), md or json."),
                    as_json: bool = typer.Option(False, "--json", help="Print them as JSON (as --format json).")):
    """The published evaluation protocols `run --preset NAME` takes, with where their numbers come from."""
    from .. import presets
    from ..analysis.tables import presets_markdown, presets_tables
    from ..errors import ExitbenchError

    found = [presets.load(name) for name in presets.names()]
    fmt = "json" if as_json else fmt
    if fmt == "json":
        print(json.dumps([p.model_dump() for p in found], indent=2))
    elif fmt == "md":
        print(presets_markdown(found))
    elif fmt == "rich":
        for table in presets_tables(found):
            console.print(table)
    else:
        raise ExitbenchError(f"--format must be rich, md or json, got {fmt!r}")


@app.command()
def policies():
    """The exit policies: name, what makes a token exit, whether it decodes, default threshold and grid, source."""
    from ..policies import REGISTRY

    table = Table(title="exit policies (τ = --threshold; `exitbench run --policy NAME` sweeps the grid)")
    for col in ("policy", "exits when", "decodes?", "default τ", "grid", "source"):
        table.add_column(col)
    for name, cls in REGISTRY.items():
        # the docstring's whole first paragraph: its first line alone cut qexit's and learned's mid-sentence
        summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        if cls.takes_rules:  # a conjunction decodes, and sweeps, as its rules do
            table.add_row(name, summary, "if a rule does", "its varied rule's", "its varied rule's", cls.source)
            continue
        grid = ", ".join(f"{t:g}" for t in cls.default_grid)
        table.add_row(name, summary, "yes" if cls.needs_logits else "no", f"{cls.default_threshold:g}", grid,
                      cls.source)
    console.print(table)
