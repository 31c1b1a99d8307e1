"""Studies of one checkpoint's loop: `trace` (per-token exits on a prompt), `geometry` (the iterates' two
scales), `calibrate` (a threshold with a risk bound) and `fit-exit` (the learned rule)."""
from __future__ import annotations

import time
from pathlib import Path

import typer

from ..engine.config import ExitConfig
from ..errors import ExitbenchError
from ..studies.options import CalibrateOptions, FitExitOptions, GeometryOptions, TraceOptions
from .app import (KNOBS_ON_COMMAND_LINE, command, console, exit_config_from, exit_knobs, knobs_from, options_from, say,
                  writable_targets)

PromptArg = typer.Argument(..., help="Text to run; with --generate, the prompt to continue.")


@command()
@exit_knobs(*KNOBS_ON_COMMAND_LINE, policy="second_order")
@options_from(TraceOptions)
def trace(prompt: str = PromptArg, options: TraceOptions = None, knobs: dict = None, ctx: typer.Context = None):
    """Per-token exit steps of one policy on a prompt: what the engine decides, token by token."""
    from ..models.checkpoint import open_checkpoint
    from ..policies.learned import check_fitted_for
    from ..runtime.devices import use_threads
    from ..studies.trace import check_exits, parse_vs

    o = options
    use_threads(o.threads)
    cfg = exit_config_from(ctx, knobs, o.exit_config, seed=o.seed)
    configs = [cfg, *parse_vs(o.vs, cfg)]
    writable_targets((o.html, "--html", ".html"), (o.png, "--png", ".png"), (o.json_out, "--json", ".json"))
    ck = open_checkpoint(o.checkpoint, o.dtype, allow_nonfinite=o.allow_nonfinite)
    check_fitted_for(ck, cfg.fitted_exit_model)
    check_exits(ck, configs)
    if o.compile_step:
        ck.model.compile_loops()
    reports = [traced(ck, prompt, c, o.generate, o.add_bos_token) for c in configs]
    show_traces(ck, reports, o.html, o.png, o.json_out, cfg.seed)


def traced(ck, prompt: str, config: ExitConfig, generate: int, add_bos_token: bool | None) -> dict:
    """One policy's trace; a deep model's takes minutes, so say what runs and how long it took."""
    from ..studies.trace import trace_prompt

    from ..analysis.labels import config_label

    started = time.perf_counter()
    name = config_label(config.policy, config.threshold)
    say(f"tracing {name} …")
    report = trace_prompt(ck, prompt, config, generate, add_bos_token)
    say(f"  {len(report['tokens'])} tokens in {time.perf_counter() - started:.1f} s")
    if report["nonfinite_tokens"]:  # as run warns of a cell's: the numbers below are not to be trusted
        say(f"warning: {report['nonfinite_tokens']} of {len(report['tokens'])} tokens had a NaN or infinity in "
            f"their states or logits under {name}")
    return report


def show_traces(ck, reports: list[dict], html: Path | None, png: Path | None, json_out: Path | None,
                seed: int) -> None:
    from ..analysis import exitmap
    from ..analysis.tables import trace_table
    from ..studies.trace import write_json

    for rep in reports:
        console.print(trace_table(rep))
    maps = [exitmap.from_trace(rep) for rep in reports]
    title = f"exit map: {ck.path.name}, {reports[0]['mode']} {len(reports[0]['tokens'])} tokens"
    for path, write in ((html, exitmap.write_html), (png, exitmap.write_png)):
        if path is not None:
            say(f"wrote {write(maps, path, title)}")
    if json_out is not None:
        say(f"wrote {write_json(reports, ck, json_out, seed)}")


@command()
@options_from(GeometryOptions)
def geometry(options: GeometryOptions = None):
    """Two-scale geometry of the loop iterates: step norms, cosines, accelerations, hand-off drift, PCA paths."""
    from ..analysis.tables import geometry_tables
    from ..models.checkpoint import open_checkpoint
    from ..models.embedded import expand_checkpoints
    from ..runtime.files import writable_dir
    from ..runtime.progress import batch_progress
    from ..runtime.validation import at_least
    from ..store.disk import writable_output
    from ..studies.geometry import geometry_report
    from ..studies.geometry_plot import FILES, write_figures

    o = options
    if o.checkpoint and o.checkpoints:
        raise ExitbenchError("give --checkpoint or --checkpoints, not both")
    at_least("--programs", o.programs)
    writable_dir(o.out, "--out")
    for name in FILES:
        writable_output(o.out / name, "--out")
    cks = [open_checkpoint(c, o.dtype, allow_nonfinite=o.allow_nonfinite)
           for c in (expand_checkpoints(o.checkpoints) if o.checkpoints else [o.checkpoint])]
    with batch_progress(console, "geometry") as on_progress:
        rep = geometry_report(cks, task=o.task, text=o.text, data_dir=o.data_dir, steps=o.steps,
                              max_tokens=o.tokens, programs=o.programs, seed=o.seed, on_progress=on_progress)
    for t in geometry_tables(rep):
        console.print(t)
    say("wrote " + ", ".join(str(p) for p in write_figures(rep, o.out) if p is not None))


