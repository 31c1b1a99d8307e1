"""Studies of one checkpoint's loop: `trace` (per-token exits on a prompt), `geometry` (the iterates' two
scales), `calibrate` (a threshold with a risk bound) and `fit-exit` (the learned rule)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ..engine.config import ExitConfig
from ..errors import ExitbenchError
from .app import (KNOBS_ON_COMMAND_LINE, CheckpointOpt, CompileOpt, DataDirOpt, DtypeOpt, NonfiniteOpt, ThreadsOpt,
                  command, console, exit_config_from, exit_knobs, knobs_from, say,
                  writable_targets)

PromptArg = typer.Argument(..., help="Text to run; with --generate, the prompt to continue.")
GenerateOpt = typer.Option(0, help="Generate this many tokens instead of scoring the prompt.")
ExitConfigOpt = typer.Option(None, help="YAML file of exit knobs, beside the flags (a knob set in both is refused).")
VsOpt = typer.Option([], "--vs", help="Also trace this policy (POLICY or POLICY:τ, repeatable), drawn beside the "
                     "first.")
HtmlOpt = typer.Option(None, "--html", help="Also draw the exit map to this HTML file.")
PngOpt = typer.Option(None, "--png", help="Also draw the exit map to this PNG file.")
TraceJsonOpt = typer.Option(None, "--json", help="Also write the traces (token ids and text, exit steps, "
                            "log-probs, signals per step) to this JSON file.")
TraceBosOpt = typer.Option(None, "--add-bos-token/--no-add-bos-token", help="Force BOS on (or off) the prompt, as "
                           "run's option (default: the tokenizer decides, as run does).")


@command()
@exit_knobs(*KNOBS_ON_COMMAND_LINE, policy="second_order")
def trace(prompt: str = PromptArg, checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt,
          allow_nonfinite: bool = NonfiniteOpt, generate: int = GenerateOpt, exit_config: Optional[Path] = ExitConfigOpt,
          seed: int = typer.Option(0, help="Seed of the initial-state noise."), compile_step: bool = CompileOpt,
          threads: Optional[int] = ThreadsOpt, vs: list[str] = VsOpt, html: Optional[Path] = HtmlOpt,
          png: Optional[Path] = PngOpt, json_out: Optional[Path] = TraceJsonOpt,
          add_bos_token: Optional[bool] = TraceBosOpt, knobs: dict = None, ctx: typer.Context = None):
    """Per-token exit steps of one policy on a prompt: what the engine decides, token by token."""
    from ..models.checkpoint import open_checkpoint
    from ..policies.learned import check_fitted_for
    from ..runtime.devices import use_threads
    from ..studies.trace import check_exits, parse_vs

    use_threads(threads)
    cfg = exit_config_from(ctx, knobs, exit_config, seed=seed)
    configs = [cfg, *parse_vs(vs, cfg)]
    writable_targets((html, "--html", ".html"), (png, "--png", ".png"), (json_out, "--json", ".json"))
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    check_fitted_for(ck, cfg.fitted_exit_model)
    check_exits(ck, configs)
    if compile_step:
        ck.model.compile_loops()
    reports = [traced(ck, prompt, c, generate, add_bos_token) for c in configs]
    show_traces(ck, reports, html, png, json_out, cfg.seed)


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


CheckpointsOpt = typer.Option(None, "--checkpoints", help="Comma-separated checkpoints of one model across "
                              "training; DIR:training expands to the step-N checkpoints `exitbench train "
                              "--save-every` kept.")
GeometryStepsOpt = typer.Option(None, "--steps", "-n", help="Iterations per loop group [the group's max].")
GeometryOutOpt = typer.Option(Path("results/geometry"), "--out", "-o", help="Directory for geometry.json and the "
                              "figures.")


@command()
def geometry(checkpoint: Optional[str] = CheckpointOpt, checkpoints: Optional[str] = CheckpointsOpt,
             task: Optional[str] = typer.Option(None, "--task", "-t", help="Measure on this lm-eval task's documents."),
             text: Optional[str] = typer.Option(None, "--text", help="Measure on this text file (blank-line "
                                                "separated documents)."),
             data_dir: Optional[str] = DataDirOpt, steps: Optional[int] = GeometryStepsOpt,
             tokens: int = typer.Option(4096, "--tokens", help="Tokens of --task/--text to measure on."),
             programs: int = typer.Option(128, "--programs", help="Held-out programs (chains-trained checkpoints, "
                                          "no --task/--text)."),
             seed: int = typer.Option(0, "--seed", help="Seed of held-out programs and initial states."),
             out: Path = GeometryOutOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt):
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

    if checkpoint and checkpoints:
        raise ExitbenchError("give --checkpoint or --checkpoints, not both")
    at_least("--programs", programs)
    writable_dir(out, "--out")
    for name in FILES:
        writable_output(out / name, "--out")
    cks = [open_checkpoint(c, dtype, allow_nonfinite=allow_nonfinite)
           for c in (expand_checkpoints(checkpoints) if checkpoints else [checkpoint])]
    with batch_progress(console, "geometry") as on_progress:
        rep = geometry_report(cks, task=task, text=text, data_dir=data_dir, steps=steps, max_tokens=tokens,
                              programs=programs, seed=seed, on_progress=on_progress)
    for t in geometry_tables(rep):
        console.print(t)
    say("wrote " + ", ".join(str(p) for p in write_figures(rep, out) if p is not None))


EpsilonOpt = typer.Option(0.05, "--epsilon", help="Tolerated risk: the share of a document's tokens whose "
                          "prediction differs from full depth.")
DeltaOpt = typer.Option(0.1, "--delta", help="Allowed probability that the chosen threshold's risk exceeds "
                        "epsilon.")
CalibrationGridOpt = typer.Option(None, help="Comma-separated thresholds (default: the policy's grid).")
CalibrationTaskOpt = typer.Option(None, "--task", "-t", help="Calibrate on this lm-eval task's documents.")
CalibrationTextOpt = typer.Option(None, "--text", help="Calibrate on this text file (blank-line separated documents).")
CalibrationTokensOpt = typer.Option(8192, "--tokens", help="Tokens of --task/--text to use.")
CalibrationProgramsOpt = typer.Option(256, "--programs", help="Held-out programs (chains-trained checkpoints, no "
                                      "--task/--text).")
CalibrationBatchOpt = typer.Option(16, help="Sequences run together (never changes answers).")
CalibrationSeedOpt = typer.Option(0, help="Seed of the held-out split, programs and initial-state noise.")
TestFractionOpt = typer.Option(0.5, "--test-fraction", help="Documents held out to check the chosen threshold.")
CalibrationReplayOpt = typer.Option(False, "--replay", help="Every threshold from one recording pass per split "
                                    "instead of one run each (docs/sweeps.md on replay).")
CalibrationOutOpt = typer.Option(None, "--out", "-o", help="JSON report [results/calibrate/<checkpoint>-<policy>"
                                 ".json].")


@command()
@exit_knobs(*(k for k in KNOBS_ON_COMMAND_LINE if k != "threshold"), policy="second_order")
def calibrate(epsilon: float = EpsilonOpt, delta: float = DeltaOpt, thresholds: Optional[str] = CalibrationGridOpt,
              checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt,
              task: Optional[str] = CalibrationTaskOpt, text: Optional[str] = CalibrationTextOpt,
              data_dir: Optional[str] = DataDirOpt, tokens: int = CalibrationTokensOpt,
              programs: int = CalibrationProgramsOpt, test_fraction: float = TestFractionOpt,
              batch_size: int = CalibrationBatchOpt, seed: int = CalibrationSeedOpt, replay: bool = CalibrationReplayOpt,
              out: Optional[Path] = CalibrationOutOpt, threads: Optional[int] = ThreadsOpt,
              exit_config: Optional[Path] = ExitConfigOpt, knobs: dict = None, ctx: typer.Context = None):
    """The most aggressive threshold whose disagreement with full depth is ≤ epsilon with probability ≥ 1 − delta."""
    from ..analysis.tables import calibration_table
    from ..harness.documents import token_lists
    from ..models.checkpoint import open_checkpoint
    from ..models.embedded import recorded_path
    from ..runtime.devices import use_threads
    from ..store.disk import writable_output
    from ..studies.calibrate import calibrate as run_calibration
    from ..studies.calibrate import check_calibratable, chosen_grid, write_report

    use_threads(threads)
    # an unknown policy or bad knob fails before the checkpoint loads
    config = exit_config_from(ctx, knobs, exit_config, seed=seed)
    check_calibratable(config.policy, config.threshold, thresholds)
    if out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(out, "--out")
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    grid = chosen_grid(ck, config, thresholds)  # a conjunction calibrates its varied member's threshold
    path = writable_output(out or Path("results") / "calibrate" / f"{ck.path.name}-{config.policy}.json", "--out")
    with console.status("calibrate: reading the documents"):
        docs, source = token_lists(ck, task=task, text=text, data_dir=data_dir, max_tokens=tokens,
                                   programs=programs, seed=seed, purpose="calibrate on")
    rep = with_progress("calibrate", lambda on_progress: run_calibration(
        ck.model, docs, config, grid, epsilon=epsilon, delta=delta, test_fraction=test_fraction, seed=seed,
        batch_size=batch_size, on_progress=on_progress, replay=replay))
    rep.update(source=source, checkpoint=recorded_path(ck.path))
    console.print(calibration_table(rep))
    write_report(rep, path)
    say(f"wrote {path}")


def with_progress(command: str, work):
    """`work(on_progress)` under a progress bar named for the command."""
    from ..runtime.progress import batch_progress

    with batch_progress(console, command) as on_progress:
        return work(on_progress)


FitLimitOpt = typer.Option(256, "--limit", help="Documents (or held-out programs) to fit on.")
FitTokensOpt = typer.Option(65536, "--tokens", help="Cap on the tokens of those documents.")
DisjointOpt = typer.Option(None, "--disjoint-from", help="Drop documents that begin with an evaluation document of "
                           "these tasks (default: --task, or chains for held-out programs).")
KindOpt = typer.Option("mlp", "--kind", help="mlp (one hidden tanh layer of 32) or logistic (regression).")
FitTaskOpt = typer.Option(None, "--task", "-t", help="Fit on this lm-eval task's training (else validation) split, "
                          "never the split it evaluates.")
FitTextOpt = typer.Option(None, "--text", help="Fit on this text file (blank-line separated documents).")
FitOutOpt = typer.Option(None, "--out", "-o", help="Exit-model JSON [results/exit-models/<checkpoint>.json].")


@command("fit-exit")
@exit_knobs("max_steps")
def fit_exit(checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt,
             task: Optional[str] = FitTaskOpt, text: Optional[str] = FitTextOpt, data_dir: Optional[str] = DataDirOpt, limit: int = FitLimitOpt, tokens: int = FitTokensOpt,
             disjoint_from: Optional[str] = DisjointOpt, kind: str = KindOpt,
             batch_size: int = typer.Option(16, help="Sequences recorded together."),
             seed: int = typer.Option(0, help="Seed of the programs, the validation split and the noise."),
             out: Optional[Path] = FitOutOpt, exit_config: Optional[Path] = ExitConfigOpt, knobs: dict = None,
             ctx: typer.Context = None):
    """Fit the learned exit rule to a checkpoint: features of the latent trajectory → risk of exiting too early.

    Its labels are taken against full depth, each loop group's default or --max-steps (from --exit-config too)."""
    from ..analysis.tables import exit_model_tables
    from ..models.checkpoint import open_checkpoint
    from ..store.disk import writable_output
    from ..studies.fit_exit import (check_fit_options, fit_depths, fit_learned, fitting_documents, provenance,
                                    write_exit_model)

    # the learned rule's file is what this writes, so the knobs are read as a dict, not a config of that rule
    knobs = knobs_from(ctx, knobs, exit_config, seed=seed)
    seed = knobs["seed"]
    check_fit_options(limit, batch_size, seed)
    if out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(out, "--out")
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    steps = fit_depths(ck.model, knobs)
    path = writable_output(out or Path("results") / "exit-models" / f"{ck.path.name}.json", "--out")
    with console.status("fit-exit: reading the documents"):
        docs, source, disjoint = fitting_documents(ck, task, text, data_dir, tokens, limit, seed, disjoint_from)
    content = with_progress("fit-exit", lambda on_progress: fit_learned(
        ck.model, docs, kind=kind, seed=seed, batch_size=batch_size, on_progress=on_progress, steps=steps))
    content.update(provenance(ck, source, docs, disjoint, seed))
    for table in exit_model_tables(content):
        console.print(table)
    write_exit_model(content, path)
    say(f"wrote {path}  (use: exitbench run --policy learned --exit-model {path})")
