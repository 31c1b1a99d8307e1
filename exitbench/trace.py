"""What the engine decides token by token on one prompt: the report behind `exitbench trace`."""
from __future__ import annotations

from typing import Any

from .engine import ExitConfig, ExitEngine
from .errors import ExitbenchError
from .models import Checkpoint


def trace_prompt(ck: Checkpoint, prompt: str, config: ExitConfig, generate: int = 0) -> dict[str, Any]:
    tok = ck.tokenizer
    if tok is None:
        raise ExitbenchError(f"{ck.path} has no tokenizer.json, so it cannot read a text prompt")
    ids = tok.encode(prompt, add_bos=True)
    if len(ids) < 2 and not generate:
        raise ExitbenchError("the prompt has no token to score; give more text or use --generate N")
    engine = ExitEngine(ck.model, config)
    if generate:
        stops = [t for t in (tok.eos_token_id,) if t is not None]
        result = engine.generate([ids], generate, stop_ids=stops)[0]
        inputs = ids[-1:] + result.tokens[:-1]
    else:
        result = engine.score([(ids, 1)])[0]
        inputs = ids[:-1]
    rows = [{"input": tok.decode([i], skip_special_tokens=False), "next": tok.decode([t], skip_special_tokens=False),
             "logprob": lp, "greedy": g, "exit_steps": r.exit_steps}
            for i, t, lp, g, r in zip(inputs, result.tokens, result.logprobs, result.greedy, result.records)]
    return {"policy": engine.policies[0].knobs(), "mode": "generate" if generate else "score", "tokens": rows,
            "mean_iterations": sum(result.iterations) / max(1, len(result.iterations))}
