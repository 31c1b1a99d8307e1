"""The engine's throughput on a stream of requests, as a share of the FLOP bound (issue 69).

Greedy generation of `--tokens` new tokens after each of `--requests` chains programs (drawn evenly across the
task), at batch sizes 16 and 64, under full depth and each rule: every config runs the same stream, in turns,
`--repeats` times. A config's time per token is the engine's steady-state clock (docs/engine.md, two clocks): its
wall-clock, prefills left out, while the queue still held requests, per token at the config's iterations per
token. Its speed-up is full depth's time per token ÷ its own, paired repeat by repeat (the median of the
repeats, their range beside it); the FLOP bound is full depth's FLOPs per token ÷ its own (the engine's cost
model); the share is speed-up ÷ bound: 1 when a rule saves time in proportion to its arithmetic.

    python bench/throughput.py                         # tiny-raven, batch 16 and 64, the table
    python bench/throughput.py --json bench/throughput-results.json
    python bench/throughput.py --width 1024            # a random Raven 1024 wide, 4 core layers: arithmetic rules

On tiny-raven a loop step is host work (dispatch), on the wide model arithmetic: the same engine, the two regimes a
schedule meets. The wide model's weights are random, so its rules' thresholds are the ones that halve full depth's
iterations on the stream (as bench/engine.py chooses them), not the embedded model's grid.

Each rule runs under `--refill continuous` (continuous depth batching, the engine's default) and under `wave`
(static batching: a batch waits for its slowest row), so the table shows what the schedule buys. `--reads` runs
the continuous configs once per way their places read keys: `auto` (the engine's switch, `cache.IN_PLACE_FROM`),
`gather` (always copied into one tensor) or `in_place` (always read where they lie); static batching's rows read
slices of the store whatever it says.

    python bench/throughput.py --width 512 --reads auto,gather   # what reading keys in place buys
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.harness.task_set import SHIPPED_TASKS  # noqa: E402
from exitbench.models import cache as cache_module  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

RULES = [("second_order", 0.01), ("second_order", 0.316), ("first_order", 0.01), ("kl", 1e-3)]
# The bytes per place and layer from which places read their keys in place, per --reads value.
READS = {"auto": cache_module.IN_PLACE_FROM, "gather": float("inf"), "in_place": 0}


def wide(ck, width: int, prompts: list[list[int]]):
    """bench/engine.py's random Raven `width` wide and each rule's threshold there: the one whose mean iterations
    come nearest half of full depth's on these prompts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).parent / "engine.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    model = helpers.wide_model(ck.model.config, width)
    work = [(p + [5, 6], len(p)) for p in prompts[:32]]
    K = model.loop_groups()[0].default_steps
    rules = [(policy, helpers.half_depth_threshold(model, policy, False, work, K, coarse=True))
             for policy in dict.fromkeys(p for p, _ in RULES)]
    return model, rules


def stream(tokenizer, n: int) -> list[list[int]]:
    """`n` chains programs drawn evenly across the task (its documents run from one hop to twelve)."""
    with open(SHIPPED_TASKS / "chains" / "test.jsonl") as f:
        docs = [json.loads(line) for line in f]
    picked = [docs[int(i * len(docs) / n)] for i in range(n)]
    return [tokenizer.encode(doc["prompt"], add_bos=True) for doc in picked]


def steady(engine: ExitEngine) -> float | None:
    """Seconds per token in the steady state of the engine's last run (its stats reset before it)."""
    s = engine.stats
    if not s["steady_work"] or not s["steady_tokens"]:
        return None
    return s["steady_s"] * (s["steady_token_iterations"] / s["steady_tokens"]) / s["steady_work"]


