"""Checkpoints named by Hugging Face hub id: `org/name` or `org/name@revision`, fetched into the hub's own cache
as lm-eval's `pretrained=` would find them, so a model downloaded once serves both.

Only what exitbench reads is fetched: the safetensors weights and their index, the JSON configs (model,
tokenizer, generation) and tokenizer files, a chat-template file. Never code: `auto_map` names remote
modules, which exitbench does not run. With `HF_HUB_OFFLINE=1` the cache alone answers. The snapshot a
download lands in records the repo and its commit in its path (…/models--ORG--NAME/snapshots/COMMIT), so a
cell reads them back from the checkpoint's path; the cell's key stays the files' content hash, and a local
copy of the same files is the same model.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError

# The files a checkpoint directory can need (models/checkpoint.py, models/tokenizer.py, chat templates).
WANTED = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "chat_template.json", "additional_chat_templates/*.jinja"]
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# ASCII only, as the hub's repo ids are: "org/ünï" is a path that does not exist, not a repo to ask for.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$", re.ASCII)
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` reads as a hub id and is no path on disk, else None."""
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return None
    m = _HUB_ID.match(spec)
    return (m["repo"], m["revision"]) if m else None


def hub_source(path: str | Path) -> dict[str, str] | None:
    """{"repo", "commit"} of a checkpoint directory that is a hub cache snapshot, else None."""
    m = _SNAPSHOT.search(Path(path).resolve().as_posix())
    return {"repo": f"{m['org']}/{m['name']}", "commit": m["commit"]} if m else None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(repo: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo` at `revision` (default: main) in the hub cache, downloading what is
    missing unless offline. Every failure is one line that says what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo + (f"@{revision}" if revision else "")
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=WANTED, local_files_only=offline()))
    except GatedRepoError:
        raise CheckpointError(f"{name} is gated: accept its terms on huggingface.co/{repo} and log in "
                              "(hf auth login), then rerun") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{name}: the repository has no revision {revision!r}; name a branch, tag or "
                              "commit it has") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{name}: no directory of that name here, and no such model repository on the hub "
                              "(or it is private: log in with hf auth login)") from None
    except LocalEntryNotFoundError:
        how = ("HF_HUB_OFFLINE is set and the hub cache does not hold it: download it once online, or unset "
               "HF_HUB_OFFLINE" if offline() else "the hub could not be reached and the cache does not hold it")
        raise CheckpointError(f"{name}: no directory of that name here, and {how}") from None
    except HFValidationError as exc:
        raise CheckpointError(f"{name}: no directory of that name here, and not a hub id the hub accepts "
                              f"({str(exc).splitlines()[0]})") from None
    except NotADirectoryError:
        raise CheckpointError(f"{name}: the hub cache holds a file where its snapshot folder should be (a damaged "
                              "cache); delete that repository's folder from the cache and download it again") from None
    _check_snapshot(path, name, revision)
    _check_weights(path, name, repo, revision)
    return path


def _check_snapshot(path: Path, name: str, revision: str | None) -> None:
    """What an interrupted or damaged download leaves in the cache, said as such: a ref that names no commit
    (huggingface_hub then hands back the `snapshots` folder itself), a snapshot that is a file, links to blobs
    that were never written."""
    if path.name == "snapshots":
        ref = revision or "main"
        raise CheckpointError(f"{name}: the hub cache's refs/{ref} names no snapshot (an interrupted download?): "
                              f"download it again, or name a commit with {name.split('@')[0]}@COMMIT")
    if not path.is_dir():
        raise CheckpointError(f"{name}: the hub cache holds a file where its snapshot folder {path} should be (a "
                              "damaged cache); delete the file and download the checkpoint again")
    dangling = sorted(p.name for p in path.iterdir() if p.is_symlink() and not p.exists())
    if dangling:
        raise CheckpointError(f"{name}: the snapshot's {dangling[0]} links to a blob that is not in the cache (an "
                              "interrupted download?); download it again")


def _check_weights(path: Path, name: str, repo: str, revision: str | None) -> None:
    """A snapshot without safetensors: say whether the repo holds only pickled weights, which exitbench will
    not unpickle (loading a pickle runs code)."""
    if any(path.glob("*.safetensors")):
        return
    files = [p.name for p in path.iterdir()]  # a full `hf download` keeps the pickles in the snapshot too
    if not offline():
        try:
            from huggingface_hub import HfApi

            files += HfApi().list_repo_files(repo, revision=revision)
        except Exception:  # the listing only sharpens the message below
            pass
    pickled = sorted(f for f in files if f.endswith(PICKLED))
    if pickled:
        raise CheckpointError(f"{name} holds only pickled weights ({pickled[0]}, …), which exitbench does not load "
                              "(unpickling runs code); use a repository or revision with .safetensors, or convert "
                              "it (safetensors' convert script)")
    raise CheckpointError(f"{name}: the snapshot at {path} has no .safetensors weights; exitbench loads only "
                          "safetensors checkpoints")
