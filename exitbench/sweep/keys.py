"""A cell's identity: the model record and the key (README, "What a cell's key holds").

Each cell is named by a hash of its key, everything that can change a number in it, so a cell already on disk
is the same computation and is reused. Keep this beside the README's key table.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .. import __version__
from ..engine import ExitConfig
from ..models import Checkpoint
from ..runtime.provenance import package_version
from ..store.identity import checkpoint_identity
from . import backends
from .config import SweepConfig


def model_record(ck: Checkpoint) -> dict[str, Any]:
    from ..models.embedded import recorded_path, source_label
    from ..models.hub import hub_source

    ident = checkpoint_identity(ck.path)
    hub = hub_source(ck.path)  # the repo and resolved commit; the key keeps the content fingerprint
    return {"path": recorded_path(ck.path), "source": source_label(ck.path), **({"hub": hub} if hub else {}),
            "architecture": ck.model.architecture,
            "parameters": ck.model.num_parameters(), "fingerprint": ident.short, "files": ident.files,
            "dtype": ck.dtype, **({"compiled": True} if ck.model.compiled else {}),
            **({"readout_attends": True} if readout_attends(ck.model) else {})}


def readout_attends(model: Any) -> bool:
    """Whether a loop group's readout runs stages that attend to other tokens (a coda, a later loop group)."""
    return any(model.readout_attention(g) for g in range(len(model.loop_groups())))


def key_limit(limit: int | float | None, n_docs: int | None) -> int | float | None:
    """The limit as a cell's key holds it: none where it takes every one of the task's `n_docs` documents (by
    lm-eval's count: a whole number as is, a fraction of the documents rounded up), since that is the same
    computation as no limit and must be the same cell. A limit that leaves documents out stays as given."""
    if limit is None or n_docs is None:
        return limit
    taken = math.ceil(n_docs * limit) if limit < 1 else int(limit)
    return None if taken >= n_docs else limit


def cell_key(model: dict[str, Any], task: str, task_fingerprint: str, exit_cfg: ExitConfig, cfg: SweepConfig,
             device: str, world_size: int = 1, n_docs: int | None = None) -> dict[str, Any]:
    """Everything that can change a number in the cell (README, "What a cell's key holds"). Batch size, device
    and world size change only timings, but a cell's timings are results too. A replay cell's key says so, so
    it never stands in for an exact one. With the task's document count `n_docs`, a limit that takes them all
    is keyed as no limit (`key_limit`)."""
    mode = {"mode": "replay"} if cfg.replay else {}
    # A compiled step changes timings (and float rounding); named only when on, so other cells keep their ids.
    compiled = {"compiled": True} if model.get("compiled") else {}
    # Prompt settings (chat template, system instruction, …) only when set, so other cells keep their ids.
    prompt = cfg.prompting.key_dict()
    prompt = {"prompt": prompt} if prompt else {}
    # A decoding rule whose readout attends to other tokens reads them in its own readouts' entries since issue
    # 45 (engine/probe_cache.py); before, in the run's final ones. Named only there, so other cells keep their ids.
    probe = {"probe": "own_readouts"} if model.get("readout_attends") and (
        exit_cfg.build_policy().needs_logits or exit_cfg.exit_mode == "weighted") else {}
    backend = backends.backend(cfg.backend).key_part()
    return {**mode, **backend, **probe, "model": model["fingerprint"], "dtype": model["dtype"], **compiled, **prompt, "task": task,
            "task_fingerprint": task_fingerprint,
            "limit": key_limit(cfg.limit, n_docs), "num_fewshot": cfg.num_fewshot, "exit": exit_cfg.key_dict(),
            "add_bos_token": cfg.add_bos_token, "bootstrap_iters": cfg.bootstrap_iters,
            "batch_size": cfg.batch_size, "seed": cfg.seed, "device": device, "world_size": world_size,
            "versions": {"exitbench": __version__, "lm_eval": package_version("lm_eval") or package_version("lm-eval"),
                         "torch": torch.__version__}}
