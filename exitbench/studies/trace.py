"""What the engine decides token by token on one prompt: the report behind `exitbench trace`."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..engine import ExitConfig, ExitEngine
from ..errors import ExitbenchError
from ..models import Checkpoint
from ..models.embedded import recorded_path
from ..runtime.files import atomic_write
from ..runtime.provenance import run_metadata


def trace_prompt(ck: Checkpoint, prompt: str, config: ExitConfig, generate: int = 0,
                 add_bos_token: bool | None = None) -> dict[str, Any]:
    """The prompt encoded as `run` encodes a request (the tokenizer decides BOS unless `add_bos_token` says),
    so a trace shows the tokens a sweep scores, and a generation what the model's own `generate` gives."""
    check_exits(ck, [config])
    tok = ck.tokenizer
    if tok is None:
        raise ExitbenchError(f"{ck.path} has no tokenizer.json, so it cannot read a text prompt")
    ids = tok.encode_as_hf(prompt, add_bos_token)
    if len(ids) < 2 and not generate:
        raise ExitbenchError("the prompt has no token to score; give more text or use --generate N")
    # Signals are kept for the exit map's hover text; recording them changes no exit.
    engine = ExitEngine(ck.model, replace(config, record_signals=True))
    if generate:
        stops = [t for t in (tok.eos_token_id,) if t is not None]
        result = engine.generate([ids], generate, stop_ids=stops)[0]
        inputs = ids[-1:] + result.tokens[:-1]
    else:
        result = engine.score([(ids, 1)])[0]
        inputs = ids[:-1]
    pieces = tok.pieces(result.tokens, previous=inputs[0])  # with their spaces, so the exit map reads as text
    rows = [{"input_id": i, "input": tok.decode([i], skip_special_tokens=False), "next_id": t,
             "next": tok.decode([t], skip_special_tokens=False),
             "text": piece, "logprob": lp, "greedy": g, "exit_steps": r.exit_steps, "signals": r.signals}
            for i, t, piece, lp, g, r in zip(inputs, result.tokens, pieces, result.logprobs, result.greedy,
                                              result.records)]
    # What precedes the first exited token: the prompt when generating, its first token when scoring.
    context = tok.decode(ids if generate else ids[:1], skip_special_tokens=False)
    nonfinite = sum(r.nonfinite for r in result.records)
    window = {"kv_window": config.kv_window} if config.kv_window else {}
    return {"policy": {**engine.policies[0].knobs(), **window}, "mode": "generate" if generate else "score",
            "prompt": prompt, "prompt_ids": ids, "generated_ids": result.tokens if generate else [],
            "generated": tok.decode(result.tokens) if generate else "",
            "loop_groups": [g.name for g in ck.model.loop_groups()], "tokens": rows, "context": context,
            "mean_iterations": sum(result.iterations) / max(1, len(result.iterations)),
            "nonfinite_tokens": nonfinite}


def check_exits(ck: Checkpoint, configs: list[ExitConfig]) -> None:
    """Each rule to trace can exit before full depth on this model: a map of one that cannot shows nothing of it."""
    for config in configs:
        why = config.never_exits_early(ck.model.loop_groups())
        if why is not None:
            raise ExitbenchError(why)


def write_json(reports: list[dict[str, Any]], ck: Checkpoint, path: Path, seed: int) -> Path:
    """The traces as one JSON file, atomically: per policy the prompt's and generated tokens' ids and text, and
    per token its exit step in each loop group, log-probability and the rule's signal at every step (null
    past its exit), with the run's provenance (seed, versions, git revision, machine)."""
    def clean(x: Any) -> Any:  # NaN (steps a token never ran) is not JSON
        if isinstance(x, float):
            return None if math.isnan(x) else x
        if isinstance(x, list):
            return [clean(v) for v in x]
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return x

    doc = {"schema": "exitbench.trace", "version": 1, "checkpoint": recorded_path(ck.path),
           "architecture": ck.model.architecture,
           "run": run_metadata(seed), "traces": clean(reports)}
    return atomic_write(path, lambda f: json.dump(doc, f, indent=1))


def parse_vs(specs: list[str], base: ExitConfig) -> list[ExitConfig]:
    """`--vs POLICY[:τ]` entries as configs: the base config's knobs with another policy (and its own default
    threshold unless τ is given), so the maps drawn side by side differ only in the rule."""
    out = []
    for spec in specs:
        name, _, tau = spec.partition(":")
        try:
            threshold = float(tau) if tau else None
        except ValueError:
            raise ExitbenchError(f"--vs takes POLICY or POLICY:THRESHOLD, got {spec!r}") from None
        out.append(ExitConfig.for_policy(name.strip(), threshold, base.to_dict()))
    return out
