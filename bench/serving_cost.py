"""Measure the cost model `exitbench serve-sim` replays exit schedules with, from the engine's own timings.

    python bench/serving_cost.py                               # tiny-raven on this machine: print the fit
    python bench/serving_cost.py --out exitbench/analysis/serving_cost.json    # the packaged default

Three fits, each a fixed part and a part per unit (exitbench/analysis/serving.py says what each prices):
- a loop step with b rows and the exit event of b tokens: the engine decodes b chains prompts at fixed depths
  r = 4 and r = 16 (b = 1, 2, 4, 8, 16); per batched token (the difference of a long and a one-token run, so the
  prefill cancels) that is r · step(b) + event(b), and the two depths separate the two;
- a prefill of T prompt tokens: a one-token run of b = 1, 4, 16 prompts cut to L tokens each (T = b·L), less
  that token's steps and event.
Times are medians of --repeats runs on one torch thread; a least-squares line through each. On a model whose
step is host work (the embedded ones on a CPU) the per-row parts come out near zero: that is the finding, and
why static batching loses little there. For a GPU figure, run it there with --device cuda --checkpoint DIR.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exitbench.analysis.serving import ENGINE, Cost, Request, simulate  # noqa: E402
from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.engine.opcount import chains_prompts  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
DEPTHS = (4, 16)
LENGTHS = (8, 16, 32, 48)
# thresholds each rule never meets (a change below 1e-30, a probability above 1 − 1e-12): it probes every step
NEVER = {"second_order": 1e-30, "first_order": 1e-30, "kl": 1e-30, "confidence": 1 - 1e-12}  # chains prompts run to 49 tokens


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(engine: ExitEngine, prompts, tokens: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.generate(prompts, max_new_tokens=tokens, batch_size=len(prompts))
    sync(device)
    return time.perf_counter() - t0


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def measure(model, tokenizer, device: str, tokens: int, repeats: int) -> dict:
    prompts = chains_prompts(tokenizer, max(BATCHES))
    engines = {r: ExitEngine(model, ExitConfig("fixed", threshold=r)) for r in DEPTHS}
    per_token: dict[tuple[int, int], float] = {}
    for r, engine in engines.items():
        for b in BATCHES:
            rows = prompts[:b]
            timed(engine, rows, 2, device)  # warm-up
            runs = [(timed(engine, rows, tokens + 1, device) - timed(engine, rows, 1, device)) / tokens
                    for _ in range(repeats)]
            per_token[(r, b)] = statistics.median(runs)
    lo, hi = DEPTHS
    step = {b: (per_token[(hi, b)] - per_token[(lo, b)]) / (hi - lo) for b in BATCHES}
    event = {b: per_token[(hi, b)] - hi * step[b] for b in BATCHES}
    step_s, row_s = line([(b, step[b]) for b in BATCHES])
    exit_s, exit_row_s = line([(b, event[b]) for b in BATCHES])
    long_ones = sorted(prompts, key=len)[-max(BATCHES):]
    prefills = []
    for b in (1, 4, 16):
        for length in LENGTHS:
            rows = [p[:length] for p in long_ones[:b]]  # b prompts of one length: b·length tokens prefilled
            runs = [timed(engines[hi], rows, 1, device) for _ in range(repeats)]
            prefills.append((b * length, statistics.median(runs) - hi * step[b] - event[b]))
    prefill_s, prefill_token_s = line(prefills)
    # each rule's probe: its signal on every step, at a threshold it never meets, so every token runs r = 16
    probes = {}
    for policy, never in NEVER.items():
        engine = ExitEngine(model, ExitConfig(policy, threshold=never, max_steps=hi))
        ruled = {}
        for b in BATCHES:
            rows = prompts[:b]
            timed(engine, rows, 2, device)
            runs = [(timed(engine, rows, tokens + 1, device) - timed(engine, rows, 1, device)) / tokens
                    for _ in range(repeats)]
            ruled[b] = (statistics.median(runs) - event[b]) / hi - step[b]  # what the rule adds to a step
        probes[policy] = [max(v, 0.0) for v in line([(b, ruled[b]) for b in BATCHES])]
    fit = {"step_s": max(step_s, 0.0), "row_s": max(row_s, 0.0), "exit_s": max(exit_s, 0.0),
            "exit_row_s": max(exit_row_s, 0.0), "prefill_s": max(prefill_s, 0.0),
            "prefill_token_s": max(prefill_token_s, 0.0), "probes": probes,
            "points": {"step_by_rows": step, "event_by_tokens": event,
                       "prefill_by_tokens": prefills}}
    fit["leave_s"] = calibrate_leaving(model, tokenizer, device, repeats, fit)
    return fit


def calibrate_leaving(model, tokenizer, device: str, repeats: int, fit: dict) -> float:
    """What a loop step at which tokens exit costs beyond its step: second_order (τ 0.01) decoding requests the
    serve-sim check never times (the chains prompts after its first 96), the engine's time against the
    simulation of its own scheduler without that cost, over the steps at which tokens exited."""
    prompts = chains_prompts(tokenizer, 160)[96:]
    engine = ExitEngine(model, ExitConfig("second_order", threshold=0.01))
    engine.generate(prompts[:16], max_new_tokens=1, batch_size=16)
    runs, results = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = engine.generate(prompts, max_new_tokens=2, batch_size=16)
        sync(device)
        runs.append(time.perf_counter() - t0)
    requests = [Request(r.records[0].position, [sum(x.exit_steps) for x in r.records]) for r in results]
    cost = Cost(**{k: v for k, v in fit.items() if k not in ("points",)}, source="calibration")
    cost = cost.for_policy("second_order")
    without = simulate(requests, 16, ENGINE, cost, engine.policies[0].max_steps)
    per_tick = simulate(requests, 16, ENGINE, replace(cost, leave_s=1.0), engine.policies[0].max_steps) - without
    return max((statistics.median(runs) - without) / per_tick, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory or embedded name [tiny-raven]")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=6, help="decoded tokens per timed run, past the first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the cost file here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = open_checkpoint(args.checkpoint, device=args.device)
    fit = measure(ck.model, ck.tokenizer, args.device, args.tokens, args.repeats)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    fit["source"] = (f"bench/serving_cost.py on {args.checkpoint or 'tiny-raven'}, {args.device} ({machine}, "
                     f"{args.threads} thread{'s' if args.threads > 1 else ''}), {date.today().isoformat()}")
    for name in ("step_s", "row_s", "exit_s", "exit_row_s", "prefill_s", "prefill_token_s", "leave_s"):
        print(f"{name:16s} {fit[name] * 1e6:10.1f} µs")
    for policy, (fixed, per_row) in fit["probes"].items():
        print(f"probe {policy:12s} {fixed * 1e6:8.1f} µs + {per_row * 1e6:6.1f} µs per row")
    print(f"source: {fit['source']}")
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(fit, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
