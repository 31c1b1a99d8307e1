"""Content identity: every byte of weights, config and tokenizer counts; paths and mtimes do not; the cache
is used, invalidated and never fatal. And what it buys a result cell: a cell is reused only for the very same model
(a changed weight, config value or tokenizer computes new cells), and one computation has one cell id (a limit that
takes every document keys the cell of no limit)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitbench.cli import app
from exitbench.store import cells, identity
from exitbench.models.embedded import EMBEDDED_DIR
from exitbench.errors import CheckpointError, ExitbenchError
from exitbench.store.identity import (
    checkpoint_files,
    checkpoint_identity,
    content_fingerprint,
    file_digest,
    named_content_fingerprint,
)
from exitbench.models import save_checkpoint
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.schedule import plan

from helpers.cells import load_cells
from helpers.cli import explain, invoke, runner
from helpers.files import model_copy
from helpers.paths import A_CELL, REPO
from helpers.sweeps import SMALL

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
HOUR_NS = 3600 * 10**9


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test caches into its own directory, never into the developer's ~/.cache."""
    directory = tmp_path / "hash-cache"
    monkeypatch.setenv(identity.CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def hash_calls(monkeypatch) -> list[str]:
    """The files actually read and hashed (cache misses), in order."""
    calls: list[str] = []
    real = identity._hash_file

    def counting(path):
        calls.append(Path(path).name)
        return real(path)
    monkeypatch.setattr(identity, "_hash_file", counting)
    return calls


def settle(*paths: Path, age_ns: int = HOUR_NS) -> None:
    """Give files an mtime in the past: files written within the last seconds are deliberately not cached."""
    old = time.time_ns() - age_ns
    for p in paths:
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            os.utime(f, ns=(old, old))


def patch_byte(path: Path, offset: int, value: bytes) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(value)


def test_one_nan_in_the_middle_of_a_shard_changes_the_identity(tiny_checkpoint):
    before = checkpoint_identity(tiny_checkpoint)
    shard = tiny_checkpoint / SHARDS[1]
    middle = shard.stat().st_size // 2
    patch_byte(shard, middle, b"\x00\x00\xc0\x7f")  # a float32 NaN, beyond the first and last 64 KiB
    after = checkpoint_identity(tiny_checkpoint)
    assert after.digest != before.digest
    assert before.diff(after) == {SHARDS[1]: "changed"}


def test_every_byte_counts(tmp_path):
    data = bytes(range(256)) * 1024
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    assert file_digest(f, use_cache=False) == hashlib.sha256(data).hexdigest()
    for offset in (0, len(data) // 3, len(data) - 1):
        changed = bytearray(data)
        changed[offset] ^= 1
        f.write_bytes(bytes(changed))
        assert file_digest(f, use_cache=False) == hashlib.sha256(changed).hexdigest()


def embedded_copy(tmp_path: Path, name: str) -> Path:
    """The embedded tiny-raven's model files (not its training/ history) in a directory of our own."""
    dest = tmp_path / name
    dest.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(EMBEDDED_DIR / "tiny-raven" / f, dest / f)
    return dest


def test_a_changed_config_value_changes_the_identity(tmp_path):
    same, changed = embedded_copy(tmp_path, "a"), embedded_copy(tmp_path, "b")
    config = json.loads((changed / "config.json").read_text())
    config["mean_recurrence"] += 1
    (changed / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    a, b = checkpoint_identity(same), checkpoint_identity(changed)
    assert a.digest != b.digest
    assert a.diff(b) == {"config.json": "changed"}


def test_the_tokenizer_is_part_of_the_identity(tiny_checkpoint):
    before = checkpoint_identity(tiny_checkpoint)
    tok = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (tiny_checkpoint / "tokenizer.json").write_text(json.dumps(tok))
    swapped = checkpoint_identity(tiny_checkpoint)
    assert before.diff(swapped) == {"tokenizer.json": "changed"}

    (tiny_checkpoint / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    with_config = checkpoint_identity(tiny_checkpoint)
    assert swapped.diff(with_config) == {"tokenizer_config.json": "added"}


def test_every_file_a_chat_template_is_read_from_is_part_of_the_identity(tiny_checkpoint):
    """transformers prefers chat_template.jinja (and additional_chat_templates/NAME.jinja) over the template in
    tokenizer_config.json: editing one renders other prompts, so it is another model for a cell."""
    before = checkpoint_identity(tiny_checkpoint)
    for name in ("chat_template.jinja", "chat_template.json", "additional_chat_templates/tool_use.jinja"):
        (tiny_checkpoint / name).parent.mkdir(exist_ok=True)
        (tiny_checkpoint / name).write_text("{{ messages[0]['content'] }}")
        added = checkpoint_identity(tiny_checkpoint)
        assert before.diff(added) == {name: "added"}, name
        (tiny_checkpoint / name).write_text("{{ messages[-1]['content'] }}")
        assert added.diff(checkpoint_identity(tiny_checkpoint)) == {name: "changed"}, name
        before = checkpoint_identity(tiny_checkpoint)
    (tiny_checkpoint / "additional_chat_templates" / "notes.txt").write_text("not a template")
    assert checkpoint_identity(tiny_checkpoint).digest == before.digest  # only what the renderer reads


def test_a_copied_checkpoint_keeps_its_identity(tiny_checkpoint, tmp_path):
    settle(tiny_checkpoint)
    original = checkpoint_identity(tiny_checkpoint)
    copy = shutil.copytree(tiny_checkpoint, tmp_path / "elsewhere" / "renamed-model")
    settle(copy, age_ns=5 * HOUR_NS)  # different mtimes and inodes, same bytes
    (copy / "README.md").write_text("notes are not part of the model\n")
    assert checkpoint_identity(copy) == original
    assert len({original, checkpoint_identity(copy)}) == 1


def test_sharded_identity_covers_index_and_every_shard(tiny_checkpoint):
    files = checkpoint_files(tiny_checkpoint)
    assert sorted(files) == sorted(["config.json", "model.safetensors.index.json", "tokenizer.json", *SHARDS])
    before = checkpoint_identity(tiny_checkpoint)
    index = tiny_checkpoint / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"]["total_size"] += 1
    index.write_text(json.dumps(data, indent=2) + "\n")
    assert before.diff(checkpoint_identity(tiny_checkpoint)) == {"model.safetensors.index.json": "changed"}


def test_a_stray_single_file_beside_an_index_is_not_what_the_loader_reads(tiny_checkpoint):
    before = checkpoint_identity(tiny_checkpoint)
    (tiny_checkpoint / "model.safetensors").write_bytes(b"leftover")
    assert checkpoint_identity(tiny_checkpoint) == before


def test_single_file_checkpoint(tmp_path, tiny_raven, tiny_tokenizer):
    path = save_checkpoint(tiny_raven, tmp_path / "single", tokenizer=tiny_tokenizer)
    ident = checkpoint_identity(path)
    assert sorted(ident.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert ident.files["model.safetensors"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_bad_checkpoints_raise_checkpoint_error_naming_the_problem(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not found: .*nowhere"):
        checkpoint_identity(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="must be a directory"):
        checkpoint_identity(tiny_checkpoint / "config.json")
    (tiny_checkpoint / SHARDS[2]).unlink()
    with pytest.raises(CheckpointError, match=f"shard {SHARDS[2]} named in model.safetensors.index.json is missing"):
        checkpoint_identity(tiny_checkpoint)
    (tiny_checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        checkpoint_identity(tiny_checkpoint)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        checkpoint_identity(empty)


def test_the_cache_spares_the_second_hash(tiny_checkpoint, hash_calls, cache_dir):
    settle(tiny_checkpoint)
    first = checkpoint_identity(tiny_checkpoint)
    assert sorted(hash_calls) == sorted(first.files)
    assert (cache_dir / identity.CACHE_FILE).exists()
    hash_calls.clear()
    assert checkpoint_identity(tiny_checkpoint) == first
    assert hash_calls == []
    assert checkpoint_identity(tiny_checkpoint, use_cache=False) == first
    assert len(hash_calls) == len(first.files)


def test_touch_size_and_in_place_rewrites_invalidate_the_cache(tiny_checkpoint, hash_calls):
    settle(tiny_checkpoint)
    checkpoint_identity(tiny_checkpoint)
    shard = tiny_checkpoint / SHARDS[0]

    hash_calls.clear()
    settle(shard, age_ns=2 * HOUR_NS)  # touch: same bytes, new mtime
    checkpoint_identity(tiny_checkpoint)
    assert hash_calls == [SHARDS[0]]

    hash_calls.clear()
    st = shard.stat()
    with shard.open("ab") as fh:
        fh.write(b"\0")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size alone gives it away
    checkpoint_identity(tiny_checkpoint)
    assert hash_calls == [SHARDS[0]]

    # Same size, same mtime, same inode: only ctime shows the rewrite. Retry until the clock has ticked,
    # since ctime is as coarse as the kernel's timestamp tick.
    before = checkpoint_identity(tiny_checkpoint)
    hash_calls.clear()
    st = shard.stat()
    while True:
        patch_byte(shard, st.st_size // 2, b"\xff")
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        if shard.stat().st_ctime_ns != st.st_ctime_ns:
            break
        time.sleep(0.005)
    after = checkpoint_identity(tiny_checkpoint)
    assert hash_calls == [SHARDS[0]]
    assert before.diff(after) == {SHARDS[0]: "changed"}


def test_a_file_written_just_now_is_not_cached(tmp_path, hash_calls):
    # Were it cached, a rewrite within the same timestamp tick (same size) would read as unchanged.
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"a" * 1000)
    file_digest(f)
    file_digest(f)
    assert hash_calls == ["fresh.bin", "fresh.bin"]
    settle(f)
    file_digest(f)
    file_digest(f)
    assert hash_calls == ["fresh.bin"] * 3


@pytest.mark.parametrize("garbage", [b"\x00\xff not json", b'{"schema": "exitbench.hashes", "vers', b"[1, 2]",
                                     b'{"schema": "exitbench.hashes", "version": 1, "entries": {"/x": 3}}'])
def test_a_corrupt_cache_is_ignored_and_rebuilt(tiny_checkpoint, cache_dir, hash_calls, garbage):
    settle(tiny_checkpoint)
    cache_dir.mkdir()
    (cache_dir / identity.CACHE_FILE).write_bytes(garbage)
    ident = checkpoint_identity(tiny_checkpoint)
    assert ident == checkpoint_identity(tiny_checkpoint, use_cache=False)
    json.loads((cache_dir / identity.CACHE_FILE).read_text())
    hash_calls.clear()
    checkpoint_identity(tiny_checkpoint)
    assert hash_calls == []


def test_a_forged_cache_entry_with_a_bad_digest_is_not_trusted(tmp_path, cache_dir):
    f = tmp_path / "data.bin"
    f.write_bytes(b"payload")
    settle(f)
    file_digest(f)
    file = cache_dir / identity.CACHE_FILE
    data = json.loads(file.read_text())
    (entry,) = data["entries"].values()
    entry["sha256"] = "not a digest"
    file.write_text(json.dumps(data))
    assert file_digest(f) == hashlib.sha256(b"payload").hexdigest()


def test_an_unusable_cache_directory_never_fails_a_run(tiny_checkpoint, tmp_path, monkeypatch, hash_calls):
    settle(tiny_checkpoint)
    expected = checkpoint_identity(tiny_checkpoint, use_cache=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # A cache directory under a regular file can be neither created nor written, even by root.
    monkeypatch.setenv(identity.CACHE_DIR_ENV, str(blocker / "cache"))
    hash_calls.clear()
    assert checkpoint_identity(tiny_checkpoint) == expected
    assert checkpoint_identity(tiny_checkpoint) == expected
    assert len(hash_calls) == 2 * len(expected.files)

    # A directory that exists but refuses the write (read-only mount): no temporary file is left behind.
    readonly = tmp_path / "readonly"
    monkeypatch.setenv(identity.CACHE_DIR_ENV, str(readonly))

    def refuse(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")
    monkeypatch.setattr(identity.os, "replace", refuse)
    assert checkpoint_identity(tiny_checkpoint) == expected
    assert list(readonly.iterdir()) == []


def test_concurrent_writers_keep_the_cache_whole_and_each_others_entries(tmp_path, cache_dir):
    files = []
    for i in range(6):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(os.urandom(4096))
        files.append(f)
    settle(*files)
    # A run that loaded the cache before another run saved keeps that run's entries when it saves.
    early = identity._HashCache.load(identity.cache_path())
    file_digest(files[0])
    st = files[1].stat()
    early.put(os.path.realpath(files[1]), st, file_digest(files[1], use_cache=False))
    early.save()
    saved = json.loads((cache_dir / identity.CACHE_FILE).read_text())["entries"]
    assert {os.path.realpath(f) for f in files[:2]} <= set(saved)

    errors = []

    def worker(f):
        try:
            for _ in range(5):
                assert file_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(f,)) for f in files[2:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    json.loads((cache_dir / identity.CACHE_FILE).read_text())
    assert not [p for p in cache_dir.iterdir() if p.name != identity.CACHE_FILE]


def test_stale_entries_are_dropped_when_the_cache_is_saved(tmp_path, cache_dir):
    gone, kept, new = (tmp_path / n for n in ("gone.bin", "kept.bin", "new.bin"))
    for f in (gone, kept, new):
        f.write_bytes(f.name.encode())
    settle(gone, kept, new)
    file_digest(gone)
    file_digest(kept)
    gone.unlink()
    file_digest(new)
    entries = json.loads((cache_dir / identity.CACHE_FILE).read_text())["entries"]
    assert set(entries) == {os.path.realpath(kept), os.path.realpath(new)}


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(identity.CACHE_DIR_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert identity.cache_path() == tmp_path / "mine" / "hashes.json"
    monkeypatch.delenv(identity.CACHE_DIR_ENV)
    assert identity.cache_path() == tmp_path / "xdg" / "exitbench" / "hashes.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert identity.cache_path() == tmp_path / "home" / ".cache" / "exitbench" / "hashes.json"


def test_content_fingerprint_is_order_free_and_moves_with_its_root(tmp_path):
    task = tmp_path / "tasks" / "chains"
    (task / "data").mkdir(parents=True)
    (task / "chains.yaml").write_text("task: chains\n")
    (task / "data" / "test.jsonl").write_text('{"q": 1}\n')
    files = [task / "chains.yaml", task / "data" / "test.jsonl"]
    ident = content_fingerprint(files, root=task)
    assert sorted(ident.files) == ["chains.yaml", "data/test.jsonl"]
    assert content_fingerprint(reversed(files), root=task) == ident

    moved = shutil.move(str(task), str(tmp_path / "elsewhere"))
    assert content_fingerprint([Path(moved) / "chains.yaml", Path(moved) / "data" / "test.jsonl"], root=moved) == ident
    assert named_content_fingerprint({"chains.yaml": Path(moved) / "chains.yaml",
                                      "data/test.jsonl": Path(moved) / "data" / "test.jsonl"}) == ident

    (Path(moved) / "data" / "test.jsonl").write_text('{"q": 2}\n')
    changed = content_fingerprint([Path(moved) / "chains.yaml", Path(moved) / "data" / "test.jsonl"], root=moved)
    assert ident.diff(changed) == {"data/test.jsonl": "changed"}


def test_content_fingerprint_names_must_be_unambiguous(tmp_path):
    a, b = tmp_path / "a" / "test.jsonl", tmp_path / "b" / "test.jsonl"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text(f.parent.name)
    with pytest.raises(ExitbenchError, match="would both be named 'test.jsonl'"):
        content_fingerprint([a, b])
    assert sorted(content_fingerprint([a, b], root=tmp_path).files) == ["a/test.jsonl", "b/test.jsonl"]
    with pytest.raises(ExitbenchError, match="is not under"):
        content_fingerprint([a], root=tmp_path / "b")
    with pytest.raises(ExitbenchError, match="file not found: .*missing.yaml"):
        content_fingerprint([tmp_path / "missing.yaml"])
    with pytest.raises(ExitbenchError, match="not a regular file"):
        file_digest(tmp_path / "a")


def test_a_file_that_changes_while_hashed_is_an_error_not_an_identity(tmp_path, monkeypatch):
    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"x" * 100)
    real = identity._hash_file

    def still_being_copied(path):
        digest = real(path)
        with open(path, "ab") as fh:
            fh.write(b"more")
        return digest
    monkeypatch.setattr(identity, "_hash_file", still_being_copied)
    with pytest.raises(ExitbenchError, match="shard.safetensors changed while it was being hashed"):
        file_digest(f)


def test_a_large_first_hash_says_what_it_is_doing(tiny_checkpoint, hash_calls, cache_dir, monkeypatch, capsys):
    """A multi-GB checkpoint's first hash is a silent minute otherwise; a cached one stays silent."""
    settle(tiny_checkpoint)
    monkeypatch.setattr(identity, "_ANNOUNCE_BYTES", 1)
    checkpoint_identity(tiny_checkpoint)
    assert "hashing" in capsys.readouterr().err
    checkpoint_identity(tiny_checkpoint)
    assert "hashing" not in capsys.readouterr().err


# ---- a cell is reused only for the very same model -------------------------------------------------------------

def _computed_ids(out: Path) -> set[str]:
    return {c["cell_id"] for c in load_cells(out).values()}


def _edit_middle_byte(shard: Path) -> None:
    """Flip one bit in the middle of the largest tensor's data (far from the file's first and last 64 KiB)."""
    tensors = load_file(str(shard))
    key = max(tensors, key=lambda k: tensors[k].numel())
    flat = tensors[key].view(-1)
    middle = flat.numel() // 2
    flat[middle] = torch.nextafter(flat[middle], torch.tensor(float("inf")))
    save_file(tensors, str(shard), metadata={"format": "pt"})


EDITS = {
    "a weight in the middle of a shard": lambda ck: _edit_middle_byte(ck / "model.safetensors"),
    "a config value": lambda ck: (ck / "config.json").write_text(
        json.dumps({**json.loads((ck / "config.json").read_text()), "mean_recurrence": 8, "max_recurrence": 16})),
    "the tokenizer": lambda ck: (ck / "tokenizer.json").write_text(
        (ck / "tokenizer.json").read_text().replace('"<unk>"', '"<UNK>"')),
}


# Each case is three sweeps (4 s). A changed weight stays fast; that config and tokenizer bytes count is also
# checked fast, on the identity itself, above.
@pytest.mark.parametrize("edit", [e if "weight" in e else pytest.param(e, marks=pytest.mark.slow) for e in EDITS])
def test_a_changed_checkpoint_recomputes_its_cells(edit, raven_copy, tmp_path, capfd):
    out = tmp_path / "out"
    args = ["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out)]
    assert invoke(args, capfd)[0] == 0
    first = _computed_ids(out)
    code, lines, stdout = invoke(args, capfd)
    assert code == 0 and any("reusing 2 cell(s)" in line for line in lines), lines
    # The summary marks each row this run did not measure.
    assert sum("reused" in line for line in stdout.splitlines() if "│" in line) == 2, stdout
    assert _computed_ids(out) == first  # unchanged checkpoint: resumed, nothing new
    EDITS[edit](raven_copy)
    assert invoke(args, capfd)[0] == 0
    after = _computed_ids(out)
    assert len(after) == 4 and first < after, f"editing {edit} did not give new cells"


# ---- one computation, one cell id ------------------------------------------------------------------------------

def _cell_ids(ck, tasks, limit, out: Path) -> list[str]:
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["fixed"], baselines=[1], limit=limit)
    return [cells.cell_id(key) for _, _, key in plan(ck, tasks, cfg, out, "cpu").cells]


def test_a_limit_that_takes_every_document_keys_the_cell_of_no_limit(tmp_path, replay_sweep):
    ck, tasks, _ = replay_sweep
    n_docs = len((REPO / "tasks" / "chains" / "test.jsonl").read_text().splitlines())
    assert n_docs == 600
    whole = _cell_ids(ck, tasks, None, tmp_path)
    assert len(whole) == 1
    for limit in (600, 601, 10**12, 0.9999):  # 0.9999 of 600 documents rounds up to all 600, as lm-eval counts
        assert _cell_ids(ck, tasks, limit, tmp_path) == whole, limit
    parts = {limit: _cell_ids(ck, tasks, limit, tmp_path) for limit in (599, 48, 0.5)}
    assert all(ids != whole for ids in parts.values())
    assert len({tuple(ids) for ids in parts.values()}) == 3
    # a limit that leaves documents out is keyed as given (the committed baselines use --limit 48)
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["fixed"], baselines=[16], limit=48)
    (_, _, key), = plan(ck, tasks, cfg, tmp_path, "cpu").cells
    committed = cells.read(A_CELL)
    assert key["limit"] == committed["key"]["limit"] == 48
    assert {k: v for k, v in key.items() if k != "versions"} == \
        {k: v for k, v in committed["key"].items() if k != "versions"}


@pytest.mark.slow  # all 600 documents, 3-4 s for what the plan-level test above checks in 0.4 s
def test_limit_600_and_no_limit_are_one_cell_on_disk(tmp_path):
    out = tmp_path / "o"
    args = ["run", "--tasks", "chains_lambada", "--policy", "fixed", "--baselines", "1", "--quiet", "--out", str(out)]
    res = runner.invoke(app, [*args, "--limit", "600"])
    assert res.exit_code == 0, explain(res)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, explain(res)
    assert "reusing 1 cell" in res.stderr
    assert len(list(out.glob("*.json"))) == 1


# ---- what a result says it was made with: the same on every machine ------------------------------------------------

def test_a_result_names_an_embedded_model_by_name_and_any_other_by_its_path(tmp_path):
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.models.embedded import recorded_path
    from exitbench.sweep.keys import model_record

    record = model_record(open_checkpoint("tiny-raven"))
    assert (record["path"], record["source"]) == ("tiny-raven", "embedded:tiny-raven")
    assert recorded_path(EMBEDDED_DIR / "tiny-ouro" / "stage-1") == "tiny-ouro/stage-1"
    copy = model_copy(EMBEDDED_DIR / "tiny-raven", tmp_path / "mine")
    assert recorded_path(copy) == str(copy)


def test_the_shipped_cells_name_their_embedded_model_not_a_machines_path():
    """Every committed cell (the gates' baselines, the shipped sweeps) names its model as any machine would, and
    so does every committed exit model (they once held the fitting machine's paths); each learned cell's key
    holds its exit model's sha256 as the file is now."""
    found, _ = cells.scan((REPO / "results").rglob("*.json"))
    assert len(found) > 900
    for path, cell in found:
        model = cell["model"]
        assert model["source"] == f"embedded:{model['path']}", (path, model["path"])
    digests = {}
    for path in sorted((REPO / "results" / "exit-models").glob("*.json")):
        fitted = json.loads(path.read_text())
        assert fitted["checkpoint"]["path"] == path.stem, path
        assert not str(fitted["source"].get("data_dir") or "").startswith("/"), path
        digests[f"results/exit-models/{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    learned = [(p, c) for p, c in found if c["policy"]["policy"] == "learned"]
    assert len(learned) >= 20
    for path, cell in learned:
        assert cell["policy"]["exit_model_sha256"] == digests[cell["policy"]["exit_model"]], path


def _git(repo: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_revision_is_dirty_only_where_the_code_a_run_executes_is(tmp_path):
    """Docs, tests or results edited beside a run leave its revision clean; a changed or new file of the package,
    the tasks or the benches does not."""
    from exitbench.runtime.provenance import git_revision

    for name in ("exitbench/a.py", "tasks/t.yaml", "docs/d.md", "tests/test_t.py", "results/r.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "x")
    head = _git(tmp_path, "rev-parse", "HEAD")

    def revision():
        git_revision.cache_clear()
        return git_revision(tmp_path)

    for name in ("docs/d.md", "tests/test_t.py", "results/r.json", "results/new.json"):
        (tmp_path / name).write_text("1\n")
    assert revision() == head
    for name in ("tasks/t.yaml", "exitbench/new.py"):
        (tmp_path / name).write_text("1\n")
        assert revision() == head + "-dirty", name
        _git(tmp_path, "checkout", "-q", "--", name) if name == "tasks/t.yaml" else (tmp_path / name).unlink()
    assert revision() == head
