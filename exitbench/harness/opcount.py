"""How much host work a loop step is: aten ops per batched loop step, counted by torch's profiler.

On a small model a loop step costs the dispatch of its ops, not their arithmetic, so the count is the step's
cost in the unit that matters there, and unlike a time it is the same on every machine and every run: a test can
hold it. Two counts per run: every aten op of the whole `generate` (the prefill, heads, bookkeeping), and those
inside `TokenLoop.step` (the iteration itself, its probe and exits), each divided by the number of loop steps.
The profiler counts nested ops too (an `mm` inside a `linear`), as issue 57's first measurement did.
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from torch.profiler import ProfilerActivity, profile, record_function

from ..engine import loop as loop_module
from ..engine.config import ExitConfig
from ..engine.engine import ExitEngine

STEP_LABEL = "exitbench.loop_step"


@dataclass(frozen=True)
class OpCount:
    steps: int          # batched loop steps the run took
    ops: int            # aten ops of the whole run
    in_steps: int       # aten ops inside loop steps
    iterations: int = 0  # the generated tokens' iterations, summed (token-iterations the loops ran)

    @property
    def per_step(self) -> float:
        return self.ops / self.steps

    @property
    def per_iteration(self) -> float:
        """Ops per token-iteration: a batched step's ops shared by the tokens it advanced (the measure that
        compares a schedule whose steps hold many tokens with one whose steps hold few)."""
        return self.ops / self.iterations

    @property
    def in_step(self) -> float:
        return self.in_steps / self.steps


@contextmanager
def _labelled_steps(counter: list[int]) -> Iterator[None]:
    original = loop_module.TokenLoop.step

    def step(self, cache):
        counter[0] += 1
        with record_function(STEP_LABEL):
            return original(self, cache)

    loop_module.TokenLoop.step = step
    try:
        yield
    finally:
        loop_module.TokenLoop.step = original


def count_generate(model, config: ExitConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   batch_size: int | None = None) -> OpCount:
    """Ops of greedy generation of `max_new_tokens` after each prompt, `batch_size` rows (default: all prompts in
    one batch), after one untimed warm-up (first calls build tables and views that later ones reuse)."""
    engine = ExitEngine(model, config)
    engine.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    counter = [0]
    with _labelled_steps(counter), profile(activities=[ProfilerActivity.CPU]) as prof:
        results = engine.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_LABEL)
    starts = [s for s, _ in spans]
    ops = inside = 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        ops += 1
        i = bisect.bisect_right(starts, event.time_range.start) - 1
        inside += i >= 0 and event.time_range.end <= spans[i][1]
    return OpCount(counter[0], ops, inside, sum(sum(r.iterations) for r in results))


def chains_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n programs of the shipped chains task, tokenized as the harness does (with BOS): prompts of
    several lengths, so a batch's rows sit at different positions, as an lm-eval task's do."""
    import json

    from .task_set import SHIPPED_TASKS

    with open(SHIPPED_TASKS / "chains" / "test.jsonl") as f:
        docs = [json.loads(line) for _, line in zip(range(n), f)]
    return [tokenizer.encode(doc["prompt"], add_bos=True) for doc in docs]
