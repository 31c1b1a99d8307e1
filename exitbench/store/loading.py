"""The result cells a reader works on: every cell under some directories, of one model, an exact cell in place
of its replay twin. What pareto, report, check and compare read; export reads every cell as it is."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..errors import ExitbenchError
from . import cells


def load(directories: list[Path], on_skip: Callable[[list[Path]], None] | None = None, model: str | None = None,
         strict: bool = False) -> list[dict[str, Any]]:
    """Every cell under the directories (recursively), an exact cell in place of its replay twin, all of one
    model (`select_model`). JSON files that are not cells (calibration and geometry reports) are skipped and
    passed to `on_skip`; a file that claims to be a cell but is broken stops the load, and with `strict` (the
    gate) so does a file that is not readable JSON (`cells.scan`)."""
    return [cell for _, cell in load_paths(directories, on_skip, model, strict)]


def load_paths(directories: list[Path], on_skip: Callable[[list[Path]], None] | None = None,
               model: str | None = None, strict: bool = False) -> list[tuple[Path, dict[str, Any]]]:
    """`load`, with each cell's file (what finds the samples file beside it)."""
    found, skipped = [], []
    for d in directories:
        d = Path(d)
        if not d.is_dir():
            raise ExitbenchError(f"{d} is not a directory of result cells")
        cells_here, skipped_here = cells.scan(d.rglob("*.json"), strict)
        found += cells_here
        skipped += skipped_here
    where = ", ".join(map(str, directories))
    if not found:
        extra = f" ({len(skipped)} JSON file(s) there are not cells, e.g. {skipped[0]})" if skipped else ""
        raise ExitbenchError(f"no result cells under {where}{extra}")
    if skipped and on_skip is not None:
        on_skip(skipped)
    found = select_model(found, model, where)
    kept = {id(c) for c in prefer_exact([c for _, c in found])}
    return [(path, c) for path, c in found if id(c) in kept]


def prefer_exact(cell_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop each replay cell whose exact twin (the same key but for the mode, e.g. from `--verify`) is there."""
    twin = lambda c: cells.cell_id({k: v for k, v in c["key"].items() if k != "mode"})  # noqa: E731
    exact = {twin(c) for c in cell_list if cells.mode(c) == "exact"}
    return [c for c in cell_list if cells.mode(c) == "exact" or twin(c) not in exact]


def model_label(cell: dict[str, Any]) -> str:
    """How tables and errors name a cell's model: where it came from, and its content fingerprint (what tells
    two models apart: a path may hold another model tomorrow)."""
    m = cell["model"]
    return f"{m.get('source') or m.get('path') or m['architecture']} ({m['fingerprint']})"


def select_model(found: list[tuple[Path, dict[str, Any]]], model: str | None, where: str
                 ) -> list[tuple[Path, dict[str, Any]]]:
    """The cells of one model. Cells of different models never share a frontier, a matched-quality row or a
    check (the same labels would stand for different numbers), so a directory that mixes models needs `model`:
    a fingerprint prefix, a path or source label, or an embedded checkpoint's name."""
    by_model: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path, c in found:
        by_model.setdefault(c["model"]["fingerprint"], []).append((path, c))
    if model is None:
        if len(by_model) == 1:
            return found
        names = "; ".join(f"{model_label(v[0][1])}: {len(v)} cells" for v in by_model.values())
        raise ExitbenchError(f"{where} holds cells of {len(by_model)} models ({names}); pass --model NAME "
                             "(a fingerprint, path or name of one of them) to use one, or keep them in separate "
                             "directories")
    picked = [fp for fp, v in by_model.items() if _names_model(model, fp, v[0][1]["model"])]
    if len(picked) != 1:
        what = "no" if not picked else f"{len(picked)}"
        known = "; ".join(model_label(v[0][1]) for v in by_model.values())
        raise ExitbenchError(f"--model {model!r} names {what} model of the cells under {where}; they hold: {known}")
    return by_model[picked[0]]


def _names_model(name: str, fingerprint: str, model: dict[str, Any]) -> bool:
    source, path = model.get("source") or "", model.get("path") or ""
    return (len(name) >= 4 and fingerprint.startswith(name)) or name in (source, path, Path(path).name) \
        or source == f"embedded:{name}"
