"""The `exitbench` command: each command is a few lines over library calls."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import time
import traceback
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .engine.config import ExitConfig
from .errors import ExitbenchError
from .runtime.validation import at_least
from .sweep.config import RunOptions, SweepConfig

# Plain click help: typer's rich help prints a `<bool>` type beside every flag, which reads as a value to pass.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Benchmark per-token exit policies of recurrent-depth transformers.")
console = Console()
if not console.is_terminal:
    console = Console(width=140)  # logs and pipes: keep tables whole instead of folding them to 80 columns
err_console = Console(stderr=True, soft_wrap=True)  # one message, one line, whatever the width

DataDirOpt = typer.Option(None, "--data-dir", help="Local GSM8K for gsm8k tasks.")
CheckpointOpt = typer.Option(None, "--checkpoint", "-c",
                             help="Checkpoint directory or embedded name (default: the embedded tiny-raven).")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (the checkpoint's own torch_dtype), float32, bfloat16 or "
                        "float16.")
CompileOpt = typer.Option(False, "--compile", help="torch.compile each loop group's step (dynamic shapes): "
                          "faster iterations after a one-off compilation of tens of seconds.")
ThreadsOpt = typer.Option(None, "--threads", help="torch CPU threads for the model (default: torch's, one per "
                          "core; on a busy machine fewer threads time more steadily); recorded in each result.")
ModelOpt = typer.Option(None, "--model", help="The model whose cells to use, where a directory mixes models: a "
                        "fingerprint (prefix), the checkpoint's path or an embedded checkpoint's name.")
NonfiniteOpt = typer.Option(False, "--allow-nonfinite", help="Load weights that hold NaN or inf (for studying "
                            "broken checkpoints); refused by default.")


@app.callback()
def _root() -> None:
    """Keeps `exitbench` a command group, so every command is spelled out."""


def exit_knobs(*names: str, **defaults):
    """Give a command the exit knobs `names` as options, made from ExitConfig's fields (their one definition);
    the command receives them as one dict, `knobs`. `defaults` overrides a knob's default for this command."""
    specs = {name: (kind, default, meta) for name, kind, default, meta in ExitConfig.knobs()}
    chosen = [(name, specs[name][0], defaults.get(name, specs[name][1]), specs[name][2]) for name in names]
    return _options(chosen, lambda values: {"knobs": values}, drop="knobs")


def options_from(cls, name: str = "options"):
    """Give a command the fields of dataclass `cls` as options (help and flags from each field's metadata, as
    exit_knobs does for ExitConfig's); the command receives them as one `cls`, `name`."""
    hints = typing.get_type_hints(cls)
    specs = [(f.name, hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory(),
              f.metadata) for f in dataclasses.fields(cls)]
    return _options(specs, lambda values: {name: cls(**values)}, drop=name)


def _options(specs, collect, drop: str):
    """Add the options `specs` ((name, type, default, metadata)) to a command's signature, in place of its
    parameter `drop`; `collect` turns their values into the keyword arguments the command takes instead."""
    def wrap(fn):
        signature = inspect.signature(fn)
        options = []
        for name, kind, default, meta in specs:
            flags = meta.get("flags") or (f"--{name.replace('_', '-')}",)
            option = typer.Option(default, *flags, help=meta["help"])
            options.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind))

        @functools.wraps(fn)
        def command(*args, **kwargs):
            return fn(*args, **collect({name: kwargs.pop(name) for name, *_ in specs}), **kwargs)

        kept = [p for p in signature.parameters.values() if p.name != drop]
        command.__signature__ = signature.replace(parameters=kept + options)
        return command
    return wrap


# A sweep varies the policy and threshold itself; the other knobs apply to each of its cells that takes them.
KNOBS_ON_COMMAND_LINE = ExitConfig.names(command_line=True)
KNOBS_SHARED_BY_A_SWEEP = ExitConfig.names(command_line=True, swept=False)


# More threads than this per core only queue on each other (and a huge count would make torch start them all).
THREADS_PER_CORE = 4