def run(engine: ExitEngine, prompts: list[list[int]], tokens: int, batch: int, reads: str = "auto"
        ) -> tuple[float | None, float, float]:
    """(steady seconds per token, FLOPs per token, mean iterations) of one pass, its places reading keys as
    `reads` says."""
    cache_module.IN_PLACE_FROM = READS[reads]
    engine.stats = dict.fromkeys(engine.stats, 0.0)
    results = engine.generate(prompts, tokens, batch_size=batch)
    records = [r for res in results for r in res.records]
    flops = sum(r.flops["total"] for r in records) / len(records)
    return steady(engine), flops, sum(sum(r.exit_steps) for r in records) / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory or embedded name (tiny-raven)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the stream (at least 64)")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per request")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--refills", default="continuous,wave")
    parser.add_argument("--reads", default="auto", help=f"how continuous places read keys: any of {', '.join(READS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=None, help="a random Raven this wide instead (see above)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the loop steps (torch.compile, as run --compile), every config alike")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ck = open_checkpoint(args.checkpoint)
    prompts = stream(ck.tokenizer, args.requests)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    refills = args.refills.split(",")
    model, rules = (ck.model, RULES) if args.width is None else wide(ck, args.width, prompts)
    if args.compile:
        model.compile_loops()
    reads = args.reads.split(",")
    if unknown := [r for r in reads if r not in READS]:
        parser.error(f"--reads {unknown[0]!r}: the ways are {', '.join(READS)}")
    configs = [("fixed", None, "wave", "auto")] + [(p, t, r, way) for p, t in rules for r in refills
                                                   for way in (reads if r == "continuous" else ["auto"])]
    rows = []
    print(f"{'policy':13s} {'τ':>6s} {'refill':>10s} {'reads':>8s} {'batch':>5s} {'iters':>6s} {'ms/token':>9s} "
          f"{'speed-up':>18s} {'FLOP bound':>10s} {'share':>6s}")
    for batch in batches:
        engines = [ExitEngine(model, ExitConfig(policy=p, refill=r, **({"threshold": t} if t else {})))
                   for p, t, r, _ in configs]
        for engine, (*_, way) in zip(engines, configs):  # warm-up: tables and views the first calls build
            # (compiled: the whole stream once, so every graph a pass needs, its dynamic-shape ones included, exists
            # before the timing)
            run(engine, *((prompts, args.tokens) if args.compile else (prompts[:batch], 2)), batch, way)
        times: list[list[float | None]] = [[] for _ in configs]
        flops, iters = [0.0] * len(configs), [0.0] * len(configs)
        for _ in range(args.repeats):
            for i, (engine, (*_, way)) in enumerate(zip(engines, configs)):
                t, flops[i], iters[i] = run(engine, prompts, args.tokens, batch, way)
                times[i].append(t)
        for i, (p, t, r, way) in enumerate(configs):
            ratios = [f / c for f, c in zip(times[0], times[i]) if f and c]
            speedup = statistics.median(ratios) if ratios else None
            bound = flops[0] / flops[i]
            share = speedup / bound if speedup else None
            ms = statistics.median([x for x in times[i] if x]) * 1e3
            shown = f"{speedup:.2f}× ({min(ratios):.2f}–{max(ratios):.2f})" if speedup else "-"
            print(f"{p:13s} {f'{t:.3g}' if t else '':>6} {r:>10s} {way:>8s} {batch:5d} {iters[i]:6.2f} {ms:9.3f} "
                  f"{shown:>18s} {bound:9.2f}× {share if share else 0:6.2f}")
            rows.append({"policy": p, "threshold": t, "refill": r, "reads": way, "batch_size": batch,
                         "iterations": iters[i], "ms_per_token": ms, "speedup": speedup,
                         "speedup_range": [min(ratios), max(ratios)], "flop_bound": bound, "share": share})
    if args.json:
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint or "tiny-raven", "width": args.width,
                                         "compiled": args.compile, "reads": reads,
                                         "requests": args.requests,
                                         "tokens": args.tokens, "repeats": args.repeats, "rows": rows}, indent=1)
                             + "\n")


if __name__ == "__main__":
    main()
