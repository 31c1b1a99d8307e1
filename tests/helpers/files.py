"""Files on disk: directory listings for before/after comparisons (a command must not write where it only
reads), a checkpoint shard cut short, and editable copies of the committed checkpoints (the embedded models and
tests/fixtures), the one way every test makes them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def listing(path: Path) -> list[str]:
    """Every path under `path` (relative), for before/after comparisons."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def truncate_shard(checkpoint: Path) -> Path:
    """Cut the second *.safetensors file of a sharded checkpoint to half its length; returns that shard."""
    shard = sorted(checkpoint.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return shard


def model_copy(src: Path, dst: Path) -> Path:
    """A checkpoint folder's model files (not its training/ history) copied to `dst`, for a test to edit."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("training"))
    return dst


def edited_copy(src: Path, dst: Path, **config) -> Path:
    """A checkpoint copied to `dst` with these config.json fields changed (None removes one)."""
    path = model_copy(src, dst)
    fields = {**json.loads((path / "config.json").read_text()), **config}
    (path / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    return path


def fixture_copy(tmp_path: Path, name: str, **config) -> Path:
    """tests/fixtures/NAME copied under tmp_path with these config.json fields changed (None removes one)."""
    return edited_copy(FIXTURES / name, tmp_path / name, **config)


def fixture_and_reference(name: str):
    """The module fixtures `ck` and `ref` of a family's parity tests: tests/fixtures/NAME loaded, and the reference
    outputs its public implementation computed on it (tests/fixtures/NAME-reference.safetensors)."""
    import pytest
    from safetensors.torch import load_file

    from exitbench.models.checkpoint import load_checkpoint

    @pytest.fixture(scope="module")
    def ck():
        return load_checkpoint(FIXTURES / name)

    @pytest.fixture(scope="module")
    def ref():
        return load_file(str(FIXTURES / f"{name}-reference.safetensors"))

    return ck, ref