def use_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads for this process (None: leave torch's default)."""
    if threads is not None:
        import os

        import torch

        most = THREADS_PER_CORE * (os.cpu_count() or 1)
        if at_least("--threads", threads) > most:
            raise ExitbenchError(f"--threads {threads}: at most {most} ({THREADS_PER_CORE} per core of this "
                                 f"machine's {os.cpu_count() or 1}); 1 times most steadily")
        torch.set_num_threads(threads)


def one_line_errors(fn):
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ExitbenchError as exc:
            # escaped: a message quoting a value such as [1, 2] must not be read as rich markup and lose it
            err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    return wrapper


@app.command()
@one_line_errors
@exit_knobs("kv_window")
def info(checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt,
         as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
         depth: bool = typer.Option(False, "--depth", help="Also measure accuracy, perplexity and step norms vs r "
                                    "on held-out programs of the checkpoint's synthetic task."),
         programs: int = typer.Option(256, "--programs", help="Held-out programs for --depth."),
         seed: int = typer.Option(0, "--seed", help="Seed of the held-out programs and initial states."),
         memory_plan: bool = typer.Option(False, "--plan", help="Also print the memory a run needs: weights, KV "
                                          "cache (one slot per iteration per loop layer) and activations."),
         batch_size: int = typer.Option(16, "--batch-size", help="--plan: rows run together (run's default)."),
         device: Optional[str] = typer.Option(None, help="--plan: the device whose free memory the total is "
                                              "compared with (auto, cpu, cuda, cuda:N, mps; default as run's)."),
         context: Optional[int] = typer.Option(None, "--context", help="--plan: the longest sequence, prompt and "
                                               "generated tokens [the model's context]."),
         max_steps: Optional[int] = typer.Option(None, "--max-steps", help="--plan: iterations per loop group "
                                                 "[each group's default depth]."), knobs: dict = None):
    """Architecture, parameter count, layer split, loop depths, tokenizer and provenance of a checkpoint, read
    from its config and safetensors headers (no weight is loaded unless --depth)."""
    from .models.checkpoint import check_dtype_name, inspect_checkpoint, open_checkpoint, parse_dtype
    from .models.embedded import resolve
    from .models.info import describe

    at_least("--programs", programs)
    kv_window = ExitConfig(**knobs).kv_window  # validated and normalised (0: none) as a run validates it
    layout = inspect_checkpoint(resolve(checkpoint))  # headers only
    report = describe(layout, check_dtype_name(dtype))
    if memory_plan:
        from .engine.memory import plan
        from .runtime.devices import available_memory, resolve_device

        report["plan"] = plan(layout.model, parse_dtype(report["dtype"]), batch_size,
                              layout.model.config.block_size if context is None else context, max_steps, kv_window)
        where = resolve_device(device)
        report["plan"].update(device=where, available=available_memory(where))
    if depth:
        from .studies.depth import depth_report

        report["depth"] = depth_report(open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite),
                                       n_programs=programs, seed=seed)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(title=f"exitbench info: {report['source']}", show_header=False)
    for key, value in report.items():
        if key in ("depth", "plan"):
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)
    if memory_plan:
        from .analysis.tables import plan_table

        console.print(plan_table(report["plan"]))
        p = report["plan"]
        if p["available"] is not None and p["total"] > p["available"]:
            err_console.print(f"warning: the plan needs {p['total'] / 1e9:.2f} GB but {p['device']} has "
                              f"{p['available'] / 1e9:.2f} GB free; lower --batch-size, --context or --max-steps, "
                              "or pass a --kv-window", highlight=False)
    if depth:
        from .analysis.tables import depth_tables

        for t in depth_tables(report["depth"]):
            console.print(t)


