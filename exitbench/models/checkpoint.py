"""Hugging-Face-style checkpoint directories: config.json, safetensors (single or sharded), tokenizer.json.

Loading checks everything before touching the model, so a bad directory fails with one line that names the
problem: a missing file, an unknown architecture, a missing or unexpected key, a shape the config does not
imply, a truncated safetensors file. Saving writes into a temporary sibling directory and renames it into
place, so a failed save leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..tokenizer import TOKENIZER_FILE, Tokenizer
from .looped import LoopedLM
from .registry import architecture_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Checkpoint:
    model: LoopedLM
    tokenizer: Tokenizer | None
    path: Path
    config: dict[str, Any]
    dtype: str
    files: list[str] = field(default_factory=list)

    @property
    def provenance(self) -> dict[str, Any]:
        return self.config.get("exitbench", {})


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint must be a directory holding config.json and safetensors, got file {path}")
    file = path / CONFIG_FILE
    if not file.exists():
        raise CheckpointError(f"{path} has no {CONFIG_FILE}; a checkpoint directory needs one")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return config


def weight_files(path: Path) -> dict[str, list[str]]:
    """Map each shard file to the keys the index assigns it (a single file maps to None → all keys)."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index with a weight_map: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map each key to a shard file name")
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            shards.setdefault(shard, []).append(key)
        for shard in shards:
            if not (path / shard).exists():
                raise CheckpointError(f"shard {shard} named in {INDEX_FILE} is missing from {path}")
        return shards
    if (path / WEIGHTS_FILE).exists():
        return {WEIGHTS_FILE: []}
    raise CheckpointError(f"{path} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def read_tensors(path: Path, shards: dict[str, list[str]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard, indexed_keys in shards.items():
        file = path / shard
        try:
            with safe_open(str(file), framework="pt") as fh:
                keys = list(fh.keys())
                for key in indexed_keys:
                    if key not in keys:
                        raise CheckpointError(f"key {key} is in {INDEX_FILE} but not in shard {shard}")
                for key in keys:
                    if key in tensors:
                        raise CheckpointError(f"key {key} appears in more than one shard ({shard})")
                    t = fh.get_tensor(key)
                    tensors[key] = t.to(dtype) if t.is_floating_point() else t
        except SafetensorError as exc:
            raise CheckpointError(f"{file} is truncated or corrupt: {exc}") from None
    return tensors


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """(key, count, first flat index) of the first tensor holding a NaN or an infinity, in key order."""
    for key in sorted(tensors):
        t = tensors[key]
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        # In chunks: a bool mask of a whole 346M-entry embedding would add a third of a GB to the load's peak.
        for start in range(0, flat.numel(), 1 << 24):
            bad = ~torch.isfinite(flat[start:start + (1 << 24)])
            if bool(bad.any()):
                count = sum(int((~torch.isfinite(flat[i:i + (1 << 24)])).sum()) for i in range(0, flat.numel(), 1 << 24))
                return key, count, start + int(bad.nonzero()[0])
    return None


def load_checkpoint(path: str | Path, dtype: str = "float32", device: str = "cpu",
                    allow_nonfinite: bool = False) -> Checkpoint:
    """Load a checkpoint directory. Weights holding a NaN or an infinity are refused (one line naming the first
    bad tensor) unless `allow_nonfinite`: a broken checkpoint otherwise "runs" every policy to max depth."""
    path = Path(path).expanduser()
    torch_dtype = parse_dtype(dtype)
    config = read_config(path)
    model_cls = architecture_of(config)
    model_config = model_cls.config_class.from_dict(config)
    shards = weight_files(path)
    tensors = model_cls.adapt_checkpoint(read_tensors(path, shards, torch_dtype), model_config)
    if not allow_nonfinite:
        bad = first_nonfinite(tensors)
        if bad is not None:
            key, count, index = bad
            raise CheckpointError(f"{path}: tensor {key} holds {count} non-finite value(s) (NaN or inf; the first at "
                                  f"flat index {index}); pass --allow-nonfinite to load it anyway")

    with torch.device("meta"):
        model = model_cls(model_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected.update({k: tuple(v.shape) for k, v in model.checkpoint_extras().items()})
    for key, shape in expected.items():
        if key not in tensors:
            raise CheckpointError(f"checkpoint {path} lacks key {key} (expected {len(expected)} keys)")
        if tuple(tensors[key].shape) != shape:
            raise CheckpointError(f"key {key} has shape {tuple(tensors[key].shape)} but config.json implies {shape}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has {len(unexpected)} keys the config does not explain, "
                              f"e.g. {unexpected[0]}")
    tied = model.tied_head
    params = {k: tensors[k] for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    model.load_state_dict(params, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.transformer.wte.weight
    model.reset_buffers()
    model = model.to(device).eval()
    tokenizer = Tokenizer.from_dir(path, config)
    return Checkpoint(model, tokenizer, path, config, dtype, sorted(shards))


def checkpoint_state(model: LoopedLM) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint file holds, tied duplicates as separate copies (safetensors forbids sharing)."""
    state = {**model.state_dict(), **model.checkpoint_extras()}
    seen: set[int] = set()
    out = {}
    for key, t in state.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone().contiguous() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return out


def save_checkpoint(model: LoopedLM, path: str | Path, tokenizer: Tokenizer | None = None,
                    extra_config: dict[str, Any] | None = None, max_shard_bytes: int | None = None,
                    overwrite: bool = False) -> Path:
    """Write model (+ tokenizer) to `path` in Huginn's layout; atomic: a failure leaves `path` untouched."""
    path = Path(path).expanduser()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} exists and is not empty; choose a new directory or pass overwrite")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=parent))
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint under {parent}: {exc.strerror}") from None
    try:
        state = checkpoint_state(model)
        config = model.config.to_dict()
        config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
        if extra_config:
            config.update(extra_config)
        _write_weights(tmp, state, max_shard_bytes)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        if path.exists():
            _replace_files(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_files(new: Path, path: Path) -> None:
    """Swap a checkpoint's files for those in `new`, leaving other content of `path` (e.g. training/) alone.

    config.json moves last: a directory is a loadable checkpoint only once its config is there, so an
    interrupted swap is visible as a missing config, never as a config paired with other weights.
    """
    (path / CONFIG_FILE).unlink(missing_ok=True)
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_FILE, path / TOKENIZER_FILE]:
        old.unlink(missing_ok=True)
    for file in sorted(new.iterdir(), key=lambda f: f.name == CONFIG_FILE):
        os.replace(file, path / file.name)
    new.rmdir()


def _write_weights(directory: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(nbytes(t) for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes(t)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
