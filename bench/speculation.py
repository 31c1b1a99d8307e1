"""Depth speculation against full depth on the embedded models: what a draft saves in time, and what it costs in
loop iterations, each speculation timed beside full depth decoded through the same passes (DepthSpeculator with
k = 0: one full-depth pass a token), alternating, on one torch thread.

    python bench/speculation.py [--repeats 5] [--new 32] [--json bench/speculation-results.json]

For each model and (draft depth, k): drafts kept per round, loop iterations per token (drafts and verification
counted; full depth's is its depth), and the speed-up: full depth's time ÷ speculation's, the median of the
paired repeats with their range. Every continuation is checked equal to full depth's before it is timed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from exitbench.engine.speculation import DepthSpeculator
from exitbench.models.checkpoint import open_checkpoint

PROMPTS = ("a=3 b=a c=b d=c. d?", "x=7 y=x. y?", "q=2 r=q s=r t=s u=t. u?", "m=5 n=m o=n. o?")
PLAN = {"tiny-raven": [(1, 4), (4, 4), (4, 8), (8, 4)], "tiny-looped-gpt2": [(1, 4), (2, 4), (2, 8)],
        "tiny-ouro": [(1, 4), (1, 8), (4, 4)]}


def timed(spec: DepthSpeculator, prompts, new: int):
    t0 = time.perf_counter()
    out = spec.generate(prompts, max_new_tokens=new)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, plan in PLAN.items():
        ck = open_checkpoint(name)
        prompts = [ck.tokenizer.encode(p) for p in PROMPTS]
        full = DepthSpeculator(ck.model, 1, 0)
        _, want = timed(full, prompts, args.new)  # (also warms the caches of shapes)
        for draft, k in plan:
            spec = DepthSpeculator(ck.model, draft, k)
            _, got = timed(spec, prompts, args.new)
            assert [g.tokens for g in got] == [w.tokens for w in want], (name, draft, k)
            ratios = []
            for r in range(args.repeats):  # alternate which goes first: a drift of the machine hits both
                pair = [full, spec] if r % 2 == 0 else [spec, full]
                times = {id(s): timed(s, prompts, args.new)[0] for s in pair}
                ratios.append(times[id(full)] / times[id(spec)])
            kept = [a for g in got for a in g.accepted]
            row = {"model": name, "full_depth": sum(ck.model.resolve_steps(None)), "draft": draft, "k": k,
                   "kept_per_round": sum(kept) / len(kept),
                   "iterations_per_token": statistics.mean(g.iterations_per_token for g in got),
                   "speedup": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
            rows.append(row)
            print(f"{name:17} full {row['full_depth']:3}  draft {draft} k {k}  kept/round {row['kept_per_round']:.2f}"
                  f"  iterations/token {row['iterations_per_token']:5.1f}  speed-up {row['speedup']:.2f}× "
                  f"({min(ratios):.2f}–{max(ratios):.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "new_tokens": args.new, "prompts": PROMPTS,
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