@app.command()
@one_line_errors
def train(out: Path = typer.Option(..., "--out", "-o", help="Directory for the new checkpoint."),
          arch: str = typer.Option("huginn_raven", help="huginn_raven or ouro (synthetic chains), looped_gpt2 "
                                   "(GSM8K text)."),
          task: str = typer.Option("chains", help="huginn_raven: synthetic training task."),
          n_chains: int = typer.Option(4, "--chains", help="huginn_raven: interleaved chains per program."),
          max_hop: int = typer.Option(12, help="huginn_raven: chain length, the hardest difficulty level."),
          n_embd: int = typer.Option(128, help="Hidden size."),
          n_heads: int = typer.Option(4, help="Attention heads."),
          intermediate_size: int = typer.Option(256, help="huginn_raven: gated MLP inner size."),
          prelude_layers: int = typer.Option(0, help="huginn_raven: prelude layers (attention there lets the loop idle)."),
          core_layers: int = typer.Option(1, help="huginn_raven: layers in the recurrent core; ouro: layers in the "
                                          "loop (all of them)."),
          coda_layers: int = typer.Option(0, help="huginn_raven: coda layers."),
          n_layer: int = typer.Option(6, help="looped_gpt2: layers."),
          loop_groups: str = typer.Option("1;2,3;4", help="looped_gpt2: loop groups, ';' between groups, ',' "
                                          "between layers."),
          context: int = typer.Option(128, help="looped_gpt2: training window length (the model's context is 2×)."),
          vocab_size: int = typer.Option(2048, help="looped_gpt2: size of the byte-level BPE fitted to the text."),
          gsm8k_dir: Optional[str] = typer.Option(None, help="looped_gpt2: local GSM8K (train.jsonl); default: the "
                                                  "hub's openai/gsm8k."),
          mean_recurrence: Optional[int] = typer.Option(None, help="Mean sampled r per loop group "
                                                        "[huginn_raven 16, looped_gpt2 4]."),
          max_recurrence: Optional[int] = typer.Option(None, help="Deepest r the checkpoint is meant to run [32, 12]."),
          backprop_depth: Optional[int] = typer.Option(None, help="Iterations that keep gradients [8, 12]."),
          ut_steps: int = typer.Option(12, help="ouro: the trained depth T (every step is scored)."),
          entropy_beta: float = typer.Option(0.1, help="ouro: stage I's weight on the exit distribution's entropy."),
          gate_steps: int = typer.Option(300, help="ouro: stage II steps (the gate alone), after --steps of stage I."),
          gate_lr: float = typer.Option(1e-3, help="ouro: stage II's peak learning rate."),
          gate_k: float = typer.Option(50.0, help="ouro: stage II label sharpness k in σ(k (I − γ))."),
          gate_gamma: float = typer.Option(0.005, help="ouro: stage II's loss improvement γ worth another step."),
          batch_size: Optional[int] = typer.Option(None, help="Sequences per step [64, 32]."),
          lr: Optional[float] = typer.Option(None, help="Peak learning rate, AdamW with cosine decay [2e-3, 1e-3]."),
          steps: int = typer.Option(2000, help="Optimizer steps."),
          time_budget: Optional[float] = typer.Option(None, help="Stop after this many seconds."),
          save_every: Optional[int] = typer.Option(None, help="Keep a checkpoint every N steps."),
          seed: int = typer.Option(0, help="Seed: same seed, same checkpoint."),
          threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
          resume: bool = typer.Option(False, help="Continue the run saved in --out.")):
    """Train a looped model from scratch: Raven or Ouro on synthetic chains, or looped GPT-2 on GSM8K text
    (CPU-sized)."""
    from .runtime.progress import training_progress
    from .training.train import TrainConfig, status
    from .training.train import train as run_training

    cfg = TrainConfig.for_arch(
        str(out), arch, task=task, n_chains=n_chains, max_hop=max_hop, n_embd=n_embd, n_heads=n_heads,
        intermediate_size=intermediate_size, prelude_layers=prelude_layers, core_layers=core_layers,
        coda_layers=coda_layers, n_layer=n_layer, loop_groups=loop_groups, context=context, vocab_size=vocab_size,
        gsm8k_dir=gsm8k_dir, mean_recurrence=mean_recurrence, max_recurrence=max_recurrence,
        backprop_depth=backprop_depth, batch_size=batch_size, lr=lr, steps=steps, time_budget=time_budget,
        save_every=save_every, seed=seed, threads=threads, resume=resume, ut_steps=ut_steps,
        entropy_beta=entropy_beta, gate_steps=gate_steps, gate_lr=gate_lr, gate_k=gate_k, gate_gamma=gate_gamma)
    with training_progress(console, cfg.total_steps, lambda state: status(state, cfg)) as on_step:
        path = run_training(cfg, on_step=on_step)
    console.print(f"saved {path}")


