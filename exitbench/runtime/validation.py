"""Typed schemas for the files exitbench reads, checked where they come in.

Every file a user or an earlier run hands exitbench (result cells, samples files, config.json, exit-config
YAML, exit models, task YAMLs) is parsed through a pydantic model before anything reads a field of it, so a
value of the wrong type ends the command with one line that names the file, the field and what was found,
instead of a traceback three modules later or, worse, a wrong number (`relative: "no"` read as true).

pydantic because it is the validation library the Python ecosystem keeps best (a compiled core, so validating
201 cells costs milliseconds), its strict types refuse the coercions that hide mistakes ("no" → True, 3 → True,
"1" → 1), and its errors carry the location of the bad value, which is what a one-line message needs.
"""
from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ExitbenchError

M = TypeVar("M", bound=BaseModel)

_SHOWN_CHARS = 60  # a bad value is quoted, but a whole list or document would drown the line


def parse(model: type[M], data: Any, what: str, error: type[ExitbenchError] = ExitbenchError) -> M:
    """`data` validated as `model`, or `error` naming `what` (e.g. "cell results/x.json"), the first bad
    field and the value found there."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{what}: {describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    """The first error of a validation as one line: where, what was expected, what was found."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    message = first["msg"]
    if first["type"] == "missing":
        return f"{where} is missing"
    found = first.get("input")
    shown = repr(found)
    if len(shown) > _SHOWN_CHARS:
        shown = shown[:_SHOWN_CHARS] + "…"
    return f"{where}: {message[0].lower() + message[1:]}, got {shown}"


def one_line(exc: BaseException) -> str:
    """An error as one line: YAML errors as what went wrong and where, others with their lines joined."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError):
        def at(what: str | None, mark: Any) -> str | None:
            return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if what and mark else what

        return ", ".join(p for p in (at(exc.problem, exc.problem_mark), at(exc.context, exc.context_mark)) if p)
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def at_least(what: str, value: int, low: int = 1) -> int:
    """`value` when it is ≥ `low`, else the one-line error every command gives for it (a batch size, a count)."""
    if value < low:
        raise ExitbenchError(f"{what} must be ≥ {low}, got {value}")
    return value
