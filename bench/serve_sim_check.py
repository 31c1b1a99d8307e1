"""`exitbench serve-sim` checked against the engine it projects: tiny-raven decoding the chains task's prompts at
batch 16, the engine timed, and the same requests' recorded exits replayed through the simulation with the cost
file measured on this machine (python bench/serving_cost.py --out FILE).

    python bench/serving_cost.py --out /tmp/cost.json && python bench/serve_sim_check.py --cost /tmp/cost.json

Per cell: the engine's measured seconds; the simulation of the engine's own scheduler (exitbench's: exited
tokens finished together once they are as many as the tokens still looping, a finished request's row refilled
at the next tick) and its error; the simulated static and continuous times; and the engine's speed-up over full
depth (both measured) as a share of the ideal, the iteration ratio: the figure the engine work aims at.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exitbench.analysis.serving import ENGINE, Cost, Request, simulate  # noqa: E402
from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.engine.opcount import chains_prompts  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

CELLS = [("fixed", 16), ("second_order", 0.01), ("second_order", 1.0), ("kl", 1e-3), ("confidence", 0.5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", type=Path, required=True, help="a cost file measured on this machine")
    ap.add_argument("--requests", type=int, default=96, help="chains prompts decoded (the first ones)")
    ap.add_argument("--tokens", type=int, default=2, help="new tokens per prompt (the task's max_gen_toks)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cost = Cost.read(args.cost)
    ck = open_checkpoint("tiny-raven")
    prompts = chains_prompts(ck.tokenizer, args.requests)
    rows = []
    for policy, threshold in CELLS:
        engine = ExitEngine(ck.model, ExitConfig(policy, threshold=threshold))
        engine.generate(prompts[: args.batch_size], max_new_tokens=1, batch_size=args.batch_size)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results = engine.generate(prompts, max_new_tokens=args.tokens, batch_size=args.batch_size)
            times.append(time.perf_counter() - t0)
        requests = [Request(r.records[0].position, [sum(x.exit_steps) for x in r.records]) for r in results]
        K = engine.policies[0].max_steps
        iterations = sum(sum(r.iterations) for r in requests)
        tokens = sum(len(r.iterations) for r in requests)
        sims = {s: simulate(requests, args.batch_size, s, cost, K) for s in (ENGINE, "static", "continuous", "full")}
        rows.append({"policy": policy, "threshold": threshold, "mean_iterations": iterations / tokens,
                     "engine_s": statistics.median(times), "ideal": K * tokens / iterations,
                     **{f"sim_{s}_s": v for s, v in sims.items()}})
    full = rows[0]["engine_s"]
    print(f"{'cell':22s} {'iters':>6s} {'engine s':>9s} {'sim engine':>10s} {'error':>6s} {'sim static':>10s} "
          f"{'sim cont.':>9s} {'engine ×':>8s} {'ideal':>6s} {'share':>6s}")
    for r in rows:
        r["sim_error"] = r[f"sim_{ENGINE}_s"] / r["engine_s"] - 1
        r["engine_speedup"] = full / r["engine_s"]
        r["engine_share_of_ideal"] = r["engine_speedup"] / r["ideal"]
        print(f"{r['policy'] + ' ' + format(r['threshold'], 'g'):22s} {r['mean_iterations']:6.2f} "
              f"{r['engine_s']:9.3f} {r[f'sim_{ENGINE}_s']:10.3f} {100 * r['sim_error']:+5.0f}% "
              f"{r['sim_static_s']:10.3f} {r['sim_continuous_s']:9.3f} {r['engine_speedup']:7.2f}× "
              f"{r['ideal']:5.2f}× {100 * r['engine_share_of_ideal']:5.0f}%")
    print(f"cost model: {cost.source}")
    if args.json:
        args.json.write_text(json.dumps({"cost": cost.to_dict(), "requests": args.requests,
                                         "batch_size": args.batch_size, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
