"""The Typer app, its consoles, and what every command shares: options, one-line errors, option groups made
from the config dataclasses' fields (their one definition: help and flags live in each field's metadata)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text
from typer._click.exceptions import BadParameter
from typer.core import TyperGroup

from ..engine.config import ExitConfig
from ..errors import ExitbenchError
from ..sweep.config import RunOptions


class _OneLineGroup(TyperGroup):
    """Typer's group, but an option's value that does not parse as its type ends the command as bad input does
    everywhere: one line quoting the flag and the value, exit 2 (typer's own is a four-line box without the value)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BadParameter as exc:
            if exc.param is None or not getattr(exc.param, "opts", None):
                raise
            err_console.print(error_line(bad_value_line(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


def bad_value_line(exc: BadParameter) -> str:
    """`--flag 'VALUE': what the value should be`, the value as typed where the parse kept it."""
    flag = max(exc.param.opts, key=len)
    cause = exc.__cause__
    errors = cause.errors() if hasattr(cause, "errors") else []
    typed = f" {errors[0]['input']!r}" if errors and "input" in errors[0] else ""
    said = exc.message or "not a value it takes"
    where = f"{exc.ctx.command_path} --help" if exc.ctx is not None else "--help"
    return f"{flag}{typed}: {said[:1].lower()}{said[1:]} (see {where})"


# Plain click help: typer's rich help prints a `<bool>` type beside every flag, which reads as a value to pass.
app = typer.Typer(cls=_OneLineGroup, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Benchmark per-token exit policies of recurrent-depth transformers.")
# No emoji codes: a path or value such as `:fire:` is printed as typed, never as a picture.
console = Console(emoji=False)
if not console.is_terminal:
    # logs and pipes: keep tables whole instead of folding them to 80 columns
    console = Console(width=140, emoji=False)
err_console = Console(stderr=True, soft_wrap=True, emoji=False)  # one message, one line, whatever the width


def run_option(name: str):
    """`run`'s option `name` for another command that takes it too: RunOptions' field is its one statement."""
    f = next(f for f in dataclasses.fields(RunOptions) if f.name == name)
    flags = f.metadata["flags"] or (f"--{name.replace('_', '-')}",)
    return typer.Option(f.default, *flags, help=f.metadata["help"])


DataDirOpt = typer.Option(None, "--data-dir", help="Local GSM8K for gsm8k tasks.")
CheckpointOpt = run_option("checkpoint")
DtypeOpt = run_option("dtype")
CompileOpt = run_option("compile_step")
ThreadsOpt = run_option("threads")
NonfiniteOpt = run_option("allow_nonfinite")
ModelOpt = typer.Option(None, "--model", help="The model whose cells to use, where a directory mixes models: a "
                        "fingerprint (prefix), the checkpoint's path or an embedded checkpoint's name.")


def _print_version(asked: bool) -> None:
    if asked:
        from .. import __version__

        console.print(f"exitbench {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print exitbench's version and exit.")) -> None:
    """Keeps `exitbench` a command group, so every command is spelled out."""


def say(text: str) -> None:
    """A line for the user beside the results (stderr, so stdout stays the results alone), as written: no markup,
    so a quoted path or value such as `[bold]` is not read as a style."""
    err_console.print(text, markup=False, emoji=False, highlight=False, soft_wrap=True)


def error_line(message: str) -> Text:
    """`error: MESSAGE`, the message exactly as given (a Text is never read as markup or emoji codes)."""
    return Text.assemble(("error:", "red"), " ", message)


def one_line_errors(fn):
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ExitbenchError as exc:
            err_console.print(error_line(str(exc)), highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    return wrapper


def command(*args, **kwargs):
    """`app.command(*args, **kwargs)` over `one_line_errors`: how every study and results command is registered."""
    return lambda fn: app.command(*args, **kwargs)(one_line_errors(fn))


def options_from(cls, name: str = "options"):
    """Give a command the command-line fields of dataclass `cls` as options (help and flags from each field's
    metadata; a field whose metadata says command_line=False stays off); the command receives them as one
    `cls`, `name`."""
    hints = typing.get_type_hints(cls)
    specs = [(f.name, hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory(),
              f.metadata) for f in dataclasses.fields(cls) if f.metadata.get("command_line", True)]
    return _options(specs, lambda values: {name: cls(**values)}, drop=name)


def option_specs(specs, into: str):
    """Give a command the options `specs` ((name, type, default, metadata), e.g. TrainConfig.options()); the
    command receives their values as one dict, `into`."""
    return _options(specs, lambda values: {into: values}, drop=into)


def exit_knobs(*names: str, **defaults):
    """Give a command the exit knobs `names` as options, made from ExitConfig's fields (their one definition);
    the command receives them as one dict, `knobs`. `defaults` overrides a knob's default for this command."""
    specs = {name: (kind, default, meta) for name, kind, default, meta in ExitConfig.knobs()}
    # a knob's flag is its name: a boolean knob is a plain switch, without typer's --no- form
    return option_specs([(name, specs[name][0], defaults.get(name, specs[name][1]),
                          {**specs[name][2], "flags": specs[name][2]["flags"] or (f"--{name.replace('_', '-')}",)})
                         for name in names], into="knobs")


def _options(specs, collect, drop: str):
    """Add the options `specs` ((name, type, default, metadata)) to a command's signature, in place of its
    parameter `drop`; `collect` turns their values into the keyword arguments the command takes instead."""
    def wrap(fn):
        signature = inspect.signature(fn)
        options = []
        for name, kind, default, meta in specs:
            # no flags given: typer's own from the name (a bool then also gets its --no- form)
            option = typer.Option(default, *(meta.get("flags") or ()), help=meta["help"])
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


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """The parameters of a command the user typed (not defaults): what a preset must not override. (By the
    source's name: typer runs its own copy of click, whose ParameterSource is not click's.)"""
    return {p.name for p in ctx.command.params
            if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"}


def exit_config_from(ctx: typer.Context, knobs: dict, exit_config: Path | None, **own) -> ExitConfig:
    """A command's exit config from its knob flags and --exit-config, by the one rule every command follows
    (`ExitConfig.with_file`): the knobs typed and the file's together, one set in both refused, the command's
    defaults for the rest. `own`: the knobs the command takes under options of its own (--seed)."""
    values = {**knobs, **own}
    if exit_config is None:
        return ExitConfig(**values)
    typed = given_on_command_line(ctx)
    return ExitConfig.with_file(exit_config, {k: v for k, v in values.items() if k in typed},
                                defaults={k: v for k, v in values.items() if k not in typed})


def knobs_from(ctx: typer.Context, knobs: dict, exit_config: Path | None, **own) -> dict:
    """The knobs as a dict, for a command that writes a rule's file rather than running one (fit-exit): those typed,
    then the file's (a knob set in both refused, `ExitConfig.file_knobs`), the command's defaults for the rest."""
    values = {**knobs, **own}
    if exit_config is None:
        return values
    typed = {k: v for k, v in values.items() if k in given_on_command_line(ctx)}
    return {**values, **ExitConfig.file_knobs(exit_config, typed), **typed}


def skip_note(skipped: list[Path]) -> None:
    say(f"note: skipped {len(skipped)} JSON file(s) that are not result cells (e.g. {skipped[0]})")


def writable_targets(*targets: tuple[Path | None, str, str]) -> None:
    """Each given (path, flag, suffix) names a file of that suffix that may be written (never a result cell)."""
    from ..store.disk import writable_output

    for path, flag, suffix in targets:
        if path is None:
            continue
        writable_output(path, flag)
        if path.suffix != suffix:
            raise ExitbenchError(f"{flag} must name a {suffix} file, got {path}")


def main() -> None:
    app()
