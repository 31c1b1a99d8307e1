"""What does hashing a checkpoint's every byte cost, first time and on a cached rerun?

    python bench/hash.py [--size-gib 4] [--shards 1] [--repeats 3] [--dir /tmp]

Writes `--size-gib` GiB of random-ish bytes (split into `--shards` files) under `--dir`, then measures:
1. raw read and sha256 throughput with the file in the page cache (it is, right after writing, given the RAM)
   and after evicting it with posix_fadvise(DONTNEED), the cold read a first sweep on a fresh machine pays.
   Eviction is per file and needs no privilege; /proc/sys/vm/drop_caches would drop every user's cache
   and needs root, so it is not used. On a virtual machine the host may still cache the file;
2. read strategies, interleaved over repeats: exitbench.store.identity's chunked readinto (1 MiB) against
   hashlib.file_digest (3.11+) and other buffer sizes;
3. first use through exitbench.store.identity (hash + cache write), then the cached rerun (stat + cache read);
4. with several shards, the identity's thread pool against one file at a time.
Finally it estimates the first-use time for Huginn-0125's released checkpoint (15.6 GB of fp32 shards).
The files are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exitbench.store import identity  # noqa: E402

GIB = 1 << 30
HUGINN_GB = 15.6  # 4 safetensors shards as released (fp32), plus a few kB of config and tokenizer
HUGINN_SHARDS = 4
BLOCK = 64 << 20


def write_files(directory: Path, size: int, shards: int) -> list[Path]:
    # One random block, each copy stamped with its offset: no two blocks alike, no cost of os.urandom per byte.
    block = bytearray(os.urandom(BLOCK))
    files, offset = [], 0
    for i in range(shards):
        f = directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        end = size * (i + 1) // shards
        with f.open("wb") as fh:
            while offset < end:
                block[:8] = offset.to_bytes(8, "little")
                n = min(BLOCK, end - offset)
                fh.write(memoryview(block)[:n])
                offset += n
            fh.flush()
            os.fsync(fh.fileno())  # clean pages, so that DONTNEED can evict them
        files.append(f)
    # A file written in the last two seconds is hashed but not cached (identity._RACY_WINDOW_NS); real
    # checkpoints are older than that.
    old = time.time_ns() - 3600 * 10**9
    for f in files:
        os.utime(f, ns=(old, old))
    return files


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_only(f: Path) -> None:
    buf = bytearray(1 << 20)
    with open(f, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def chunked(size: int):
    """exitbench's own file hash (store/identity.py) at a buffer of `size` bytes."""
    return functools.partial(identity._hash_file, chunk=size)


def file_digest(f: Path) -> str:
    with open(f, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def timed(fn, files: list) -> float:
    t0 = time.perf_counter()
    for f in files:
        fn(f)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--keep", action="store_true", help="Leave the written files in place.")
    args = ap.parse_args()
    size = int(args.size_gib * GIB)
    gb = size / 1e9

    work = Path(tempfile.mkdtemp(prefix="exitbench-hash-", dir=args.dir))
    os.environ[identity.CACHE_DIR_ENV] = str(work / "cache")  # a fresh cache, not the user's
    try:
        t0 = time.perf_counter()
        files = write_files(work, size, args.shards)
        print(f"wrote {args.size_gib:g} GiB in {args.shards} file(s) under {work}: "
              f"{gb / (time.perf_counter() - t0):.2f} GB/s (including fsync)")
        zeros = bytes(GIB)
        print(f"sha256 of 1 GiB in memory: {GIB / 1e9 / timed(lambda _: hashlib.sha256(zeros), [None]):.2f} GB/s")
        del zeros

        warm_read = timed(read_only, files)
        warm_hash = timed(chunked(1 << 20), files)
        evict(files)
        cold_read = timed(read_only, files)
        evict(files)
        cold_hash = timed(chunked(1 << 20), files)
        print(f"page cache warm: read {gb / warm_read:.2f} GB/s, read+sha256 {gb / warm_hash:.2f} GB/s")
        print(f"evicted (cold):  read {gb / cold_read:.2f} GB/s, read+sha256 {gb / cold_hash:.2f} GB/s")

        strategies = {"readinto 1 MiB (identity)": chunked(1 << 20), "readinto 256 KiB": chunked(1 << 18),
                      "readinto 8 MiB": chunked(8 << 20)}
        if hasattr(hashlib, "file_digest"):
            strategies["hashlib.file_digest"] = file_digest
        times: dict[str, list[float]] = {k: [] for k in strategies}
        names = list(strategies)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate, so drift hits all alike
                times[name].append(timed(strategies[name], files))
        print(f"read strategies, page cache warm, median of {args.repeats} (min-max):")
        for name, ts in times.items():
            print(f"  {name:28s} {gb / statistics.median(ts):.2f} GB/s ({gb / max(ts):.2f}-{gb / min(ts):.2f})")

        t0 = time.perf_counter()
        digests = [identity.file_digest(f) for f in files]
        first = time.perf_counter() - t0
        reruns = []
        for _ in range(max(args.repeats, 5)):
            t0 = time.perf_counter()
            again = [identity.file_digest(f) for f in files]
            reruns.append(time.perf_counter() - t0)
        assert again == digests
        named = {f.name: f for f in files}
        t0 = time.perf_counter()
        identity.named_content_fingerprint(named)
        cached_identity = time.perf_counter() - t0
        print(f"identity.file_digest first use: {first:.2f} s ({gb / first:.2f} GB/s); cached rerun: "
              f"median {statistics.median(reruns) * 1e3:.2f} ms for {len(files)} file(s); "
              f"named_content_fingerprint from cache {cached_identity * 1e3:.2f} ms")

        pool = min(identity._MAX_WORKERS, os.cpu_count() or 1)
        if len(files) > 1:
            seq, par = [], []
            for _ in range(args.repeats):
                identity._MAX_WORKERS = 1
                seq.append(timed(lambda _: identity.named_content_fingerprint(named, use_cache=False), [None]))
                identity._MAX_WORKERS = pool
                par.append(timed(lambda _: identity.named_content_fingerprint(named, use_cache=False), [None]))
            print(f"{len(files)} shards, page cache warm: one at a time {gb / statistics.median(seq):.2f} GB/s, "
                  f"thread pool (≤{min(pool, len(files))} threads) {gb / statistics.median(par):.2f} GB/s")

        hot = gb / statistics.median(times["readinto 1 MiB (identity)"])
        threads = min(pool, HUGINN_SHARDS)
        pooled = max(HUGINN_GB / (hot * threads), HUGINN_GB / (gb / cold_read))
        print(f"Huginn-0125 ({HUGINN_GB} GB, {HUGINN_SHARDS} shards) first use: one thread "
              f"~{HUGINN_GB / hot:.0f} s from page cache, ~{HUGINN_GB / (gb / cold_hash):.0f} s cold; "
              f"{threads} threads here ≥{pooled:.0f} s (cold reads {gb / cold_read:.2f} GB/s); cached rerun: under 1 ms")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            for f in sorted(work.rglob("*"), reverse=True):
                f.rmdir() if f.is_dir() else f.unlink()
            work.rmdir()


if __name__ == "__main__":
    main()
