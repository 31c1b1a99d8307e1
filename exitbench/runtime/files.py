"""Writing files so that nothing is ever half there: atomic replaces, and output folders checked up front."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import ExitbenchError


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write via a temporary file in the same directory and rename: readers see a whole file or none. The
    folder is made if it is missing (`writable_file` checked that it can be). A write the system refuses (a
    full disk, a folder made read-only meanwhile) is an ExitbenchError naming the file, with nothing left
    behind: not the new file, not its temporary, and an older file at `path` untouched."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ExitbenchError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from the rest of the team
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ExitbenchError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
    return path


def writable_dir(path: Path, flag: str) -> Path:
    """Prove that output can be written at `path` before any compute is spent on it, without leaving a trace:
    an existing folder gets a probe file written and removed; a folder yet to be made is judged by its nearest
    existing ancestor. `flag` names the option in the error (e.g. "--out")."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ExitbenchError(f"{flag} {path} is a file; it must be a directory (or a path that does not exist yet)")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ExitbenchError(f"{flag} {path} cannot be made: {ancestor} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".exitbench-write-test-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ExitbenchError(f"{flag} {path} is not writable: {exc.strerror or exc}") from None
    return path


def writable_file(path: Path, flag: str) -> Path:
    """An output file whose folder can be written (see `writable_dir`); the writer makes the folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ExitbenchError(f"{flag} {path} is a directory; name a file")
    writable_dir(path.parent if str(path.parent) else Path("."), flag + " folder")
    return path

