"""Content identity of files and checkpoints: sha256 over every byte, cached by file metadata.

A result cell may be reused only for the very model and task that made it, so identities hash whole
files, not names, sizes or a few sampled blocks: one NaN in the middle of a shard, or one changed value in
config.json, must give a new identity. Files are named relative to their checkpoint or task folder and
never by their absolute path or mtime, so a copied or moved checkpoint keeps its identity.

Hashing a 15 GB checkpoint takes seconds to tens of seconds, so each file's digest is cached outside the
checkpoint (the checkpoint may be read-only or shared), in `hashes.json` under `$EXITBENCH_CACHE_DIR`, else
`$XDG_CACHE_HOME/exitbench`, else `~/.cache/exitbench`. An entry is trusted only while the file's resolved
path, size, mtime_ns, ctime_ns, inode and device are all unchanged. The cache is an optimisation only: a
missing, unreadable, corrupt or unwritable cache falls back to hashing and never fails a run.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ExitbenchError

CACHE_DIR_ENV = "EXITBENCH_CACHE_DIR"
CACHE_FILE = "hashes.json"
CACHE_SCHEMA = "exitbench.hashes"
CACHE_VERSION = 1
IDENTITY_SCHEME = "exitbench.content/1"

# Tokenizer files hashed where present. exitbench itself reads only tokenizer.json (special token ids come
# from config.json), but the others are how Hugging Face stores the rest of the same tokenizer (added
# tokens, add_bos_token, chat template, SentencePiece or BPE vocabularies), and Huginn-0125 ships
# tokenizer_config.json and special_tokens_map.json. Hashing a file no one reads costs at most a rerun;
# leaving out one that matters would silently reuse stale cells.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
# What a chat template is rendered from besides tokenizer_config.json: transformers prefers chat_template.jinja
# (and named templates in additional_chat_templates/) over the config's entry; processors read the older
# chat_template.json. A prompt rendered from them is part of what a cell computed.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# 1 MiB reads: as fast as hashlib.file_digest's 256 KiB and 4-16 MiB buffers here (bench/hash.py), and
# unlike file_digest it also runs on Python 3.10.
_CHUNK_BYTES = 1 << 20
# A file modified within this long before it is hashed may be modified again within the same timestamp
# tick (ext4 ticks are milliseconds, FAT's two seconds) without its mtime changing; such files are hashed
# but not cached, like git's "racily clean" index entries.
_RACY_WINDOW_NS = 2_000_000_000
# sha256 releases the GIL, so shards hash in parallel; a few threads are enough to saturate a disk.
_MAX_WORKERS = 4


@dataclass(frozen=True)
class ContentIdentity:
    """One digest for a set of named files, and each file's own digest so a report can say what changed."""

    digest: str
    files: dict[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:  # the digest already covers the files; lets identities key dicts and sets
        return hash(self.digest)

    @property
    def short(self) -> str:
        return self.digest[:16]

    def diff(self, other: ContentIdentity) -> dict[str, str]:
        """name → "changed", "added" (only in other) or "removed" (only in self)."""
        names = sorted(set(self.files) | set(other.files))
        out = {}
        for name in names:
            if name not in other.files:
                out[name] = "removed"
            elif name not in self.files:
                out[name] = "added"
            elif self.files[name] != other.files[name]:
                out[name] = "changed"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": IDENTITY_SCHEME, "digest": self.digest, "files": dict(self.files)}


def cache_path() -> Path | None:
    """Where file digests are cached, or None when no home or cache directory can be named."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser() / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore a relative value
        return Path(xdg) / "exitbench" / CACHE_FILE
    try:
        return Path.home() / ".cache" / "exitbench" / CACHE_FILE
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry, e.g. in some containers
        return None


def file_digest(path: str | Path, *, use_cache: bool = True) -> str:
    """sha256 (hex) of every byte of the file at `path`, from the hash cache when the file is unchanged."""
    path = Path(path)
    return _digests([path], use_cache)[path]


def named_content_fingerprint(files: Mapping[str, str | Path], *, use_cache: bool = True) -> ContentIdentity:
    """Identity of files under names the caller chose (e.g. "task/x.yaml", "data/test.jsonl").

    The names, not the paths, enter the digest: the same contents under the same names give the same
    identity wherever the files live. Two names may point to the same file.
    """
    paths = {name: Path(p) for name, p in files.items()}
    digests = _digests(list(paths.values()), use_cache)
    per_file = {name: digests[p] for name, p in paths.items()}
    return ContentIdentity(_combine(per_file), per_file)


def content_fingerprint(paths: Iterable[str | Path], root: str | Path | None = None, *,
                        use_cache: bool = True) -> ContentIdentity:
    """Identity of a set of files, independent of their order and of where `root` lies.

    Each file is named by its path relative to `root` (ExitbenchError if one lies outside it), or, without
    a root, by its file name (ExitbenchError if two share one, since the names would be ambiguous). Files
    from several folders (a task folder and a data directory) can be named with named_content_fingerprint.
    """
    named: dict[str, Path] = {}
    base = Path(os.path.abspath(root)) if root is not None else None
    for p in paths:
        p = Path(p)
        if base is None:
            name = p.name
        else:
            try:
                name = Path(os.path.abspath(p)).relative_to(base).as_posix()
            except ValueError:
                raise ExitbenchError(f"{p} is not under {root}; name files relative to a common root") from None
        if name in named and os.path.abspath(named[name]) != os.path.abspath(p):
            raise ExitbenchError(f"{named[name]} and {p} would both be named {name!r}; pass a root to tell them apart")
        named[name] = p
    return named_content_fingerprint(named, use_cache=use_cache)


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """The files that make up a checkpoint's identity, by name relative to the checkpoint directory.

    Weights are exactly the files the loader reads (the index and every shard it names, or the single
    model.safetensors), plus config.json, the tokenizer files and the chat templates present (every file a
    prompt is rendered from). Other files (README, training/ logs, remote modeling code that exitbench does not
    run) are not part of the model.
    """
    from ..models.checkpoint import CONFIG_FILE, INDEX_FILE, weight_files

    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint must be a directory holding config.json and safetensors, got file {path}")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path} has no {CONFIG_FILE}; a checkpoint directory needs one")
    names = [CONFIG_FILE, *weight_files(path)]
    if (path / INDEX_FILE).exists():
        names.append(INDEX_FILE)
    names += [t for t in (*TOKENIZER_FILES, *CHAT_TEMPLATE_FILES) if (path / t).is_file()]
    names += [f"{CHAT_TEMPLATE_DIR}/{t.name}" for t in (path / CHAT_TEMPLATE_DIR).glob("*.jinja") if t.is_file()]
    return {name: path / name for name in sorted(names)}


def checkpoint_identity(path: str | Path, *, use_cache: bool = True) -> ContentIdentity:
    """Content identity of a checkpoint directory: weights, config.json and tokenizer files (checkpoint_files).

    CheckpointError names a missing directory, config.json, weights or index-named shard.
    """
    return named_content_fingerprint(checkpoint_files(path), use_cache=use_cache)


def _combine(per_file: Mapping[str, str]) -> str:
    # JSON of the sorted (name, digest) pairs: unambiguous whatever characters a name holds.
    payload = json.dumps([IDENTITY_SCHEME, sorted(per_file.items())], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def _hash_file(path: Path, chunk: int = _CHUNK_BYTES) -> str:
    """A file's sha256, read `chunk` bytes at a time into one reused buffer (bench/hash.py times other sizes)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _stat(path: Path) -> tuple[str, os.stat_result]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ExitbenchError(f"file not found: {path}") from None
    except OSError as exc:
        raise ExitbenchError(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ExitbenchError(f"{path} is not a regular file")
    return os.path.realpath(path), st


def _signature(st: os.stat_result) -> dict[str, int]:
    # ctime_ns is beyond what identifies a version for most tools, but it is the one field a user cannot
    # set: an in-place rewrite that restores size and mtime (cp -p onto an existing file) still changes it.
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


_ANNOUNCE_BYTES = 1 << 30


def _digests(paths: list[Path], use_cache: bool) -> dict[Path, str]:
    stats = {p: _stat(p) for p in paths}
    cache = _HashCache.load(cache_path()) if use_cache else None
    out: dict[Path, str] = {}
    todo: dict[str, list[Path]] = {}  # resolved path → the given paths naming it, hashed once
    for p, (real, st) in stats.items():
        hit = cache.get(real, st) if cache else None
        if hit is not None:
            out[p] = hit
        else:
            todo.setdefault(real, []).append(p)
    if todo:
        reals = list(todo)
        size = sum(stats[todo[r][0]][1].st_size for r in reals)
        if size >= _ANNOUNCE_BYTES:  # a multi-GB checkpoint's first hash takes a minute or more: say why it waits
            print(f"hashing {len(reals)} file(s), {size / 1e9:.1f} GB, for the cells' identity (once: the digests are "
                  f"cached in {cache_path() if use_cache else 'no cache'})", file=sys.stderr, flush=True)
        workers = min(len(reals), _MAX_WORKERS, os.cpu_count() or 1)
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                digests = list(pool.map(lambda r: _hash_checked(r, stats[todo[r][0]][1]), reals))
        else:
            digests = [_hash_checked(r, stats[todo[r][0]][1]) for r in reals]
        now = time.time_ns()
        for real, digest in zip(reals, digests):
            for p in todo[real]:
                out[p] = digest
            st = stats[todo[real][0]][1]
            if cache is not None and now - _RACY_WINDOW_NS > st.st_mtime_ns:
                cache.put(real, st, digest)
        if cache is not None:
            cache.save()
    return out


def _hash_checked(real: str, before: os.stat_result) -> str:
    """The file's digest, or ExitbenchError if it changed while being read (e.g. a copy still in progress)."""
    try:
        digest = _hash_file(Path(real))
        after = os.stat(real)
    except OSError as exc:
        raise ExitbenchError(f"cannot read {real}: {exc.strerror}") from None
    if _signature(after) != _signature(before):
        raise ExitbenchError(f"{real} changed while it was being hashed; rerun once nothing is writing it")
    return digest


class _HashCache:
    """hashes.json: {"schema", "version", "entries": {resolved path: {size, mtime_ns, ctime_ns, ino, dev, sha256}}}."""

    def __init__(self, file: Path | None, entries: dict[str, dict[str, Any]]):
        self.file = file
        self.entries = entries
        self.new: dict[str, dict[str, Any]] = {}

    @classmethod
    def load(cls, file: Path | None) -> _HashCache:
        return cls(file, _read_entries(file))

    def get(self, real: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(real)
        if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in _signature(st).items()):
            return None
        digest = entry.get("sha256")
        valid = isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
        return digest if valid else None

    def put(self, real: str, st: os.stat_result, digest: str) -> None:
        self.new[real] = {**_signature(st), "sha256": digest}

    def save(self) -> None:
        """Merge this run's entries into the file as it is now, best effort.

        Re-reading just before the atomic replace keeps what concurrent runs wrote meanwhile, except in the
        instant between two writers' replaces; a lost entry only costs one more hash. Entries whose file is
        gone or changed are dropped, so the cache stays as large as the files still in use.
        """
        if self.file is None or not self.new:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            merged = {real: e for real, e in _read_entries(self.file).items() if _still_current(real, e)}
            merged.update(self.new)
            payload = json.dumps({"schema": CACHE_SCHEMA, "version": CACHE_VERSION, "entries": merged},
                                 indent=1, sort_keys=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_FILE}-", suffix=".tmp", dir=self.file.parent)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(payload)
                os.replace(tmp, self.file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            return  # a read-only or full cache directory: the digests are still right, only not remembered
        self.entries.update(self.new)
        self.new = {}


def _read_entries(file: Path | None) -> dict[str, dict[str, Any]]:
    if file is None:
        return {}
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError):  # missing, unreadable, truncated or not JSON: start afresh
        return {}
    if (not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA or data.get("version") != CACHE_VERSION
            or not isinstance(data.get("entries"), dict)):
        return {}
    return data["entries"]


def _still_current(real: str, entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    try:
        st = os.stat(real)
    except OSError:
        return False
    return all(entry.get(k) == v for k, v in _signature(st).items())
