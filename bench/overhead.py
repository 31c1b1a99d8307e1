"""Each exit policy's overhead at batch size 1: its time ratio to full depth over its FLOP ratio. Ratios from one run.

    python bench/overhead.py                          # both models, 2 documents (about twice --quick's time)
    python bench/overhead.py --quick                  # 1 document (3 min 40 s on 2 shared cores, before issue 45)
    python bench/overhead.py --models tiny-raven --policies kl,second_order --json bench/overhead-results.json

Per model (the embedded tiny-looped-gpt2 and tiny-raven), one torch thread, batch size 1: the rolling perplexity of
the first --docs GSM8K test documents under each policy at its default threshold, after one untimed pass, timed
`--repeats` times paired with full depth (the fixed depth at the policies' max steps), in alternating order, by
the sweep's own retiming (exitbench/harness/retime.py): the median of the paired time ratios, the FLOP ratio of
the same passes (the engine's cost model), and overhead = time ratio ÷ FLOP ratio. A rule whose untimed pass took
over --slow seconds is timed once: its overhead is far from any target, and repeating it would take minutes.
Issue 45's target: overhead ≤ 1.5 for every policy on both models. A rule far above it costs more than its
arithmetic: an implementation defect, not the rule's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.depth_major import gsm8k_texts, rolling  # noqa: E402
from exitbench.engine import ExitConfig  # noqa: E402
from exitbench.harness import retime  # noqa: E402
from exitbench.harness.model import ExitbenchLM  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402
from exitbench.policies import REGISTRY  # noqa: E402
from exitbench.sweep.config import expand_policies  # noqa: E402

MODELS = ("tiny-looped-gpt2", "tiny-raven")
TARGET = 1.5
# The peer-rule conjunction the baseline sweeps (docs/findings.md): a decoding rule gated by another.
CONJUNCTION = {"rules": [{"policy": "margin", "threshold": 0.125}, {"policy": "argmax_stability"}],
               "vary": "argmax_stability"}


def configs(gated: bool, only: list[str] | None) -> dict[str, ExitConfig]:
    """Every rule this model can run without a fitted exit model, at its default threshold (a conjunction at its
    varied member's), by name."""
    out = {}
    for name in expand_policies(["all"]):
        rule = REGISTRY[name]
        if rule.needs_exit_model or (rule.needs_gate and not gated):
            continue
        if rule.takes_rules:
            out["margin 0.125 ∧ argmax_stability"] = ExitConfig.for_policy(
                name, REGISTRY["argmax_stability"].default_threshold, CONJUNCTION)
            continue
        out[name] = ExitConfig.for_policy(name, rule.default_threshold, {})
    return {k: v for k, v in out.items() if not only or k in only or v.policy in only}


def measure(model: str, docs: int, repeats: int, slow: float, only: list[str] | None) -> dict:
    ck = open_checkpoint(model)
    full_depth = ck.model.loop_groups()[0].default_steps
    work = [("loglikelihood_rolling", rolling(gsm8k_texts(docs)))]
    full = ExitbenchLM(ck, exit_config=ExitConfig("fixed", threshold=full_depth), batch_size=1)
    rows = []
    for name, cfg in configs(ck.model.gated, only).items():
        lm = ExitbenchLM(ck, exit_config=cfg, batch_size=1)
        t0 = time.perf_counter()
        retime.timed_pass(lm, work)  # warm: the first pass allocates what the timed ones reuse
        n = 1 if time.perf_counter() - t0 > slow else repeats
        rep = retime.retime(lm, full, work, n, full_depth)
        rows.append({"policy": name, "threshold": cfg.threshold, "repeats": n, "flops_ratio": rep["flops_ratio"],
                     "time_ratio": rep["ratio"], "spread": rep["spread"], "overhead": rep["overhead"],
                     "ms_per_token": 1e3 * min(rep["per_token_s"]),
                     "full_ms_per_token": 1e3 * min(rep["full_per_token_s"]),
                     "passes": rep["overhead"] is not None and rep["overhead"] <= TARGET,
                     "seconds": time.perf_counter() - t0})
        r = rows[-1]
        print(f"  {model:<17} {name:<33} {r['flops_ratio']:>7.3f} {r['time_ratio']:>8.3f} ±{50 * r['spread']:>3.0f}% "
              f"{r['overhead']:>8.2f}  {'pass' if r['passes'] else 'FAIL'}   ({r['ms_per_token']:.3f} vs "
              f"{r['full_ms_per_token']:.3f} ms/token, {n} repeat{'s' if n > 1 else ''})", flush=True)
    return {"full_depth": full_depth, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--policies", default="", help="comma-separated names (default: every rule that runs)")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--slow", type=float, default=2.0, help="seconds of an untimed pass above which a rule is timed "
                    "once")
    ap.add_argument("--quick", action="store_true", help="1 document")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "overhead-results.json")
    args = ap.parse_args()
    if args.quick:
        args.docs = 1
    torch.set_num_threads(1)
    only = [p for p in args.policies.split(",") if p] or None
    print(f"overhead at batch size 1, 1 thread, {args.docs} GSM8K document(s), {args.repeats} paired repeats "
          f"(1 where a pass takes over {args.slow:g} s); target ≤ {TARGET}")
    print(f"  {'model':<17} {'policy':<33} {'FLOPs':>7} {'time':>8} {'':>5} {'overhead':>8}")
    results = {"docs": args.docs, "repeats": args.repeats, "slow_s": args.slow, "threads": 1, "batch_size": 1,
               "target": TARGET, "models": {}}
    for model in args.models.split(","):
        results["models"][model] = measure(model, args.docs, args.repeats, args.slow, only)
    failed = [f"{m} {r['policy']}" for m, res in results["models"].items() for r in res["rows"] if not r["passes"]]
    print(f"target overhead ≤ {TARGET} at batch size 1: "
          + ("every policy passes" if not failed else f"{len(failed)} fail: {', '.join(failed)}"))
    results["failed"] = failed
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
