"""What a checkpoint is: the report behind `exitbench info`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..runtime.options import checkpoint_option, dtype_option, nonfinite_option, option
from .checkpoint import AUTO, CheckpointLayout
from .embedded import source_label


@dataclass
class InfoOptions:
    """`exitbench info`'s options (the CLI derives its flags from these fields, as run's from RunOptions)."""
    checkpoint: Optional[str] = checkpoint_option()
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()
    as_json: bool = field(default=False, metadata=option("Print the report as JSON.", "--json"))
    depth: bool = field(default=False, metadata=option(
        "Also measure accuracy, perplexity and step norms vs r on held-out programs of the checkpoint's synthetic "
        "task.", "--depth"))
    programs: int = field(default=256, metadata=option("Held-out programs for --depth.", "--programs"))
    seed: int = field(default=0, metadata=option("Seed of the held-out programs and initial states.", "--seed"))
    memory_plan: bool = field(default=False, metadata=option(
        "Also print the memory a run needs: weights, KV cache (one slot per iteration per loop layer) and "
        "activations.", "--plan"))
    batch_size: int = field(default=16, metadata=option("--plan: rows run together (run's default).", "--batch-size"))
    device: Optional[str] = field(default=None, metadata=option(
        "--plan: the device whose free memory the total is compared with (auto, cpu, cuda, cuda:N, mps; default as "
        "run's)."))
    context: Optional[int] = field(default=None, metadata=option(
        "--plan: the longest sequence, prompt and generated tokens [the model's context].", "--context"))
    max_steps: Optional[int] = field(default=None, metadata=option(
        "--plan: iterations per loop group [each group's default depth].", "--max-steps"))
    memory_gb: Optional[float] = field(default=None, metadata=option(
        "--plan: compare with a device of this many GB instead of measuring --device's free memory (a GPU this "
        "machine does not have), and say how many rows fit in it.", "--memory-gb"))


def describe(layout: CheckpointLayout, dtype: str = AUTO) -> dict[str, Any]:
    """The report, from the checkpoint's config, tokenizer and safetensors headers: no weight is read, so it
    costs the same for a 1 MB model and a 15 GB one. `dtype` is what a run would load the weights in."""
    model = layout.model  # on the meta device: shapes and counts only
    groups = model.loop_groups()
    tok = layout.tokenizer
    run_dtype = layout.resolve_dtype(dtype)
    variant = model.describe_variant()
    return {
        "source": source_label(layout.path),
        "architecture": model.architecture,
        **({"variant": variant} if variant else {}),
        "parameters": model.num_parameters(),
        "parameter_breakdown": model.parameter_breakdown(),
        "layers": model.layer_split(),
        "hidden_size": model.config.n_embd,
        "heads": model.config.n_heads,
        "context": model.config.block_size,
        "loop_groups": [{"name": g.name, "layers": g.n_layers, "default_steps": g.default_steps,
                         "max_steps": g.max_steps, "random_init": g.random_init} for g in groups],
        "dtype": run_dtype,
        "stored_dtype": layout.stored_dtype,
        "weight_bytes": layout.weight_bytes(run_dtype),
        "weights": layout.files[0] if len(layout.files) == 1 else f"{len(layout.files)} safetensors shards with an index",
        "shards": [_shard(layout, f) for f in layout.files],
        "tokenizer": None if tok is None else {"vocab_size": tok.vocab_size,
                                               "special_tokens": {k: {"id": i, "token": s}
                                                                  for k, (i, s) in tok.special_tokens().items()}},
        "provenance": _provenance(layout.config.get("exitbench", {})),
    }


def _shard(layout: CheckpointLayout, name: str) -> dict[str, Any]:
    entries = [e for e in layout.stored.values() if e.shard == name]
    dtypes = sorted({str(e.dtype).removeprefix("torch.") for e in entries})
    return {"file": name, "tensors": len(entries), "bytes": sum(e.nbytes for e in entries), "dtypes": dtypes}


def _provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """How the checkpoint was made, when exitbench made it: the command, seed, time and code revision."""
    training = meta.get("training")
    if not training:
        return {}
    run = meta.get("run", {})
    return {"command": training.get("command"), "seed": training.get("seed"),
            "training_seconds": training.get("training_seconds"), "steps": training.get("steps_done"),
            "git_revision": run.get("git_revision"), "host": run.get("host"), "trained": run.get("started")}
