"""Reading result cells: `pareto` (frontiers and matched quality), `report` (one HTML page), `check` (the
regression gate), `serve-sim` (projected serving throughput) and `export` (a tidy table)."""
from __future__ import annotations

import functools
import traceback
from pathlib import Path
from typing import Optional

import typer

from ..errors import ExitbenchError
from .app import ModelOpt, command, console, err_console, say, skip_note

DirectoriesArg = typer.Argument(..., help="Result directories (searched recursively).")
ParetoFormatOpt = typer.Option("rich", "--format", help="rich, md, csv or json.")
TableOpt = typer.Option(None, "--table", help="frontier or matched: one table only (csv always prints one; default "
                        "frontier).")
PlotOpt = typer.Option(None, "--plot", help="Also draw quality vs cost to FILE.png|svg.")
CostOpt = typer.Option("iterations", help="Cost axis of the plot: iterations, wall_clock, flops; or serving: "
                       "also the decode throughput projected from each cell's exit schedule (serve-sim).")


@command()
def pareto(directories: list[Path] = DirectoriesArg, fmt: str = ParetoFormatOpt, table: Optional[str] = TableOpt,
           plot: Optional[Path] = PlotOpt, cost: str = CostOpt, model: Optional[str] = ModelOpt):
    """Pareto frontiers of quality vs cost and the matched-quality table, from result cells."""
    from ..analysis import notes, tables
    from ..analysis.frontier import report as frontiers
    from ..analysis.plot import check_plot_target
    from ..analysis.plot import plot as draw_plot
    from ..presets import published_rows
    from ..store.disk import writable_output
    from ..store.loading import load, model_label

    tables.check_table(table)
    if plot is not None:
        check_plot_target(plot, cost)
        writable_output(plot, "--plot")
    cell_list = load(directories, on_skip=skip_note, model=model)
    say(f"model: {model_label(cell_list[0])}")
    rep = frontiers(cell_list)
    if fmt != "rich":
        print(tables.format_tables(rep, fmt, table))
    for t in tables.pareto_tables(rep, table) if fmt == "rich" else []:
        console.print(t)
    for note in notes.notes(cell_list, rep, notes.PARETO):
        say(str(note))
    if cost == "serving":  # beside iterations and wall-clock: what the frontier's points buy a server
        from ..analysis.serve_sim import projected_table
        console.print(projected_table(cell_list))
    published = published_rows(cell_list)
    if published and fmt == "rich":
        console.print(tables.published_table(published))
    elif published and fmt == "md":
        print(tables.published_markdown(published))
    for note in notes.notes(cell_list, rep, notes.PUBLISHED):
        say(str(note))
    if plot is not None:
        draw_plot(cell_list, plot, cost)
        say(f"wrote {plot}")


ReportDirArg = typer.Argument(..., metavar="RESULTS_DIR", help="Result directory (searched recursively).")
ReportOutOpt = typer.Option(None, "--out", "-o", help="The HTML file [RESULTS_DIR/report.html].")
DocsOpt = typer.Option(3, "--docs", help="Exit maps per task: the documents where policies disagree most.")
CompareOpt = typer.Option([], "--compare", help="Another model's result directory to draw beside this one "
                          "(repeatable; default: the ones RESULTS_DIR/report.yaml lists under 'compare').")


@command()
def report(directory: Path = ReportDirArg, out: Optional[Path] = ReportOutOpt, docs: int = DocsOpt,
           compare_with: list[Path] = CompareOpt, model: Optional[str] = ModelOpt):
    """One self-contained HTML page of a sweep: frontiers, matched quality, histograms, exit maps, provenance."""
    from ..analysis.report import write
    from ..store.disk import writable_output

    if docs < 0:
        raise ExitbenchError(f"--docs must be ≥ 0, got {docs}")
    out = writable_output(out or Path(directory) / "report.html", "--out")
    if out.suffix not in (".html", ".htm"):
        raise ExitbenchError(f"--out must name an .html file, got {out}")
    page = write(directory, out, docs, on_skip=skip_note, model=model, compare_with=compare_with)
    say(f"wrote {page}; open {Path(page).resolve().as_uri()} in a browser (it needs no server)")


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


RunArg = typer.Argument(..., metavar="RUN", help="The sweep to judge.")
BaselineOpt = typer.Option(..., "--baseline", help="The reference sweep.")
QualityTolOpt = typer.Option(0.01, help="Allowed relative quality loss per cell.")
IterationsTolOpt = typer.Option(0.05, help="Allowed relative rise of mean iterations.")
WallClockOpt = typer.Option(False, "--wall-clock", help="Also compare time per token, as a ratio to full depth.")
WallTolOpt = typer.Option(0.25, help="Allowed relative rise of that ratio.")
PresentOnlyOpt = typer.Option(False, "--present-only", help="Compare only the baseline cells the run has (a partial "
                              "sweep); missing cells are not regressions.")
