"""Result cells: one JSON file per (model, task, exit config) point of a sweep.

Schema `exitbench.cell` version 1 (documented in the README):

    schema, schema_version, cell_id, key           what determines the cell (hashed into cell_id)
    model      path, source, architecture, parameters, fingerprint
    task       name, version, n_shot, limit, n_samples, metrics {metric,filter: value}, stderr {...},
               higher_is_better {...}, primary_metric
    quality    metric, value, stderr, higher_is_better             the primary metric
    policy     every ExitConfig knob, resolved max_steps, baseline (true for fixed-depth cells)
    iterations mean, median, p90, max, histogram {k: tokens}, tokens, requests (over each token's iterations
               summed over loop groups), per_group_mean [one mean per loop group]
    wall_clock per_token_s (the scored tokens' own loops: what exits change), total_s and request_s
               (engine time with the full-depth prefill), probe_share (probe / (core + probe)), phases_s
               {prelude, core, probe, coda}, cell_s (this task's share of the lm-eval call)
    flops      per_token, probe_per_token
    run        seed, batch_size, device, dtype, world_size, versions, git_revision, started, host, machine

Cells are written atomically (temporary file + rename), so a killed sweep leaves whole cells or none.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import ExitbenchError

SCHEMA = "exitbench.cell"
SCHEMA_VERSION = 1


def cell_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(paths: list[Path]) -> str:
    """A cheap identity for (possibly huge) files: name, size, and the first and last 64 KiB of each."""
    h = hashlib.sha256()
    for path in sorted(paths):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as fh:
            h.update(fh.read(65536))
            if size > 65536:
                fh.seek(max(size - 65536, 65536))
                h.update(fh.read())
    return h.hexdigest()[:16]


def cell_filename(cell: dict[str, Any]) -> str:
    p = cell["policy"]
    threshold = "" if p["threshold"] is None else f"{p['threshold']:g}"
    rel = "-rel" if p.get("relative") else ""
    return f"{cell['task']['name']}__{p['policy']}{rel}-{threshold}__{cell['cell_id']}.json"


def atomic_write(path: Path, write: Callable[[Any], None]) -> Path:
    """Write via a temporary file in the same directory and rename: readers see a whole file or none."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from the rest of the team
        with os.fdopen(fd, "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_cell(directory: Path, cell: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)

    def write(fh) -> None:
        json.dump(cell, fh, indent=2, sort_keys=True, default=_jsonable)
        fh.write("\n")
    return atomic_write(directory / cell_filename(cell), write)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()  # numpy / torch scalars from lm-eval metrics
    return str(value)


def read_cell(path: Path) -> dict[str, Any]:
    """A cell, or ExitbenchError naming the file when it is not one of ours or of another version."""
    try:
        cell = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExitbenchError(f"{path} is not a readable JSON cell: {exc}") from None
    if not isinstance(cell, dict) or cell.get("schema") != SCHEMA:
        raise ExitbenchError(f"{path} is not an exitbench result cell (schema {SCHEMA!r} expected)")
    if cell.get("schema_version") != SCHEMA_VERSION:
        raise ExitbenchError(f"{path} has cell schema version {cell.get('schema_version')}; this exitbench reads "
                             f"version {SCHEMA_VERSION}")
    return cell


def existing_cells(directory: Path) -> dict[str, Path]:
    """cell_id → file for the finished cells in `directory` (unreadable leftovers are ignored: rerun them)."""
    found = {}
    if not directory.exists():
        return found
    for path in directory.glob("*.json"):
        try:
            found[read_cell(path)["cell_id"]] = path
        except ExitbenchError:
            continue
    return found


def write_samples(path: Path, samples: list[dict[str, Any]]) -> Path:
    """lm-eval's logged samples with exitbench's per-sample exits joined in, as JSON lines (atomic)."""
    def write(fh) -> None:
        for sample in samples:
            fh.write(json.dumps(sample, default=_jsonable) + "\n")
    return atomic_write(path, write)
