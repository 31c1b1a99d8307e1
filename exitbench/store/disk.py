"""A results directory on disk: cells found again on resume, written whole, and claimed before they are computed.

- A cell is written atomically and last: its samples file (when asked for) goes first, so a cell file on disk
  means everything asked of that cell is there, and a kill between the two leaves no cell to skip.
- Before computing a cell a sweep claims it (an flock on a lock file beside it). A second sweep into the same
  directory leaves a claimed cell to its owner and picks it up once written; a dead owner's claim is free.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExitbenchError
from ..runtime.files import atomic_write, writable_file
from . import cells

SAMPLES_SUFFIX = ".samples.jsonl"
LOCK_SUFFIX = ".lock"


def samples_path(cell_path: Path) -> Path:
    return cell_path.with_suffix(SAMPLES_SUFFIX)


@dataclass
class Stored:
    path: Path
    cell: dict[str, Any]

    @property
    def has_samples(self) -> bool:
        return samples_path(self.path).exists()


def existing(directory: Path) -> dict[str, Stored]:
    """cell_id → stored cell for every cell file in `directory` (a broken cell file stops with its name)."""
    if not directory.exists():
        return {}
    found, _ = cells.scan(directory.glob("*.json"))
    return {cell["cell_id"]: Stored(path, cell) for path, cell in found}


def written(directory: Path, cids: list[str]) -> dict[str, Stored]:
    """`existing` for the given cell ids alone, found by the name a sweep writes them under (`cells.filename`
    ends in `__ID.json`): a sweep checks its claimed cells after each claim, and reading the whole directory
    there would cost a scan of every cell per group."""
    if not directory.exists() or not cids:
        return {}
    wanted = set(cids)
    paths = [directory / name for name in os.listdir(directory)
             if name.endswith(".json") and name[:-5].rpartition("__")[2] in wanted]
    found, _ = cells.scan(paths)
    return {cell["cell_id"]: Stored(path, cell) for path, cell in found if cell["cell_id"] in wanted}


def clear_stale_claims(directory: Path) -> None:
    """Sweep away every claim in `directory` that no live process holds (see `Claim.clear_if_stale`)."""
    if not directory.exists():
        return
    for name in os.listdir(directory):
        if name.startswith(".") and name.endswith(LOCK_SUFFIX):
            Claim(directory, name[1:-len(LOCK_SUFFIX)]).clear_if_stale()


def write(directory: Path, cell: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> Path:
    """Write a cell (and first its samples, when given) atomically; the cell file is the last thing written."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / cells.filename(cell)
    if samples is not None:
        def write_samples(fh) -> None:
            for sample in samples:
                fh.write(json.dumps(cells.strict(sample), default=cells.jsonable, allow_nan=False) + "\n")
        atomic_write(samples_path(path), write_samples)

    def write_cell(fh) -> None:
        json.dump(cells.strict(cell), fh, indent=2, sort_keys=True, default=cells.jsonable, allow_nan=False)
        fh.write("\n")
    return atomic_write(path, write_cell)


# ---- claims -------------------------------------------------------------------------------------------------
class Claim:
    """An exclusive claim on one cell id in a results directory: an flock on `.ID.lock` beside the cells.

    The kernel drops the lock when its process dies, kill -9 included, so a killed sweep's successor takes
    the cell over with no staleness guess (flock works across hosts on NFS through Linux's lock emulation).
    """

    def __init__(self, directory: Path, cid: str):
        self.cid = cid
        self.path = directory / f".{cid}{LOCK_SUFFIX}"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Claim the cell; False when another live process holds it."""
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # The holder before us may have unlinked the file after we opened it: then we hold a lock on an
            # orphan inode while a newcomer locks the new file. Only a lock on the file at the path counts.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    self._fd = fd
                    return True
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still holding it, so no one locks the file we remove
        os.close(self._fd)
        self._fd = None

    def clear_if_stale(self) -> None:
        """Remove the lock file when no live process holds it: one left by a sweep killed after writing the
        cell but before letting go of its claim would otherwise stay beside a finished cell for good."""
        if self.path.exists() and self.acquire():
            self.release()

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def writable_output(path: Path, flag: str) -> Path:
    """`writable_file` for everything a command writes besides the cells (reports, traces, exports, plots,
    calibrations, exit models): it must not land on a result cell or a samples file, since replacing one would
    silently drop a measured point from its sweep. Every such writer calls this before any compute. An earlier
    output of the same command may be replaced."""
    path = writable_file(path, flag)
    if path.name.endswith(SAMPLES_SUFFIX):
        raise ExitbenchError(f"{flag} {path} is a result cell's samples file; writing there would replace it; "
                             "name another file")
    try:
        holds_cell = path.is_file() and cells.is_cell(json.loads(path.read_bytes()))
    except (OSError, ValueError):
        holds_cell = False  # absent, unreadable or not JSON: nothing of a sweep's to lose
    if holds_cell:
        raise ExitbenchError(f"{flag} {path} is a result cell of a sweep; writing there would replace it; name "
                             "another file")
    return path