@command()
@exit_knobs(*(k for k in KNOBS_ON_COMMAND_LINE if k != "threshold"), policy="second_order")
@options_from(CalibrateOptions)
def calibrate(options: CalibrateOptions = None, knobs: dict = None, ctx: typer.Context = None):
    """The most aggressive threshold whose disagreement with full depth is ≤ epsilon with probability ≥ 1 − delta."""
    from ..analysis.tables import calibration_table
    from ..harness.documents import token_lists
    from ..models.checkpoint import open_checkpoint
    from ..models.embedded import recorded_path
    from ..runtime.devices import use_threads
    from ..store.disk import writable_output
    from ..studies.calibrate import calibrate as run_calibration
    from ..studies.calibrate import check_calibratable, chosen_grid, write_report

    o = options
    use_threads(o.threads)
    # an unknown policy or bad knob fails before the checkpoint loads
    config = exit_config_from(ctx, knobs, o.exit_config, seed=o.seed)
    check_calibratable(config.policy, config.threshold, o.thresholds)
    if o.out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(o.out, "--out")
    ck = open_checkpoint(o.checkpoint, o.dtype, allow_nonfinite=o.allow_nonfinite)
    grid = chosen_grid(ck, config, o.thresholds)  # a conjunction calibrates its varied member's threshold
    path = writable_output(o.out or Path("results") / "calibrate" / f"{ck.path.name}-{config.policy}.json", "--out")
    with console.status("calibrate: reading the documents"):
        docs, source = token_lists(ck, task=o.task, text=o.text, data_dir=o.data_dir, max_tokens=o.tokens,
                                   programs=o.programs, seed=o.seed, purpose="calibrate on")
    rep = with_progress("calibrate", lambda on_progress: run_calibration(
        ck.model, docs, config, grid, epsilon=o.epsilon, delta=o.delta, test_fraction=o.test_fraction, seed=o.seed,
        batch_size=o.batch_size, on_progress=on_progress, replay=o.replay))
    rep.update(source=source, checkpoint=recorded_path(ck.path))
    console.print(calibration_table(rep))
    write_report(rep, path)
    say(f"wrote {path}")


def with_progress(command: str, work):
    """`work(on_progress)` under a progress bar named for the command."""
    from ..runtime.progress import batch_progress

    with batch_progress(console, command) as on_progress:
        return work(on_progress)


@command("fit-exit")
@exit_knobs("max_steps")
@options_from(FitExitOptions)
def fit_exit(options: FitExitOptions = None, knobs: dict = None, ctx: typer.Context = None):
    """Fit the learned exit rule to a checkpoint: features of the latent trajectory → risk of exiting too early.

    Its labels are taken against full depth, each loop group's default or --max-steps (from --exit-config too)."""
    from ..analysis.tables import exit_model_tables
    from ..models.checkpoint import open_checkpoint
    from ..store.disk import writable_output
    from ..studies.fit_exit import (check_fit_options, fit_depths, fit_learned, fitting_documents, provenance,
                                    write_exit_model)

    # the learned rule's file is what this writes, so the knobs are read as a dict, not a config of that rule
    o = options
    knobs = knobs_from(ctx, knobs, o.exit_config, seed=o.seed)
    seed = knobs["seed"]
    check_fit_options(o.limit, o.batch_size, seed)
    if o.out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(o.out, "--out")
    ck = open_checkpoint(o.checkpoint, o.dtype, allow_nonfinite=o.allow_nonfinite)
    steps = fit_depths(ck.model, knobs)
    path = writable_output(o.out or Path("results") / "exit-models" / f"{ck.path.name}.json", "--out")
    with console.status("fit-exit: reading the documents"):
        docs, source, disjoint = fitting_documents(ck, o.task, o.text, o.data_dir, o.tokens, o.limit, seed,
                                                   o.disjoint_from)
    content = with_progress("fit-exit", lambda on_progress: fit_learned(
        ck.model, docs, kind=o.kind, seed=seed, batch_size=o.batch_size, on_progress=on_progress, steps=steps))
    content.update(provenance(ck, source, docs, disjoint, seed))
    for table in exit_model_tables(content):
        console.print(table)
    write_exit_model(content, path)
    say(f"wrote {path}  (use: exitbench run --policy learned --exit-model {path})")
