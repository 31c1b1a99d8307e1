"""How much host work a loop step is: aten ops per batched loop step, counted by torch's profiler.

On a small model a loop step costs the dispatch of its ops, not their arithmetic, so the count is the step's
cost in the unit that matters there, and unlike a time it is the same on every machine and every run: a test can
hold it. Two counts per run: every aten op of the whole `generate` (the prefill, heads, bookkeeping), and those
inside `TokenLoop.step` (the iteration itself, its probe and exits), each divided by the number of loop steps.
The profiler counts nested ops too (an `mm` inside a `linear`), as issue 57's first measurement did.

Where a run's ops go (`OpCount.regions`, bench/ops.py --regions): each op is charged to the innermost of the
engine calls `REGIONS` names that it ran in. Inside a loop step: the places' attention context, the probe (the
rule's signal and decision) and the tokens leaving; what is left of the step is the iteration itself. Outside it:
a generated token's way from its exit to its next token's entry (`finish`: coda, head and picks; `stage` and
`enter`: the next token's inputs, start state and place; `carry`: exited entries copied up), and the prefill.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from torch.profiler import ProfilerActivity, profile, record_function

from ..engine.config import ExitConfig
from ..engine.engine import ExitEngine, Run
from ..engine.loop import TokenLoop

STEP_LABEL = "exitbench.step"
# region → the method whose calls it is
REGIONS = {"step": (TokenLoop, "step"), "context": (TokenLoop, "_context"), "probe": (TokenLoop, "_probe"),
           "leave": (TokenLoop, "_leave"), "carry": (TokenLoop, "carry"), "finish": (Run, "finish"),
           "stage": (Run, "stage"), "enter": (Run, "enter"), "prefill": (Run, "prefill")}


@dataclass(frozen=True)
class OpCount:
    steps: int          # batched loop steps the run took
    ops: int            # aten ops of the whole run
    in_steps: int       # aten ops inside loop steps
    iterations: int = 0  # the generated tokens' iterations, summed (token-iterations the loops ran)
    tokens: int = 0      # generated tokens
    regions: dict[str, int] = field(default_factory=dict)  # REGIONS' name (or "other") → the ops charged to it
    # aten op name → its self CPU time inside loop steps, µs, as the profiler saw it: its per-op overhead inflates
    # every op alike, so this ranks where a step's time goes (an op that moves memory against one that only
    # dispatches), not what a step costs unprofiled; unlike the counts, a machine's own.
    step_self_us: dict[str, float] = field(default_factory=dict)

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
def _labelled(counter: list[int]) -> Iterator[None]:
    """Every call of a REGIONS method inside a profiler range of its label; `counter` counts the loop steps."""
    def labelled(name: str, original):
        label = f"exitbench.{name}"

        def call(self, *args, **kwargs):
            counter[0] += name == "step"
            with record_function(label):
                return original(self, *args, **kwargs)
        return call

    originals = {name: getattr(owner, method) for name, (owner, method) in REGIONS.items()}
    for name, (owner, method) in REGIONS.items():
        setattr(owner, method, labelled(name, originals[name]))
    try:
        yield
    finally:
        for name, (owner, method) in REGIONS.items():
            setattr(owner, method, originals[name])


def _placed(event, labels: dict[str, str]) -> tuple[str, bool]:
    """The innermost labelled call an op ran in (or "other"), and whether it ran inside a loop step."""
    region, parent = None, event.cpu_parent
    while parent is not None:
        if parent.name in labels:
            region = region or labels[parent.name]
            if parent.name == STEP_LABEL:
                return region, True
        parent = parent.cpu_parent
    return region or "other", False


def count_generate(model, config: ExitConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   batch_size: int | None = None) -> OpCount:
    """Ops of greedy generation of `max_new_tokens` after each prompt, `batch_size` rows (default: all prompts in
    one batch), after one untimed warm-up (first calls build tables and views that later ones reuse)."""
    engine = ExitEngine(model, config)
    engine.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    counter = [0]
    with _labelled(counter), profile(activities=[ProfilerActivity.CPU]) as prof:
        results = engine.generate(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    labels = {f"exitbench.{name}": name for name in REGIONS}
    regions: dict[str, int] = {}
    step_self_us: dict[str, float] = {}
    ops = inside = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        ops += 1
        region, in_step = _placed(event, labels)
        inside += in_step
        regions[region] = regions.get(region, 0) + 1
        if in_step:
            step_self_us[event.name] = step_self_us.get(event.name, 0.0) + event.self_cpu_time_total
    return OpCount(counter[0], ops, inside, sum(sum(r.iterations) for r in results),
                   sum(len(r.iterations) for r in results), regions, step_self_us)


def chains_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n programs of the shipped chains task, tokenized as the harness does (with BOS): prompts of
    several lengths, so a batch's rows sit at different positions, as an lm-eval task's do."""
    import json

    from .task_set import SHIPPED_TASKS

    with open(SHIPPED_TASKS / "chains" / "test.jsonl") as f:
        docs = [json.loads(line) for _, line in zip(range(n), f)]
    return [tokenizer.encode(doc["prompt"], add_bos=True) for doc in docs]