@app.command()
@one_line_errors
@exit_knobs(*KNOBS_ON_COMMAND_LINE, policy="second_order")
def trace(prompt: str = typer.Argument(..., help="Text to run; with --generate, the prompt to continue."),
          checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt,
          generate: int = typer.Option(0, help="Generate this many tokens instead of scoring the prompt."),
          exit_config: Optional[Path] = typer.Option(None, help="YAML file of exit knobs (overrides the flags)."),
          seed: int = typer.Option(0, help="Seed of the initial-state noise."), compile_step: bool = CompileOpt,
          threads: Optional[int] = ThreadsOpt,
          vs: list[str] = typer.Option([], "--vs", help="Also trace this policy (POLICY or POLICY:τ, repeatable), "
                                       "drawn beside the first."),
          html: Optional[Path] = typer.Option(None, "--html", help="Also draw the exit map to this HTML file."),
          png: Optional[Path] = typer.Option(None, "--png", help="Also draw the exit map to this PNG file."),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the traces (token ids and "
                                                  "text, exit steps, log-probs, signals per step) to this JSON file."),
          add_bos_token: Optional[bool] = typer.Option(None, "--add-bos-token/--no-add-bos-token",
                                                       help="Force BOS on (or off) the prompt, as run's option "
                                                       "(default: the tokenizer decides, as run does)."),
          knobs: dict = None):
    """Per-token exit steps of one policy on a prompt: what the engine decides, token by token."""
    from .analysis import exitmap
    from .analysis.tables import trace_table
    from .models.checkpoint import open_checkpoint
    from .store.disk import writable_output
    from .policies.learned import check_fitted_for
    from .studies.trace import parse_vs, trace_prompt, write_json

    use_threads(threads)
    cfg = ExitConfig.from_yaml(exit_config) if exit_config is not None else ExitConfig(**knobs, seed=seed)
    configs = [cfg, *parse_vs(vs, cfg)]
    for path, flag, suffix in ((html, "--html", ".html"), (png, "--png", ".png"), (json_out, "--json", ".json")):
        if path is not None:
            writable_output(path, flag)
        if path is not None and path.suffix != suffix:
            raise ExitbenchError(f"{flag} must name a {suffix} file, got {path}")
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    check_fitted_for(ck, cfg.fitted_exit_model)
    if compile_step:
        ck.model.compile_loops()
    reports = []
    for c in configs:  # a deep model's trace takes minutes: say what runs, and how long it took
        started = time.perf_counter()
        tau = "" if c.threshold is None else f" τ={c.threshold:g}"
        err_console.print(f"tracing {c.policy}{tau} …", highlight=False)
        reports.append(trace_prompt(ck, prompt, c, generate, add_bos_token))
        err_console.print(f"  {len(reports[-1]['tokens'])} tokens in {time.perf_counter() - started:.1f} s",
                          highlight=False)
        if reports[-1]["nonfinite_tokens"]:  # as run warns of a cell's: the numbers below are not to be trusted
            err_console.print(f"warning: {reports[-1]['nonfinite_tokens']} of {len(reports[-1]['tokens'])} tokens "
                              f"had a NaN or infinity in their states or logits under {c.policy}{tau}",
                              highlight=False)
    for rep in reports:
        console.print(trace_table(rep))
    maps = [exitmap.from_trace(rep) for rep in reports]
    title = f"exit map: {ck.path.name}, {reports[0]['mode']} {len(reports[0]['tokens'])} tokens"
    for path, write in ((html, exitmap.write_html), (png, exitmap.write_png)):
        if path is not None:
            err_console.print(f"wrote {write(maps, path, title)}", highlight=False)
    if json_out is not None:
        err_console.print(f"wrote {write_json(reports, ck, json_out, cfg.seed)}", highlight=False)


@app.command()
@one_line_errors
@exit_knobs(*KNOBS_SHARED_BY_A_SWEEP)
@options_from(RunOptions)
def run(options: RunOptions = None, knobs: dict = None, ctx: typer.Context = None):
    """Run lm-eval tasks under each exit policy and threshold (plus fixed depths): one result cell each.

    The exit knobs (--min-steps, --patience, …) apply to every policy of the sweep that takes them."""
    from .runtime.distributed import finish_distributed
    from .runtime.progress import SweepProgress
    from .runtime.signals import Terminated, terminate_raises
    from .sweep.run import execute, open_sweep

    use_threads(options.threads)
    cfg = SweepConfig.from_options(options, knobs, given_on_command_line(ctx))
    sweep = open_sweep(cfg, warn=lambda text: err_console.print(text, highlight=False, soft_wrap=True))
    try:
        with terminate_raises(), SweepProgress(console, err_console, len(sweep.plan.cells), enabled=sweep.rank0,
                                               quiet=cfg.quiet) as progress:
            outcome = execute(sweep, progress)
    except (KeyboardInterrupt, Terminated) as stop:
        if sweep.rank0:
            err_console.print(interrupted_note(sweep.out, [key for _, _, key in sweep.plan.cells]), highlight=False)
        raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
    if sweep.rank0:
        show_outcome(sweep, outcome)
    finish_distributed()


def show_outcome(sweep, outcome) -> None:
    """The run table, its timing warnings and, when verified, replay vs exact."""
    from .analysis.pareto import timing_notes
    from .analysis.tables import replay_table, summary_table
    from .sweep.run import summary_rows

    reused = {c["cell_id"] for c in sweep.plan.reused()}
    console.print(summary_table(summary_rows(outcome.cells, reused), title=f"{len(outcome.cells)} cells in {sweep.out}"))
    for note in timing_notes(outcome.cells):
        err_console.print(f"warning: {note}", highlight=False)
    if outcome.verified is not None:
        console.print(replay_table(outcome.verified["rows"], title=f"replay vs exact ({sweep.out / 'verify'})"))


