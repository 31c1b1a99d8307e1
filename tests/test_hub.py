"""Checkpoints named by hub id (`-c org/name[@revision]`, lm-eval's `pretrained=`), resolved through
huggingface_hub into its cache, tested offline on a cache directory laid out as the hub lays it out:
models--ORG--NAME/refs/main holding the commit, snapshots/COMMIT/ holding the files."""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from exitbench.errors import CheckpointError
from exitbench.models import hub
from exitbench.models.checkpoint import open_checkpoint
from exitbench.models.embedded import EMBEDDED_DIR, resolve, source_label
from exitbench.sweep.keys import model_record

from helpers.cli import assert_one_line_error, exitbench_cmd, subprocess_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


def lay_out(cache: Path, repo: str, commit: str, source: Path, files=("config.json", "model.safetensors",
                                                                      "tokenizer.json"), ref: str = "main") -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(source / name, snapshot / name)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An offline hub cache holding tiny-raven as exitbench/tiny-raven (main, and a tag v1 at another commit)."""
    root = tmp_path / "hub"
    lay_out(root, "exitbench/tiny-raven", COMMIT, EMBEDDED_DIR / "tiny-raven")
    lay_out(root, "exitbench/tiny-raven", OTHER, EMBEDDED_DIR / "tiny-raven", ref="v1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_a_hub_id_resolves_to_its_cached_snapshot(cache):
    main = resolve("exitbench/tiny-raven")
    assert main == cache / "models--exitbench--tiny-raven" / "snapshots" / COMMIT
    assert resolve(f"exitbench/tiny-raven@{COMMIT}") == main and resolve("exitbench/tiny-raven@main") == main
    assert resolve("exitbench/tiny-raven@v1").name == OTHER
    assert hub.hub_source(main) == {"repo": "exitbench/tiny-raven", "commit": COMMIT}
    assert source_label(main) == f"hub:exitbench/tiny-raven@{COMMIT[:12]}"


def test_a_cell_records_the_repo_and_commit_but_keys_on_the_content(cache):
    """A hub snapshot and a local copy of the same files are one model: same fingerprint, so same cell ids."""
    from_hub = model_record(open_checkpoint("exitbench/tiny-raven@v1"))
    local = model_record(open_checkpoint("tiny-raven"))
    assert from_hub["hub"] == {"repo": "exitbench/tiny-raven", "commit": OTHER} and "hub" not in local
    assert from_hub["fingerprint"] == local["fingerprint"]


def test_lm_eval_pretrained_names_the_checkpoint(cache):
    from exitbench.harness.model import ExitbenchLM

    lm = ExitbenchLM(pretrained="exitbench/tiny-raven", policy="fixed", threshold=2)
    assert lm.ck.path.name == COMMIT
    assert lm.get_model_info()["exitbench"]["hub"] == {"repo": "exitbench/tiny-raven", "commit": COMMIT}
    with pytest.raises(Exception, match="checkpoint=tiny-raven and pretrained=exitbench/tiny-raven"):
        ExitbenchLM(checkpoint="tiny-raven", pretrained="exitbench/tiny-raven")


def test_what_is_not_cached_offline_is_one_line(cache):
    for spec in ("exitbench/nothing-here", "exitbench/tiny-raven@v2"):
        with pytest.raises(CheckpointError, match=r"no directory of that name here, and HF_HUB_OFFLINE is set"):
            resolve(spec)


def test_pickled_weights_are_refused(cache, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (source / "pytorch_model.bin").write_bytes(b"not unpickled")
    lay_out(cache, "someone/old-model", COMMIT, source, files=("config.json", "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match=r"someone/old-model holds only pickled weights \(pytorch_model.bin"):
        resolve("someone/old-model")


@pytest.mark.parametrize("error,words", [("GatedRepoError", ["is gated", "hf auth login"]),
                                         ("RepositoryNotFoundError", ["no such model repository"]),
                                         ("RevisionNotFoundError", ["has no revision 'nope'"])])
def test_hub_refusals_say_what_to_do(monkeypatch, error, words):
    import huggingface_hub
    import huggingface_hub.errors

    cls = getattr(huggingface_hub.errors, error)

    def refuse(*args, **kwargs):
        raise cls.__new__(cls)  # the hub's own exception; its constructor wants an HTTP response

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(CheckpointError) as err:
        hub.fetch("someone/model", "nope")
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_only_weights_configs_and_tokenizers_are_fetched():
    wanted = lambda name: any(fnmatch.fnmatch(name, p) for p in hub.WANTED)  # noqa: E731
    for name in ("model.safetensors", "model-00001-of-00004.safetensors", "model.safetensors.index.json",
                 "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "additional_chat_templates/tool_use.jinja"):
        assert wanted(name), name
    for name in ("modeling_ouro.py", "raven_config_minimal.py", "pytorch_model.bin", "optimizer.pt", "README.md"):
        assert not wanted(name), name


def test_paths_and_embedded_names_win_over_hub_ids(cache, tmp_path, monkeypatch):
    assert hub.parse_hub_id("tiny-raven") is None and hub.parse_hub_id("./org/name") is None
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_id("org/name") is None and resolve("org/name") == Path("org/name")
    assert resolve("tiny-raven/training/step-000250") == EMBEDDED_DIR / "tiny-raven/training/step-000250"


def test_the_command_reads_the_cache_in_this_process(cache):
    """The command half of the test below (the cache named through huggingface_hub, not the environment)."""
    from exitbench.cli import app

    from helpers.cli import explain, runner

    res = runner.invoke(app, ["info", "-c", "exitbench/tiny-raven", "--json"])
    assert res.exit_code == 0, explain(res)
    assert json.loads(res.stdout)["source"] == f"hub:exitbench/tiny-raven@{COMMIT[:12]}"
    assert_one_line_error(runner.invoke(app, ["info", "-c", "exitbench/absent"]), ["exitbench/absent", "HF_HUB_OFFLINE"])


@pytest.mark.slow  # 11 s: two fresh interpreters, to read HF_HUB_CACHE from the environment as a user sets it; the
# command itself is checked fast in this process (test_the_command_reads_the_cache_in_this_process)
def test_the_command_line_reads_the_cache(tmp_path):
    """As a user runs it: HF_HUB_CACHE and HF_HUB_OFFLINE in the environment, a hub id on the command line."""
    import subprocess

    root = tmp_path / "hub"
    lay_out(root, "exitbench/tiny-raven", COMMIT, EMBEDDED_DIR / "tiny-raven")
    env = subprocess_env(HF_HUB_CACHE=str(root))
    proc = subprocess.run(exitbench_cmd("info", "-c", "exitbench/tiny-raven", "--json"), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["source"] == f"hub:exitbench/tiny-raven@{COMMIT[:12]}"
    proc = subprocess.run(exitbench_cmd("info", "-c", "exitbench/absent"), env=env, capture_output=True, text=True,
                          timeout=120)
    assert_one_line_error(proc, ["exitbench/absent", "HF_HUB_OFFLINE"])


def _damaged(cache: Path, repo: str, damage: str) -> None:
    """A cache entry as an interrupted or damaged download leaves it."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("" if damage == "empty ref" else COMMIT)
    if damage == "snapshot is a file":
        snapshot.parent.mkdir(parents=True)
        snapshot.write_text("not a folder")
        return
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if damage == "links to missing blobs":
            (snapshot / name).symlink_to(folder / "blobs" / f"never-written-{name}")
        else:
            shutil.copy(EMBEDDED_DIR / "tiny-raven" / name, snapshot / name)


@pytest.mark.parametrize("damage,words", [
    ("empty ref", ["refs/main names no snapshot", "interrupted download"]),
    ("snapshot is a file", ["a file where its snapshot folder", "download the checkpoint again"]),
    ("links to missing blobs", ["links to a blob that is not in the cache", "interrupted download"]),
])
def test_a_damaged_cache_entry_is_named_for_what_it_is(cache, damage, words):
    _damaged(cache, "org/damaged", damage)
    with pytest.raises(CheckpointError) as err:
        resolve("org/damaged")
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_a_name_with_letters_the_hub_never_uses_is_a_missing_path(cache):
    """Repo ids are ASCII: `org/ünï` is not sent to the hub (whose validator raised a traceback); it is a path."""
    assert hub.parse_hub_id("org/ünï") is None
    with pytest.raises(CheckpointError, match="checkpoint directory not found: org/ünï"):
        open_checkpoint("org/ünï")
