"""The memory a run needs, before it runs: weights, the KV cache, and the largest activations.

At Huginn-0125's size the KV cache, not the weights, decides what fits: every core layer keeps one slot per
loop iteration (models/cache.py), so a run of B rows over T positions with up to R iterations holds
2 · (R · core layers + plain layers) · B · T · heads · head_dim values; a KV window of c iterations puts
min(R, c) in place of R. The engine allocates exactly that for its requests' longest sequence (engine.Run),
and this plan computes it with the same slot table
(`LoopedLM.cache_slots`) and the same byte count (`KVCache.bytes_for`), so plan and allocation cannot drift.

Activations are an estimate of the largest transient (the terms are named in the plan); bench/RESULTS.md
compares the whole plan with measured peaks on a full-size checkpoint.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import ExitbenchError
from ..models import KVCache, LoopedLM
from .engine import DEFERRED_BATCH
from .waves import block_positions, gather_bytes

# Parameters that are not per-layer weights: their widths (vocabulary, positions) are not activation widths.
_NOT_LAYER_WEIGHTS = ("wte", "wpe", "lm_head")


def plan(model: LoopedLM, dtype: torch.dtype, batch: int, context: int,
         max_steps: int | Sequence[int] | None = None, kv_window: int | None = None) -> dict[str, Any]:
    """Bytes a run of `batch` rows over sequences of up to `context` positions needs, with each loop group
    capped at `max_steps` iterations (default: each group's default depth, what a run uses unless told) and
    its layers keeping the KV entries of the last `kv_window` iterations (None: all of them).
    `model` may live on the meta device (a CheckpointLayout's): only shapes are read."""
    groups = model.loop_groups()
    block = model.config.block_size
    if batch < 1:
        raise ExitbenchError(f"--batch-size must be ≥ 1, got {batch}")
    if not 1 <= context <= block:
        raise ExitbenchError(f"--context must be between 1 and the model's context of {block} positions, got {context}")
    steps = [g.default_steps for g in groups] if max_steps is None else model.resolve_steps(max_steps)
    for g, r in zip(groups, steps):
        if not 1 <= r <= g.max_steps:
            raise ExitbenchError(f"--max-steps {r}: the {g.name} group runs 1 … {g.max_steps} iterations "
                                 "(the checkpoint's configured maximum)")
    size = dtype.itemsize
    unique = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in unique)
    slots = model.cache_slots(steps, kv_window)
    n_heads, head_dim = model.cache_geometry()
    states = model.state_geometry()  # (per-position states kept beside the keys: their own widths)
    kv = KVCache.bytes_for(batch, context, n_heads, head_dim, slots, dtype, states)
    acts = activations(model, dtype, batch, context)
    transient = acts["inputs"] + max(acts["prefill_or_head"], acts["wave_gather"])
    looped = {layer for g in groups for layer in g.attn_layers}
    return {
        "dtype": str(dtype).removeprefix("torch."), "batch_size": batch, "context": context,
        "max_steps": steps, "kv_window": kv_window,
        "weights": weights,
        "kv_cache": kv,
        "kv_layout": {"loop_layers": len(looped),
                      "slots_per_loop_layer": [min(r, kv_window) if kv_window else r for r in steps],
                      "plain_layers": len(slots) - len(looped) - len(states),
                      "state_layers": len(states),
                      "bytes_per_slot": KVCache.bytes_for(batch, context, n_heads, head_dim, {0: 1}, dtype)},
        "activations": transient,
        "activation_terms": acts,
        "wave": wave(model, dtype, batch, context),
        "total": weights + kv + transient,
    }


def largest_batch(model: LoopedLM, dtype: torch.dtype, context: int, max_steps: int | Sequence[int] | None,
                  kv_window: int | None, available: int, limit: int = 1 << 16) -> int:
    """The most rows whose plan fits in `available` bytes (0: not even one), found by halving: a plan grows with
    the batch, so what fits is a prefix of 1 … limit."""
    fits = lambda b: plan(model, dtype, b, context, max_steps, kv_window)["total"] <= available  # noqa: E731
    if not fits(1):
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


MAX_MEMORY_GB = 1e9  # an exabyte: inf (1e400 reads as inf) and 1e300 (inf once in bytes) have no byte count


def device_plan(model: LoopedLM, dtype: torch.dtype, batch: int, context: int,
                max_steps: int | Sequence[int] | None, kv_window: int | None, device: str | None = None,
                memory_gb: float | None = None) -> dict[str, Any]:
    """`info --plan`: the plan beside the free memory of `device` (resolved as a run resolves it), or beside
    `memory_gb` GB (a GPU this machine does not have) with the most rows that fit in it."""
    from ..runtime.devices import available_memory, resolve_device

    report = plan(model, dtype, batch, context, max_steps, kv_window)
    if memory_gb is None:
        where = resolve_device(device)
        return {**report, "device": where, "available": available_memory(where)}
    if not 0 < memory_gb <= MAX_MEMORY_GB:
        raise ExitbenchError(f"--memory-gb must be a number of GB > 0 and at most {MAX_MEMORY_GB:g}, got "
                             f"{memory_gb:g}")
    available = int(memory_gb * 1e9)
    return {**report, "device": f"{memory_gb:g} GB (--memory-gb)", "available": available,
            "largest_batch": largest_batch(model, dtype, context, max_steps, kv_window, available)}


def check_sweep_fits(model: LoopedLM, configs: Sequence[Any], batch: int, device: str) -> dict[str, Any] | None:
    """Refuse, before its first cell, a sweep that cannot fit whatever its documents: its plan at the shortest
    sequence any request has (one position per row) and its deepest exit config, against the memory the device
    has free now (the weights already loaded, so they are not counted again). A run that fits this lower bound
    may still need more for long documents (`exitbench info --plan --context N` says how much). Returns the
    plan; None where the device's free memory cannot be read."""
    from ..runtime.devices import available_memory

    free = available_memory(device)
    if free is None:
        return None
    groups = model.loop_groups()
    deepest = [max(p.max_steps for p in column) for column in zip(*(c.bound_policies(groups) for c in configs))]
    windows = {c.kv_window for c in configs}
    window = None if None in windows or 0 in windows else max(windows)
    dtype = next(model.parameters()).dtype
    # continuous depth batching holds spare rows beside the batch (ExitConfig.coda_bucket)
    rows = batch + max((c.coda_bucket(batch) for c in configs if c.refill == "continuous" and batch > 1
                        and c.exit_mode is None and c.build_policy().decides_as_it_runs()), default=0)
    need = plan(model, dtype, rows, 1, deepest, window)
    beyond_weights = need["total"] - need["weights"]
    if beyond_weights > free:
        raise ExitbenchError(f"this sweep needs at least {beyond_weights / 1e9:.1f} GB beside the weights (a KV cache "
                             f"of {need['kv_cache'] / 1e9:.1f} GB for {rows} rows at {max(deepest)} iterations, one "
                             f"position each), but {device} has {free / 1e9:.1f} GB free: lower --batch-size, "
                             "--coda-batch or --max-steps, set --kv-window, or pass --no-memory-check to try anyway")
    return need


def activations(model: LoopedLM, dtype: torch.dtype, batch: int, context: int) -> dict[str, int]:
    """The largest transient tensors of a run, as named terms (bytes):

    - `inputs`: a teacher-forced run keeps every position's input to the first loop group (B · T · d);
    - `prefill`: the prefill runs B · T positions through one layer at a time; its widest moment is the MLP
      (fc's output, its activation and the gated product: 2 · widest) beside a few residual-stream copies,
      and RMSNorm / RoPE work in float32;
    - `head`: float32 logits and log-probabilities of the tokens finished together (up to DEFERRED_BATCH
      teacher-forced, or one per row), and the same again for a decoding probe (kl, confidence);
    - `wave_gather`: a depth-major wave's keys and values gathered per token (`wave`).
    The prefill, the head and the loop's waves do not overlap: the largest of them counts (`activations`).
    """
    size = dtype.itemsize
    d = model.config.n_embd
    widest = max(max(p.shape) for name, p in model.named_parameters()
                 if p.dim() == 2 and not any(part in name for part in _NOT_LAYER_WEIGHTS))
    tokens = batch * context
    prefill = tokens * ((2 * widest + 8 * d) * size + 3 * d * 4)
    head = 2 * max(batch, min(DEFERRED_BATCH, tokens)) * model.output_size * 4 * 2
    return {"inputs": tokens * d * size, "prefill_or_head": max(prefill, head),
            "wave_gather": wave(model, dtype, batch, context)["gather_bytes"]}


def wave(model: LoopedLM, dtype: torch.dtype, batch: int, context: int) -> dict[str, int]:
    """What a depth-major wave holds (exitbench.engine.waves): each row's block of positions, and the
    token-mode gather of their keys and values once some have exited (the largest loop-time transient)."""
    block = min(block_positions(model, batch, context, dtype), context)
    return {"block_positions": block, "tokens": batch * block,
            "gather_bytes": block * gather_bytes(model, batch, context, dtype)}
