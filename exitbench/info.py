"""What a checkpoint is: the report behind `exitbench info`."""
from __future__ import annotations

from typing import Any

from .embedded import source_label
from .models.checkpoint import Checkpoint


def describe(ck: Checkpoint) -> dict[str, Any]:
    model = ck.model
    groups = model.loop_groups()
    tok = ck.tokenizer
    return {
        "source": source_label(ck.path),
        "architecture": model.architecture,
        "parameters": model.num_parameters(),
        "parameter_breakdown": model.parameter_breakdown(),
        "layers": model.layer_split(),
        "hidden_size": model.config.n_embd,
        "heads": model.config.n_heads,
        "context": model.config.block_size,
        "loop_groups": [{"name": g.name, "layers": g.n_layers, "default_steps": g.default_steps,
                         "max_steps": g.max_steps, "random_init": g.random_init} for g in groups],
        "dtype": ck.dtype,
        "weights": ck.files[0] if len(ck.files) == 1 else f"{len(ck.files)} safetensors shards with an index",
        "tokenizer": None if tok is None else {"vocab_size": tok.vocab_size,
                                               "special_tokens": {k: {"id": i, "token": s}
                                                                  for k, (i, s) in tok.special_tokens().items()}},
        "provenance": _provenance(ck.provenance),
    }


def _provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """How the checkpoint was made, when exitbench made it: the command, seed, time and code revision."""
    training = meta.get("training")
    if not training:
        return {}
    run = meta.get("run", {})
    return {"command": training.get("command"), "seed": training.get("seed"),
            "training_seconds": training.get("training_seconds"), "steps": training.get("steps_done"),
            "git_revision": run.get("git_revision"), "host": run.get("host"), "trained": run.get("started")}