BaselineModelOpt = typer.Option(None, "--baseline-model", help="The baseline's model, where its directory mixes "
                                "models (default: --model).")


@command()
@crash_is_not_a_verdict
def check(run_dir: Path = RunArg, baseline: Path = BaselineOpt, quality_tol: float = QualityTolOpt,
          iterations_tol: float = IterationsTolOpt, wall_clock: bool = WallClockOpt, wall_tol: float = WallTolOpt,
          present_only: bool = PresentOnlyOpt, model: Optional[str] = ModelOpt,
          baseline_model: Optional[str] = BaselineModelOpt):
    """Exit 1 when RUN regressed against BASELINE (quality, iterations, frontier; wall-clock if asked); 0 when
    not, 2 on unusable input, 3 on a crash."""
    from ..analysis.check import Tolerances, comparable_baseline, compare
    from ..analysis.notes import timing_notes
    from ..analysis.tables import regression_table
    from ..store.loading import load, load_paths

    tolerances = Tolerances.given(quality_tol, iterations_tol, wall_tol, wall_clock)
    # strict: a gate never skips a file it cannot read, on either side
    run_cells = load([run_dir], model=model, strict=True)
    base_cells = comparable_baseline(load_paths([baseline], model=baseline_model or model, strict=True))
    verdict = compare(run_cells, base_cells, tolerances, present_only)
    if wall_clock:  # a wall-clock verdict on cells timed beside other work says more about the machine
        for where, cell_list in ((run_dir, run_cells), (baseline, base_cells)):
            for note in timing_notes(cell_list):
                say(f"{note.level}: {where}: {note.text}")
    if verdict.regressions:
        console.print(regression_table(verdict.regressions, title=f"{len(verdict.regressions)} regressions of "
                                                                  f"{run_dir} against {baseline}"))
        console.print(verdict.summary(), highlight=False)
        raise typer.Exit(1)
    console.print(f"no regression: {run_dir} matches {baseline} within the tolerances; {verdict.summary()}",
                  highlight=False)


BatchesOpt = typer.Option("1,8,64", "--batch-size", help="Rows of the simulated server, comma-separated.")
CostFileOpt = typer.Option(None, "--cost", help="A cost file from bench/serve_sim_cost.py [the one fitted on the "
                           "project's CPU machine].")
SimFormatOpt = typer.Option("rich", "--format", help="rich or json.")


@command("serve-sim")
def serve_sim(directories: list[Path] = DirectoriesArg, batch_size: str = BatchesOpt,
              cost_file: Optional[Path] = CostFileOpt, fmt: str = SimFormatOpt, model: Optional[str] = ModelOpt):
    """Decode throughput relative to full depth under static and continuous depth batching, simulated from each
    cell's recorded exit schedule."""
    from ..analysis import serve_sim
    from ..store.loading import load_paths

    if fmt not in ("rich", "json"):
        raise ExitbenchError(f"--format must be rich or json, got {fmt!r}")
    batches, cost = serve_sim.parse_batches(batch_size), serve_sim.load_cost(cost_file)
    rows, skipped = serve_sim.project_cells(load_paths(directories, on_skip=skip_note, model=model), batches, cost)
    for line in serve_sim.skip_lines(skipped):
        say(line)
    if not rows:
        raise ExitbenchError(f"no cell under {', '.join(map(str, directories))} has per-token exits recorded; "
                             "rerun the sweep into a new --out")
    if fmt == "json":
        print(serve_sim.as_json(rows))
    else:
        console.print(serve_sim.table(rows, cost))


ExportFormatOpt = typer.Option("csv", "--format", help="csv or json.")
ExportOutOpt = typer.Option(None, "--out", "-o", help="Write to FILE [stdout].")


@command()
def export(directories: list[Path] = DirectoriesArg, fmt: str = ExportFormatOpt, out: Optional[Path] = ExportOutOpt):
    """Every result cell as one row of plain columns (model, task, metric, quality, policy, threshold, mean
    iterations, ms/token, …): a tidy table for pandas, R or a spreadsheet."""
    from ..analysis.export import tidy, write
    from ..runtime.files import atomic_write
    from ..store.disk import writable_output

    if out is not None:
        writable_output(out, "--out")
    text = write(tidy(directories), fmt)
    if out is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    atomic_write(out, lambda f: f.write(text))
    say(f"wrote {out}")