@app.command()
@one_line_errors
def export(directories: list[Path] = typer.Argument(..., help="Result directories (searched recursively)."),
           fmt: str = typer.Option("csv", "--format", help="csv or json."),
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to FILE [stdout].")):
    """Every result cell as one row of plain columns (model, task, metric, quality, policy, threshold, mean
    iterations, ms/token, …): a tidy table for pandas, R or a spreadsheet."""
    from .analysis.export import tidy, write
    from .runtime.files import atomic_write
    from .store.disk import writable_output

    if out is not None:
        writable_output(out, "--out")
    text = write(tidy(directories), fmt)
    if out is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    atomic_write(out, lambda f: f.write(text))
    err_console.print(f"wrote {out}", highlight=False)


@app.command("presets")
@one_line_errors
def presets_command(as_json: bool = typer.Option(False, "--json", help="Print them as JSON.")):
    """The published evaluation protocols `run --preset NAME` takes, with where their numbers come from."""
    from . import presets
    from .analysis.tables import presets_table

    found = [presets.load(name) for name in presets.names()]
    if as_json:
        print(json.dumps([p.model_dump() for p in found], indent=2))
        return
    console.print(presets_table(found))


def interrupted_note(out: Path, keys: list[dict]) -> str:
    """What Ctrl-C (or SIGTERM) leaves: how many of the sweep's cells are on disk (each written whole, atomically), and how
    the rest is run."""
    from .store import cells, disk

    ids = [cells.cell_id(key) for key in keys]
    kept = len(disk.written(out, ids))
    return (f"interrupted: {kept} of the sweep's {len(ids)} cells are finished and kept in {out}; rerun the same "
            "command to resume (finished cells are reused, the rest run)")


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """The parameters of a command the user typed (not defaults): what a preset must not override. (By the
    source's name: typer runs its own copy of click, whose ParameterSource is not click's.)"""
    return {p.name for p in ctx.command.params
            if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"}


@app.command()
@one_line_errors
def pareto(directories: list[Path] = typer.Argument(..., help="Result directories (searched recursively)."),
           fmt: str = typer.Option("rich", "--format", help="rich, md, csv or json."),
           table: Optional[str] = typer.Option(None, "--table", help="frontier or matched: one table only "
                                               "(csv always prints one; default frontier)."),
           plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw quality vs cost to FILE.png|svg."),
           cost: str = typer.Option("iterations", help="Cost axis of the plot: iterations, wall_clock, flops."),
           model: Optional[str] = ModelOpt):
    """Pareto frontiers of quality vs cost and the matched-quality table, from result cells."""
    from .analysis import notes, tables
    from .analysis.frontier import report as frontiers
    from .analysis.plot import check_plot_target, plot as draw_plot
    from .presets import published_rows
    from .store.disk import writable_output
    from .store.loading import load, model_label

    tables.check_table(table)
    if plot is not None:
        check_plot_target(plot, cost)
        writable_output(plot, "--plot")
    cell_list = load(directories, on_skip=_skip_note, model=model)
    err_console.print(f"model: {model_label(cell_list[0])}", highlight=False)
    rep = frontiers(cell_list)
    if fmt == "rich":
        for t in tables.pareto_tables(rep, table):
            console.print(t)
    else:
        print(tables.format_tables(rep, fmt, table))
    for note in notes.notes(cell_list, rep, notes.PARETO):
        err_console.print(str(note), highlight=False)
    published = published_rows(cell_list)
    if published and fmt == "rich":
        console.print(tables.published_table(published))
    elif published and fmt == "md":
        print(tables.published_markdown(published))
    for note in notes.notes(cell_list, rep, notes.PUBLISHED):
        err_console.print(str(note), highlight=False)
    if plot is not None:
        draw_plot(cell_list, plot, cost)
        err_console.print(f"wrote {plot}")


@app.command()
@one_line_errors
def report(directory: Path = typer.Argument(..., metavar="RESULTS_DIR", help="Result directory (searched "
                                            "recursively)."),
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="The HTML file [RESULTS_DIR/report.html]."),
           docs: int = typer.Option(3, "--docs", help="Exit maps per task: the documents where policies disagree "
                                    "most."),
           compare_with: list[Path] = typer.Option([], "--compare", help="Another model's result directory to "
                                                   "draw beside this one (repeatable; default: the ones "
                                                   "RESULTS_DIR/report.yaml lists under 'compare')."),
           model: Optional[str] = ModelOpt):
    """One self-contained HTML page of a sweep: frontiers, matched quality, histograms, exit maps, provenance."""
    from .analysis.report import write
    from .store.disk import writable_output

    if docs < 0:
        raise ExitbenchError(f"--docs must be ≥ 0, got {docs}")
    out = writable_output(out or Path(directory) / "report.html", "--out")
    if out.suffix not in (".html", ".htm"):
        raise ExitbenchError(f"--out must name an .html file, got {out}")
    path = write(directory, out, docs, on_skip=_skip_note, model=model, compare_with=compare_with)
    err_console.print(f"wrote {path}", highlight=False)


@app.command()
@one_line_errors
def geometry(checkpoint: Optional[str] = CheckpointOpt,
             checkpoints: Optional[str] = typer.Option(None, "--checkpoints", help="Comma-separated checkpoints of "
                                                       "one model across training; DIR:training expands to the "
                                                       "step-N checkpoints `exitbench train --save-every` kept."),
             task: Optional[str] = typer.Option(None, "--task", "-t", help="Measure on this lm-eval task's documents."),
             text: Optional[str] = typer.Option(None, "--text", help="Measure on this text file (blank-line "
                                                "separated documents)."),
             data_dir: Optional[str] = DataDirOpt,
             steps: Optional[int] = typer.Option(None, "--steps", "-n", help="Iterations per loop group "
                                                 "[the group's max]."),
             tokens: int = typer.Option(4096, "--tokens", help="Tokens of --task/--text to measure on."),
             programs: int = typer.Option(128, "--programs", help="Held-out programs (chains-trained checkpoints, "
                                          "no --task/--text)."),
             seed: int = typer.Option(0, "--seed", help="Seed of held-out programs and initial states."),
             out: Path = typer.Option(Path("results/geometry"), "--out", "-o", help="Directory for geometry.json "
                                      "and the figures."),
             dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt):
    """Two-scale geometry of the loop iterates: step norms, cosines, accelerations, hand-off drift, PCA paths."""
    from .analysis.tables import geometry_tables
    from .models.checkpoint import open_checkpoint
    from .models.embedded import expand_checkpoints
    from .runtime.files import writable_dir
    from .runtime.progress import batch_progress
    from .store.disk import writable_output
    from .studies.geometry import geometry_report, write_report
    from .studies.geometry_plot import plot_handoffs, plot_pca, plot_steps

    if checkpoint and checkpoints:
        raise ExitbenchError("give --checkpoint or --checkpoints, not both")
    at_least("--programs", programs)
    writable_dir(out, "--out")
    for name in ("geometry.json", "steps.png", "handoffs.png", "pca.png"):
        writable_output(out / name, "--out")
    cks = [open_checkpoint(c, dtype, allow_nonfinite=allow_nonfinite)
           for c in (expand_checkpoints(checkpoints) if checkpoints else [checkpoint])]
    with batch_progress(console, "geometry") as on_progress:
        rep = geometry_report(cks, task=task, text=text, data_dir=data_dir, steps=steps, max_tokens=tokens,
                              programs=programs, seed=seed, on_progress=on_progress)
    for t in geometry_tables(rep):
        console.print(t)
    written = [write_report(rep, out / "geometry.json"), plot_steps(rep, out / "steps.png"),
               plot_handoffs(rep, out / "handoffs.png"), plot_pca(rep, out / "pca.png")]
    err_console.print("wrote " + ", ".join(str(p) for p in written if p is not None))


def crash_is_not_a_verdict(fn):
    """A gate's exit codes are its verdicts (0 passed, 1 regressed, 2 unusable input); Python exits 1 on an
    uncaught exception, which CI would read as "regressed". A crash exits 3, with its traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ExitbenchError, typer.Exit, KeyboardInterrupt):
            raise
        except Exception:  # noqa: BLE001  (any bug: reported as one, with its traceback)
            traceback.print_exc()
            err_console.print("[red]error:[/red] exitbench check crashed (a bug, not a verdict; exit 3): please "
                              "report the traceback above", highlight=False)
            raise typer.Exit(3) from None
    return wrapper


@app.command()
@one_line_errors
@crash_is_not_a_verdict
def check(run_dir: Path = typer.Argument(..., metavar="RUN", help="The sweep to judge."),
          baseline: Path = typer.Option(..., "--baseline", help="The reference sweep."),
          quality_tol: float = typer.Option(0.01, help="Allowed relative quality loss per cell."),
          iterations_tol: float = typer.Option(0.05, help="Allowed relative rise of mean iterations."),
          wall_clock: bool = typer.Option(False, "--wall-clock",
                                          help="Also compare time per token, as a ratio to full depth."),
          wall_tol: float = typer.Option(0.25, help="Allowed relative rise of that ratio."),
          present_only: bool = typer.Option(False, "--present-only", help="Compare only the baseline cells the run "
                                            "has (a partial sweep); missing cells are not regressions."),
          model: Optional[str] = ModelOpt,
          baseline_model: Optional[str] = typer.Option(None, "--baseline-model", help="The baseline's model, where "
                                                       "its directory mixes models (default: --model).")):
    """Exit 1 when RUN regressed against BASELINE (quality, iterations, frontier; wall-clock if asked); 0 when
    not, 2 on unusable input, 3 on a crash."""
    from .analysis.check import Tolerances, comparable_baseline, compare
    from .analysis.notes import timing_notes
    from .analysis.tables import regression_table
    from .store.loading import load, load_paths

    for name, value in (("--quality-tol", quality_tol), ("--iterations-tol", iterations_tol), ("--wall-tol", wall_tol)):
        if not value >= 0:
            raise ExitbenchError(f"{name} must be a number ≥ 0, got {value}")
    # strict: a gate never skips a file it cannot read, on either side
    run_cells = load([run_dir], model=model, strict=True)
    base_cells = comparable_baseline(load_paths([baseline], model=baseline_model or model, strict=True))
    verdict = compare(run_cells, base_cells, Tolerances(quality_tol, iterations_tol, wall_tol if wall_clock else None),
                      present_only)
    if wall_clock:  # a wall-clock verdict on cells timed beside other work says more about the machine
        for where, cell_list in ((run_dir, run_cells), (baseline, base_cells)):
            for note in timing_notes(cell_list):
                err_console.print(f"warning: {where}: {note}", highlight=False)
    if verdict.regressions:
        console.print(regression_table(verdict.regressions, title=f"{len(verdict.regressions)} regressions of "
                                                                  f"{run_dir} against {baseline}"))
        console.print(verdict.summary(), highlight=False)
        raise typer.Exit(1)
    console.print(f"no regression: {run_dir} matches {baseline} within the tolerances; {verdict.summary()}",
                  highlight=False)


@app.command()
@one_line_errors
@exit_knobs("policy", "min_steps", "max_steps", "patience", "relative", "exit_model", "kv_window",
            policy="second_order")
def calibrate(epsilon: float = typer.Option(0.05, "--epsilon", help="Tolerated risk: the share of a document's "
                                            "tokens whose prediction differs from full depth."),
              delta: float = typer.Option(0.1, "--delta", help="Allowed probability that the chosen threshold's "
                                          "risk exceeds epsilon."),
              thresholds: Optional[str] = typer.Option(None, help="Comma-separated thresholds (default: the "
                                                       "policy's grid)."),
              checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt,
              allow_nonfinite: bool = NonfiniteOpt,
              task: Optional[str] = typer.Option(None, "--task", "-t", help="Calibrate on this lm-eval task's "
                                                 "documents."),
              text: Optional[str] = typer.Option(None, "--text", help="Calibrate on this text file (blank-line "
                                                 "separated documents)."),
              data_dir: Optional[str] = DataDirOpt,
              tokens: int = typer.Option(8192, "--tokens", help="Tokens of --task/--text to use."),
              programs: int = typer.Option(256, "--programs", help="Held-out programs (chains-trained "
                                           "checkpoints, no --task/--text)."),
              test_fraction: float = typer.Option(0.5, "--test-fraction", help="Documents held out to check the "
                                                  "chosen threshold."),
              batch_size: int = typer.Option(16, help="Sequences run together (never changes answers)."),
              seed: int = typer.Option(0, help="Seed of the held-out split, programs and initial-state noise."),
              replay: bool = typer.Option(False, "--replay", help="Every threshold from one recording pass per "
                                          "split instead of one run each (see the README on replay)."),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="JSON report [results/calibrate/"
                                                 "<checkpoint>-<policy>.json]."),
              threads: Optional[int] = ThreadsOpt, knobs: dict = None):
    """The most aggressive threshold whose disagreement with full depth is ≤ epsilon with probability ≥ 1 − delta."""
    use_threads(threads)
    from .analysis.tables import calibration_table
    from .harness.documents import token_lists
    from .models.checkpoint import open_checkpoint
    from .policies import REGISTRY
    from .runtime.progress import batch_progress
    from .store.disk import writable_output
    from .studies.calibrate import calibrate as run_calibration
    from .studies.calibrate import check_calibratable, write_report
    from .policies.learned import check_fitted_for
    from .sweep.config import parse_thresholds

    config = ExitConfig(**knobs, seed=seed)  # an unknown policy or bad knob fails before the checkpoint loads
    policy = config.policy
    check_calibratable(policy)
    if out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(out, "--out")
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    grid = parse_thresholds(thresholds) or list(ck.model.exit_grids().get(policy, REGISTRY[policy].default_grid))
    check_fitted_for(ck, config.fitted_exit_model)
    path = writable_output(out or Path("results") / "calibrate" / f"{ck.path.name}-{policy}.json", "--out")
    with console.status("calibrate: reading the documents"):
        docs, source = token_lists(ck, task=task, text=text, data_dir=data_dir, max_tokens=tokens,
                                    programs=programs, seed=seed, purpose="calibrate on")
    with batch_progress(console, "calibrate") as on_progress:
        rep = run_calibration(ck.model, docs, config, grid, epsilon=epsilon, delta=delta,
                              test_fraction=test_fraction, seed=seed, batch_size=batch_size, on_progress=on_progress,
                              replay=replay)
    rep.update(source=source, checkpoint=str(ck.path))
    console.print(calibration_table(rep))
    write_report(rep, path)
    err_console.print(f"wrote {path}")


@app.command("fit-exit")
@one_line_errors
def fit_exit(checkpoint: Optional[str] = CheckpointOpt, dtype: str = DtypeOpt, allow_nonfinite: bool = NonfiniteOpt,
             task: Optional[str] = typer.Option(None, "--task", "-t", help="Fit on this lm-eval task's training "
                                                "(else validation) split, never the split it evaluates."),
             text: Optional[str] = typer.Option(None, "--text", help="Fit on this text file (blank-line separated "
                                                "documents)."),
             data_dir: Optional[str] = DataDirOpt,
             limit: int = typer.Option(256, "--limit", help="Documents (or held-out programs) to fit on."),
             tokens: int = typer.Option(65536, "--tokens", help="Cap on the tokens of those documents."),
             disjoint_from: Optional[str] = typer.Option(None, "--disjoint-from", help="Drop documents that begin "
                                                         "with an evaluation document of these tasks (default: "
                                                         "--task, or chains for held-out programs)."),
             kind: str = typer.Option("mlp", "--kind", help="mlp (one hidden tanh layer of 32) or logistic "
                                      "(regression)."),
             batch_size: int = typer.Option(16, help="Sequences recorded together."),
             seed: int = typer.Option(0, help="Seed of the programs, the validation split and the noise."),
             out: Optional[Path] = typer.Option(None, "--out", "-o", help="Exit-model JSON [results/exit-models/"
                                                "<checkpoint>.json]."), ):
    """Fit the learned exit rule to a checkpoint: features of the latent trajectory → risk of exiting too early."""
    from .analysis.tables import exit_model_tables
    from .harness.documents import synthetic_training, token_lists
    from .models.checkpoint import open_checkpoint
    from .policies import REGISTRY
    from .runtime.progress import batch_progress
    from .store.disk import writable_output
    from .studies.fit_exit import drop_evaluation_overlap, evaluation_tokens, fit, provenance, write_exit_model

    if limit < 2:
        raise ExitbenchError(f"--limit must be ≥ 2 (one document to fit on, one to check), got {limit}")
    at_least("--batch-size", batch_size)
    if seed < 0:
        # numpy's generators take no negative seed; refused here rather than after the recording pass
        raise ExitbenchError(f"--seed must be a whole number ≥ 0, got {seed}")
    if out is not None:  # a named file is checked before the checkpoint loads; the default needs its name
        writable_output(out, "--out")
    ck = open_checkpoint(checkpoint, dtype, allow_nonfinite=allow_nonfinite)
    path = writable_output(out or Path("results") / "exit-models" / f"{ck.path.name}.json", "--out")
    if disjoint_from is None:
        checked = [task] if task else (["chains"] if not text and synthetic_training(ck) else [])
    else:
        checked = [t.strip() for t in disjoint_from.split(",") if t.strip()]
    with console.status("fit-exit: reading the documents"):
        docs, source = token_lists(ck, task=task, text=text, data_dir=data_dir, max_tokens=tokens,
                                   programs=limit, seed=f"fit-exit-{seed}", purpose="fit on", split="fitting")
        docs, disjoint = drop_evaluation_overlap(docs[:limit], evaluation_tokens(ck, checked, data_dir))
    with batch_progress(console, "fit-exit") as on_progress:
        batches = -(-len(docs) // batch_size)
        done = iter(range(1, batches + 1))
        content = fit(ck.model, docs, kind=kind, seed=seed, batch_size=batch_size,
                      thresholds=REGISTRY["learned"].default_grid,
                      on_batch=lambda: on_progress(next(done), batches))
    content.update(provenance(ck, source, docs, disjoint, seed))
    for table in exit_model_tables(content):
        console.print(table)
    write_exit_model(content, path)
    err_console.print(f"wrote {path}  (use: exitbench run --policy learned --exit-model {path})", highlight=False)


@app.command()
def policies():
    """The exit policies: name, what makes a token exit, whether it decodes, default threshold and grid."""
    from .policies import REGISTRY

    table = Table(title="exit policies (τ = --threshold; `exitbench run --policy NAME` sweeps the grid)")
    for col in ("policy", "exits when", "decodes?", "default τ", "grid"):
        table.add_column(col)
    for name, cls in REGISTRY.items():
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        grid = ", ".join(f"{t:g}" for t in cls.default_grid)
        table.add_row(name, summary, "yes" if cls.needs_logits else "no", f"{cls.default_threshold:g}", grid)
    console.print(table)


def _skip_note(skipped: list[Path]) -> None:
    err_console.print(f"note: skipped {len(skipped)} JSON file(s) that are not result cells (e.g. {skipped[0]})",
                      highlight=False)


# No help option of its own: `--help` belongs to lm-eval, which prints its options.
@app.command(name="lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@one_line_errors
def lm_eval_passthrough(ctx: typer.Context):
    """lm-eval's own CLI with the `exitbench` model registered: `exitbench lm-eval run --model exitbench …`."""
    from .harness.cli import run_lm_eval

    run_lm_eval(ctx.args)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
