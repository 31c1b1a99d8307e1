"""Hugging-Face-style checkpoint directories: config.json, safetensors (single or sharded), tokenizer.json.

Loading checks everything before touching the model, so a bad directory fails with one line that names the
problem: a missing file, an unknown architecture, a config.json field of the wrong type or a token id outside
the vocabulary (models/schema.py, from the family's config class), a missing or unexpected key, a shape or dtype the config does not imply, a
safetensors header that does not describe its file (shards.read_header). Saving writes into a temporary
sibling directory and renames it into place, so a failed save leaves nothing behind.
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
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..runtime.validation import parse
from .looped import LoopedLM
from .raven.config import stale_token_ids
from .registry import architecture_of, known_architecture
from .schema import ConfigCommon, schema_for
from .shards import DTYPE_NAMES, TensorEntry, group_quantized, read_tensors, scan
from .tokenizer import TOKENIZER_FILE, Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
AUTO = "auto"  # the checkpoint's own dtype (CheckpointLayout.resolve_dtype)
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
        raise CheckpointError(f"unknown dtype {name!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_dtype_name(name: str) -> str:
    """`name` when it is a dtype a run can ask for (auto or a DTYPES name), else one line saying what is."""
    if name != AUTO:
        parse_dtype(name)
    return name


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
    if isinstance(config.get("model_type"), str):
        architecture_of(config)  # an architecture exitbench does not know is said first, not one of its fields
    # A retrofitted Raven's config keeps Huginn-0125's special ids beside its own smaller vocabulary; they are
    # dropped here (the tokenizer files name the real ones), so every later reader sees a config that holds.
    stale = stale_token_ids(config)
    if stale:
        config = {k: v for k, v in config.items() if k not in stale}
    # Typed once, here, where the file comes in, by the family's own config class (models/schema.py): every
    # reader after this (the architecture's from_dict, the tokenizer, info) may take a field's type for granted.
    # The dict itself is returned as it was, so a valid config loads exactly as it did before the schema.
    family = known_architecture(config)
    parse(schema_for(family.config_class) if family else ConfigCommon, config, str(file), error=CheckpointError)
    return config


def weight_files(path: Path) -> dict[str, list[str]]:
    """Map each shard file to the keys the index assigns it (a single file maps to [] → all its keys)."""
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


@dataclass
class CheckpointLayout:
    """What a checkpoint directory holds, read from config.json, the tokenizer and the safetensors headers
    alone: the model's module tree on the meta device (shapes, parameter counts, loop groups; no weight
    memory) and where each of its tensors lies. Building one checks the files against the config, so a bad
    checkpoint fails here before gigabytes are read."""

    path: Path
    config: dict[str, Any]
    model: LoopedLM  # on the meta device
    entries: dict[str, TensorEntry]  # module-tree key → where its tensor lies (tied copies and extras left out)
    stored: dict[str, TensorEntry]  # every tensor of the files, under its file key
    tokenizer: Tokenizer | None
    files: list[str] = field(default_factory=list)

    @property
    def stored_dtype(self) -> str | None:
        """The floating dtype the weights are stored in (the most bytes' dtype when they are mixed)."""
        sizes: dict[torch.dtype, int] = {}
        for e in self.stored.values():
            if e.dtype.is_floating_point and e.dtype.itemsize > 1:  # (float8: quantised parts, not a run dtype)
                sizes[e.dtype] = sizes.get(e.dtype, 0) + e.nbytes
        return str(max(sizes, key=sizes.get)).removeprefix("torch.") if sizes else None

    def resolve_dtype(self, name: str) -> str:
        """The dtype a run loads the weights in: `name`, or under `auto` the checkpoint's own `torch_dtype`
        (`dtype` in configs written by transformers ≥ 5), else the dtype its files store."""
        if name != AUTO:
            parse_dtype(name)
            return name
        for field_name in ("torch_dtype", "dtype"):
            declared = self.config.get(field_name)
            if declared is not None:
                if declared not in DTYPES:
                    raise CheckpointError(f"{self.path / CONFIG_FILE}: {field_name} {declared!r} is not a dtype "
                                          f"exitbench runs in ({', '.join(DTYPES)}); pass --dtype to choose one")
                return declared
        stored = self.stored_dtype
        return stored if stored in DTYPES else "float32"

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the model's tensors once loaded at `dtype` (a tied head counted once)."""
        size = parse_dtype(dtype).itemsize
        return sum(e.numel * (size if e.dtype.is_floating_point else e.dtype.itemsize) for e in self.entries.values())


def inspect_checkpoint(path: str | Path) -> CheckpointLayout:
    """Read and check a checkpoint directory without reading its weights (see CheckpointLayout)."""
    path = Path(path).expanduser()
    config = read_config(path)
    model_cls = architecture_of(config)
    shards = weight_files(path)
    stored = scan(path, shards, INDEX_FILE)
    model_config = model_cls.read_config(config, set(stored), str(path))
    # A tensor stored block-quantised (its parts `K`, `K_scale`, …) is one logical entry, dequantised at load.
    found = model_cls.adapt_checkpoint(group_quantized(stored), model_config)
    # The module tree is built before keys can be compared, and each layer is Python objects even on the meta
    # device (20,000 layers: 40 s and 1 GB for `info`; a million exhaust memory). Every layer stores at least
    # one tensor, so a config naming more layers than the files hold tensors is wrong whatever the keys say.
    layers = getattr(model_config, "n_layers", None) or getattr(model_config, "n_layer", 0)
    if layers > len(stored):
        raise CheckpointError(f"{path / CONFIG_FILE} names {layers:,} layers, but the safetensors files hold only "
                              f"{len(stored)} tensors; each layer needs its own weights")
    with torch.device("meta"):
        model = model_cls(model_config)
    model_tensors = {**model.state_dict(), **model.checkpoint_extras()}
    expected = {k: tuple(v.shape) for k, v in model_tensors.items()}
    for key, shape in expected.items():
        if key not in found:
            raise CheckpointError(f"checkpoint {path} lacks key {key} (expected {len(expected)} keys)")
        if tuple(found[key].shape) != shape:
            raise CheckpointError(f"key {key} has shape {tuple(found[key].shape)} but config.json implies {shape}"
                                  f"{model.shape_hint()}")
        _check_dtype(path, key, found[key], model_tensors[key].dtype)
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has {len(unexpected)} keys the config does not explain, "
                              f"e.g. {unexpected[0]}")
    # What the model keeps: its parameters and persistent buffers, the tied head once, no extras (recomputed).
    tied = model.tied_head
    entries = {k: found[k] for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    tokenizer = Tokenizer.from_dir(path, config)
    return CheckpointLayout(path, config, model, entries, stored, tokenizer, sorted(shards))


def _check_dtype(path: Path, key: str, entry: TensorEntry, wanted: torch.dtype) -> None:
    """A floating tensor of the model must be stored floating (any width: the load converts it to the run's
    dtype); any other must be stored as it is. An I32 tensor the size of an F32 one passes every byte count,
    and loaded as it is it would be an integer weight."""
    if wanted.is_floating_point:
        if entry.dtype.itemsize == 1:  # float8: a quantised format's values, meaningless without their scales
            raise CheckpointError(f"{path / entry.shard}: tensor {key} is stored as {DTYPE_NAMES[entry.dtype]} with no "
                                  f"{key}_scale beside it; exitbench reads float8 only as a block-quantised format's "
                                  "values (NVFP4, MXFP8: models/quantized.py)")
        if not entry.dtype.is_floating_point:
            raise CheckpointError(f"{path / entry.shard}: tensor {key} is stored as {DTYPE_NAMES[entry.dtype]}, but "
                                  "the model needs floating-point weights there (F32, F16, BF16 or F64)")
    elif entry.dtype != wanted:
        raise CheckpointError(f"{path / entry.shard}: tensor {key} is stored as {DTYPE_NAMES[entry.dtype]}, but "
                              f"the model needs {DTYPE_NAMES.get(wanted, wanted)} there")


def load_checkpoint(path: str | Path, dtype: str = AUTO, device: str = "cpu",
                    allow_nonfinite: bool = False) -> Checkpoint:
    """Load a checkpoint directory at `dtype` (auto: the checkpoint's own, see CheckpointLayout.resolve_dtype).

    Each tensor is read once, from its shard straight into the buffer the model keeps (shards.read_tensors),
    and assigned into a module tree built on the meta device, so the weights are never in memory twice: the
    load peaks near the weights' bytes at `dtype`. Weights holding a NaN or an infinity are refused (one line
    naming the first bad tensor) unless `allow_nonfinite`: a broken checkpoint otherwise "runs" every policy
    to max depth."""
    layout = inspect_checkpoint(path)
    path, model = layout.path, layout.model
    name = layout.resolve_dtype(dtype)
    pinned = model.float32_keys() & set(layout.entries)
    tensors = read_tensors(path, {k: e for k, e in layout.entries.items() if k not in pinned}, parse_dtype(name))
    tensors.update(read_tensors(path, {k: layout.entries[k] for k in pinned}, torch.float32))
    if not allow_nonfinite:
        bad = first_nonfinite(tensors)
        if bad is not None:
            key, count, index = bad
            raise CheckpointError(f"{path}: tensor {key} holds {count} non-finite value(s) (NaN or inf; the first at "
                                  f"flat index {index}); pass --allow-nonfinite to load it anyway")
    model.load_state_dict(tensors, strict=False, assign=True)
    if model.tied_head:
        model.tie_head()
    model.reset_buffers()
    model = model.to(device).eval()
    return Checkpoint(model, layout.tokenizer, path, layout.config, name, layout.files)


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """(key, count, first flat index) of the first tensor holding a NaN or an infinity, in key order."""
    for key in sorted(tensors):
        t = tensors[key]
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        # In chunks: a bool mask of a whole 346M-entry embedding would add a third of a GB to the load's peak.
        # A chunk is screened by its min and max, which are non-finite exactly when it holds a NaN or an inf
        # (both propagate): 1.8 s over Huginn's 3.56B bf16 weights on 2 cores, against 27 s for an isfinite
        # mask per chunk. Only a chunk that fails is masked, to count and place its bad values.
        for start in range(0, flat.numel(), 1 << 24):
            low, high = torch.aminmax(flat[start:start + (1 << 24)])
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                bad = ~torch.isfinite(flat[start:start + (1 << 24)])
                count = sum(int((~torch.isfinite(flat[i:i + (1 << 24)])).sum()) for i in range(0, flat.numel(), 1 << 24))
                return key, count, start + int(bad.nonzero()[0])
    return None


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


def open_checkpoint(checkpoint: str | Path | None, dtype: str = "auto", device: str = "cpu",
                    allow_nonfinite: bool = False) -> Checkpoint:
    """The checkpoint a command names: a directory, the name of an embedded one, or None for the default."""
    from .embedded import resolve

    return load_checkpoint(resolve(checkpoint), dtype=dtype, device=device, allow_nonfinite=allow_nonfinite)
