"""Host work per loop step: aten ops per batched loop step of greedy generation, per policy, at batch sizes 1
and 16 (exitbench/engine/opcount.py says what is counted). Counts, not times: the same on any machine.

    python bench/ops.py                       # tiny-raven, the table
    python bench/ops.py --json bench/ops-results.json

Issue 57's targets on tiny-raven (one core layer), every op of the run over its loop steps: fixed depth ≤ 150,
second_order ≤ 200, batch 16 ≤ 1.1 × batch 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exitbench.engine import ExitConfig  # noqa: E402
from exitbench.engine.opcount import chains_prompts, count_generate  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402

POLICIES = {"fixed": None, "second_order": 1e-2, "first_order": 1e-2, "kl": 1e-3, "confidence": 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory or embedded name (tiny-raven)")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per prompt")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ck = open_checkpoint(args.checkpoint)
    rows = []
    print(f"{'policy':13s} {'τ':>7s} {'batch':>5s} {'steps':>5s} {'ops/step':>9s} {'in step':>8s} {'bs16/bs1':>9s}")
    for policy, threshold in POLICIES.items():
        config = ExitConfig(policy=policy, **({"threshold": threshold} if threshold is not None else {}))
        per_batch = {}
        for batch in (1, 16):
            count = count_generate(ck.model, config, chains_prompts(ck.tokenizer, batch), args.tokens)
            per_batch[batch] = count
            ratio = f"{count.per_step / per_batch[1].per_step:9.2f}" if batch == 16 else ""
            print(f"{policy:13s} {threshold if threshold is not None else '':>7} {batch:5d} {count.steps:5d} "
                  f"{count.per_step:9.1f} {count.in_step:8.1f} {ratio}")
            rows.append({"policy": policy, "threshold": threshold, "batch_size": batch, "steps": count.steps,
                         "ops": count.ops, "ops_in_steps": count.in_steps, "ops_per_step": round(count.per_step, 1),
                         "ops_in_step": round(count.in_step, 1)})
    if args.json:
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint or "tiny-raven", "tokens": args.tokens,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
