"""The noise floor of `exitbench run`'s paired repeated timings (exitbench/timing/retime.py) on this machine.

Full depth is paired with itself (a ratio that should be 1) and with a shallower fixed depth, `--trials` times
over each sample size, each trial `--repeats` alternating repeats as a sweep runs them. It prints each
trial's median ratio and spread (range over median): the spread of the self-pairing is what this machine
adds to any ratio, and what `trust.UNRELIABLE_SPREAD` must stay above for the warning to mean something.

    python bench/timing_noise.py --limit 64 --sizes 16,64 --trials 5
"""
from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="default: the embedded tiny-raven")
    ap.add_argument("--task", default="chains")
    ap.add_argument("--limit", type=int, default=64, help="documents evaluated to collect the requests")
    ap.add_argument("--sizes", default="16,64", help="requests per repeat, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per trial (exitbench run's default)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--shallow", type=int, default=4, help="the fixed depth paired with full depth")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import lm_eval

    from exitbench.engine import ExitConfig
    from exitbench.timing import retime
    from exitbench.harness.model import ExitbenchLM
    from exitbench.harness.quiet import lm_eval_output
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.models.checkpoint import open_checkpoint

    ck = open_checkpoint(args.checkpoint, "auto", "cpu")
    full_depth = ck.model.loop_groups()[0].default_steps
    tasks = resolve_tasks([args.task], None, [])
    models = {name: ExitbenchLM(ck, exit_config=ExitConfig.fixed_depth(depth, {}), batch_size=16)
              for name, depth in (("full", full_depth), ("other full", full_depth), ("shallow", args.shallow))}
    with lm_eval_output(quiet=True):
        lm_eval.simple_evaluate(model=models["full"], tasks=tasks.specs, task_manager=tasks.manager,
                                limit=args.limit, bootstrap_iters=0, verbosity="ERROR")
    received = models["full"].received
    print(f"{ck.path.name}, {args.task}: full depth {full_depth} paired with itself and with depth {args.shallow}, "
          f"{args.repeats} repeats per trial, {torch.get_num_threads()} thread(s)")
    for size in (int(s) for s in args.sizes.split(",")):
        work = [(kind, [r for r in reqs if r.task_name == args.task][:size]) for kind, reqs in received.items()]
        for name in ("other full", "shallow"):
            trials = [retime.retime(models[name], models["full"], work, args.repeats, full_depth)
                      for _ in range(args.trials)]
            ratios = ", ".join(f"{t['ratio']:.3f}" for t in trials)
            spreads = [t["spread"] for t in trials]
            print(f"  {size:4d} requests, {name:10s} / full: median ratios {ratios}; spread "
                  f"{min(spreads):.2f} to {max(spreads):.2f} (median {statistics.median(spreads):.2f})")


if __name__ == "__main__":
    main()
