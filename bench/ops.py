"""Host work per loop step: aten ops per batched loop step of greedy generation, per policy (exitbench/harness/
opcount.py says what is counted). Counts, not times: the same on every run; inside loop steps the same at any
thread count, outside them a few ops follow torch's threads (a batch-16 prefill: 2,125 ops on one, 2,173 on two).

    python bench/ops.py                       # tiny-raven, the table
    python bench/ops.py --json bench/ops-results.json

Three runs per policy: batch 1; batch 16 under static batching (`--refill wave`: a batch of 16 prompts, every
row's tokens in lockstep while none has exited), where issue 57 asked that a step cost at most 1.1 × a step at
batch 1; and continuous depth batching (the default refill) on a stream of 64 prompts at batch 16, where a step
also hands the places of exited tokens to waiting ones. Steps of different schedules hold different numbers of
tokens, so the last column is what compares them: ops per token-iteration, a run's ops over the iterations its
tokens ran. Targets: fixed depth ≤ 150 ops per step and second_order ≤ 200 at batch 1 (issues 57 and 69).

    python bench/ops.py --regions             # also: where each run's ops go

`--regions` splits each run's ops by the engine call they ran in (exitbench/harness/opcount.py, REGIONS): per
loop step, the iteration itself, the places' context, the probe and the tokens leaving; per generated token,
the way out and back in (finish, stage, enter, carry) and what lies outside every region named. The prefill is
left out: the clocks leave it out too.

    python bench/ops.py --times 8 --threads 1  # also: which ops a loop step's time goes to

`--times N` ranks each run's ops by their self CPU time inside loop steps, as the profiler saw it (its overhead
per op inflates every op alike, so it ranks; it does not time a step). Ops count dispatches; this tells an op
that moves memory (a gather of each place's keys) from one that only dispatches (a view).

    python bench/ops.py --padding             # also: how many of the keys a place gathers it reads

`--padding`, for each stream run (continuous depth batching): per step of fixed places, the keys every place
gathers (the context's read length, which grows by doubling), the longest place's read and the mean place's (its
position + 1; free places left out). Attention hides the rest behind each place's mask, so the gap between the
first and the last is copied and attended for nothing; the gap between the first and the second is what the
doubling costs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from exitbench.engine import ExitConfig  # noqa: E402
from exitbench.harness.opcount import chains_prompts, count_generate  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

POLICIES = {"fixed": None, "second_order": 1e-2, "first_order": 1e-2, "kl": 1e-3, "confidence": 0.5}
# (label, batch size, prompts, refill)
RUNS = [("bs1", 1, 1, None), ("bs16 static", 16, 16, "wave"), ("bs16 stream", 16, 64, None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory or embedded name (tiny-raven)")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per prompt")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--regions", action="store_true", help="also print where each run's ops go")
    parser.add_argument("--times", type=int, default=0, metavar="N",
                        help="also print each run's N aten ops of most self CPU time per loop step (profiled: a "
                             "ranking, not a clock; set --threads 1 to read it steadily)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--padding", action="store_true",
                        help="also print, for each stream run, the keys a place gathers against those it reads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ck = open_checkpoint(args.checkpoint)
    rows = []
    times = {}
    print(f"{'policy':13s} {'τ':>7s} {'run':>12s} {'steps':>5s} {'ops/step':>9s} {'in step':>8s} {'vs bs1':>7s} "
          f"{'ops/token-it':>12s}")
    for policy, threshold in POLICIES.items():
        per_step = {}
        for label, batch, n_prompts, refill in RUNS:
            config = rule(policy, threshold, refill)
            count = count_generate(ck.model, config, chains_prompts(ck.tokenizer, n_prompts), args.tokens, batch)
            per_step[label] = count.per_step
            ratio = f"{count.per_step / per_step['bs1']:7.2f}" if label != "bs1" else ""
            print(f"{policy:13s} {threshold if threshold is not None else '':>7} {label:>12s} {count.steps:5d} "
                  f"{count.per_step:9.1f} {count.in_step:8.1f} {ratio:>7s} {count.per_iteration:12.1f}")
            rows.append({"policy": policy, "threshold": threshold, "run": label, "batch_size": batch,
                         "prompts": n_prompts, "refill": refill or "continuous", "steps": count.steps,
                         "ops": count.ops, "ops_in_steps": count.in_steps, "iterations": count.iterations,
                         "ops_per_step": round(count.per_step, 1), "ops_in_step": round(count.in_step, 1),
                         "ops_per_token_iteration": round(count.per_iteration, 2), "tokens": count.tokens,
                         "regions": count.regions})
            times[(policy, label)] = (count.step_self_us, count.steps)
    if args.regions:
        print_regions(rows)
    if args.times:
        print_times(times, args.times)
    if args.padding:
        print_padding(ck, args.tokens)
    if args.json:
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint or "tiny-raven", "tokens": args.tokens,
                                         "rows": rows}, indent=1) + "\n")


def rule(policy: str, threshold: float | None, refill: str | None = None) -> ExitConfig:
    """The policy at its threshold (None: its default) under `refill` (None: the engine's default, continuous)."""
    return ExitConfig(policy=policy, **({"threshold": threshold} if threshold is not None else {}),
                      **({"refill": refill} if refill else {}))


def print_padding(ck, tokens: int) -> None:
    """For each stream run (continuous depth batching), the keys a place gathers against those it reads."""
    print(f"\n{'policy':13s} {'run':>12s} {'steps':>5s} {'gathered':>8s} {'longest':>8s} {'mean':>6s} {'padding':>8s}")
    for policy, threshold in POLICIES.items():
        for label, batch, n_prompts, refill in RUNS:
            if refill is not None or batch == 1:
                continue
            got = padding(ck.model, rule(policy, threshold), chains_prompts(ck.tokenizer, n_prompts), tokens, batch)
            if got is None:  # (fixed depth: its tokens leave together, so static batching runs it)
                print(f"{policy:13s} {label:>12s}     0  no step of fixed places")
                continue
            steps, gathered, longest, mean = got
            print(f"{policy:13s} {label:>12s} {steps:5d} {gathered:8.1f} {longest:8.1f} {mean:6.1f} "
                  f"{1 - mean / gathered:8.0%}")


def padding(model, config: ExitConfig, prompts: list[list[int]], tokens: int, batch: int):
    """(steps, and per step of fixed places the mean of: the keys each place gathers, the longest place's read, the
    mean place's read), reads counted as position + 1 over the places that hold a token; None where no step ran
    with fixed places."""
    from exitbench.engine import ExitEngine, places

    seen = []
    original = places.PlaceContext.context

    def context(self):
        ctx = original(self)
        held = [read for read, write in zip(self.reads, self.writes) if write != self.trash]
        if held:
            seen.append((self.length, max(held) + 1, sum(held) / len(held) + 1))
        return ctx

    places.PlaceContext.context = context
    try:
        ExitEngine(model, config).generate(prompts, max_new_tokens=tokens, batch_size=batch)
    finally:
        places.PlaceContext.context = original
    return (len(seen), *(sum(column) / len(seen) for column in zip(*seen))) if seen else None


PER_STEP = ["step", "context", "probe", "leave"]
PER_TOKEN = ["finish", "stage", "enter", "carry", "other"]


def print_regions(rows: list[dict]) -> None:
    """Each run's ops by region: those of a loop step per step, the rest per generated token."""
    print(f"\n{'policy':13s} {'run':>12s} | per step: " + " ".join(f"{r:>8s}" for r in [*PER_STEP, "sum"])
          + " | per token: " + " ".join(f"{r:>7s}" for r in [*PER_TOKEN, "sum"]))
    for row in rows:
        regions = row["regions"]
        step = [regions.get(r, 0) / row["steps"] for r in PER_STEP]
        token = [regions.get(r, 0) / row["tokens"] for r in PER_TOKEN]
        print(f"{row['policy']:13s} {row['run']:>12s} | {'':10s}" + " ".join(f"{v:8.1f}" for v in [*step, sum(step)])
              + f" | {'':11s}" + " ".join(f"{v:7.1f}" for v in [*token, sum(token)]))


def print_times(times: dict, n: int) -> None:
    """Each run's n ops of most self CPU time per loop step, and the step's whole self time."""
    for (policy, label), (by_op, steps) in times.items():
        total = sum(by_op.values()) / steps
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:n]
        print(f"\n{policy} {label}: {total:.0f} µs of self CPU time per loop step (profiled)")
        for name, us in top:
            print(f"  {name.removeprefix('aten::'):42s} {us / steps:8.1f} µs  {100 * us / steps / total:5.1f}%")


if __name__ == "__main__":
    main()
