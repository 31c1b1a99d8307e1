"""Do exits save wall-clock, and what does a probe cost? Ratios measured in one run (no absolute times).

    python bench/engine.py [--checkpoint DIR] [--programs 8] [--repeats 7] [--threads 1]

On held-out programs of the checkpoint's synthetic task, every statement is scored teacher-forced (each
position runs its own loop, as in decoding):
1. For each decoding-free policy, a threshold whose mean iterations are about half of max is found on a
   calibration split; then `time(policy) / time(fixed max)` is compared with `mean iterations / max`.
   Target: time ratio ≤ 1.15 × iteration ratio, at batch size 1 and at batch size 16.
2. Probe overhead per iteration: the policy with min_steps = max computes its signal and exit decision at
   every iteration but runs exactly max iterations, like `fixed`; the extra time per iteration over
   `fixed`, divided by the time of one core iteration, is the probe's cost (median over repeats, with its
   standard error). Target ≤ 2% for decoding-free rules; `kl` is reported, not hidden. The decoding-free
   rules run twice: with the C probe (exitbench._probe) and on the tensor path a build without it uses.
Runs are interleaved and each figure is the median over repeats, so drifts in machine speed hit all
variants alike.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exitbench import synthetic  # noqa: E402
from exitbench.embedded import open_checkpoint  # noqa: E402
from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.policies import latent  # noqa: E402

DECODING_FREE = [("first_order", False), ("first_order", True), ("second_order", False),
                 ("second_order", True), ("second_order_magnitude", False), ("cosine", False)]


def requests(ck, n: int, seed: str) -> list[tuple[list[int], int]]:
    cfg = ck.provenance["training"]["train_config"]
    task = synthetic.make_task(cfg["task"], n_chains=cfg["n_chains"], length=cfg["max_hop"])
    rng = random.Random(seed)
    return [([ck.tokenizer.bos_token_id] + ck.tokenizer.encode(task.sample(rng).text), 1) for _ in range(n)]


def run(engine: ExitEngine, reqs, batch: int) -> tuple[float, float]:
    """(seconds, mean iterations per scored token)."""
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(reqs), batch):
        results += engine.score(reqs[i:i + batch])
    seconds = time.perf_counter() - t0
    its = [k for r in results for k in r.iterations]
    return seconds, sum(its) / len(its)


def wide_model(config, n_embd: int):
    """A random Raven with the embedded model's vocabulary and loop depths, wider and with 4 core layers."""
    from exitbench.models import Raven, RavenConfig

    cfg = RavenConfig(n_embd=n_embd, n_heads=max(1, n_embd // 64), vocab_size=config.vocab_size,
                      intermediate_size=2 * n_embd, n_layers_in_prelude=0, n_layers_in_recurrent_block=4,
                      n_layers_in_coda=0, block_size=config.block_size, mean_recurrence=config.mean_recurrence,
                      max_recurrence=config.max_recurrence)
    model = Raven(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def half_depth_threshold(model, policy: str, relative: bool, reqs, max_steps: int) -> tuple[float, float]:
    """The grid threshold whose mean iterations are closest to max/2 (log-spaced search, then refined)."""
    grid = [10 ** (e / 4) for e in range(-28, 5)]
    best = None
    for tau in grid:
        _, mean = run(ExitEngine(model, ExitConfig(policy, threshold=tau, relative=relative)), reqs, 16)
        if best is None or abs(mean - max_steps / 2) < abs(best[1] - max_steps / 2):
            best = (tau, mean)
    return best


def median_times(engines: dict[str, ExitEngine], reqs, batch: int, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            times[name].append(run(engine, reqs, batch)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def paired_extra(engines: dict[str, ExitEngine], base: str, reqs, repeats: int,
                 tensor_path: set[str], batch: int = 1) -> dict[str, list[float]]:
    """Per repeat, the total time each engine spent over `base` on the same requests, `batch` at a time.

    The engines take turns on each request, in an order that rotates every repeat, so a drift in machine
    speed lands on all of them alike; whole-run interleaving left a spread of ±5 µs per iteration on this
    machine, larger than the 3.6 µs budget being measured. Engines in `tensor_path` run with the C probe off.
    """
    names = list(engines)
    chunks = [reqs[i:i + batch] for i in range(0, len(reqs), batch)]
    times = {name: [[0.0] * repeats for _ in chunks] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for q, chunk in enumerate(chunks):
            for name in order:
                with c_probe_off(name in tensor_path):
                    t0 = time.perf_counter()
                    engines[name].score(chunk)
                    times[name][q][r] = time.perf_counter() - t0
    return {name: [sum(times[name][q][r] - times[base][q][r] for q in range(len(chunks))) for r in range(repeats)]
            for name in names if name != base}


@contextlib.contextmanager
def c_probe_off(off: bool):
    saved = latent.native
    if off:
        latent.native = None
    try:
        yield
    finally:
        latent.native = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--programs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    ap.add_argument("--wide", type=int, default=1024, help="Hidden size of the wide random model (0: skip).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = open_checkpoint(args.checkpoint)
    model = ck.model
    K = model.loop_groups()[0].default_steps
    calib = requests(ck, 16, "bench-calibration")
    reqs = requests(ck, args.programs, "bench-timing")
    n_tokens = sum(len(t) - n for t, n in reqs)
    print(f"checkpoint {ck.path} · max steps {K} · {args.programs} programs, {n_tokens} scored tokens · "
          f"{args.threads} thread(s) · median of {args.repeats}")

    figures: dict[str, dict] = {}
    # 1. wall-clock vs iterations at about half depth
    for batch in (1, 16):
        print(f"\n[wall-clock at ~half depth, batch size {batch}]  target: time ratio ≤ 1.15 × iteration ratio")
        print(f"{'policy':32} {'threshold':>10} {'iters/max':>10} {'time/fixed':>11} {'ratio':>7}")
        engines = {"fixed": ExitEngine(model, ExitConfig("fixed", threshold=K))}
        meta = {}
        for policy, relative in DECODING_FREE[:3] + [("kl", False)]:
            tau, _ = half_depth_threshold(model, policy, relative, calib, K)
            name = f"{policy}{' (relative)' if relative else ''}"
            engines[name] = ExitEngine(model, ExitConfig(policy, threshold=tau, relative=relative))
            meta[name] = tau
        iters = {name: run(e, reqs, batch)[1] for name, e in engines.items()}
        times = median_times(engines, reqs, batch, args.repeats)
        for name in meta:
            it_ratio, t_ratio = iters[name] / K, times[name] / times["fixed"]
            figures[f"halfdepth_bs{batch}_{name}"] = {"threshold": meta[name], "iteration_ratio": it_ratio,
                                                     "time_ratio": t_ratio, "ratio_over_iterations": t_ratio / it_ratio}
            print(f"{name:32} {meta[name]:>10.3g} {it_ratio:>10.3f} {t_ratio:>11.3f} {t_ratio / it_ratio:>7.3f}")

    # 2. probe overhead per iteration
    print("\n[probe overhead per iteration, batch size 1]  target: ≤ 2% of a core iteration (decoding-free)")
    print(f"C probe (exitbench._probe): {'built' if latent.native is not None else 'NOT BUILT, tensor path only'}")
    # min_steps = max: every iteration computes the signal and the exit decision, and no token leaves early.
    engines = {"fixed": ExitEngine(model, ExitConfig("fixed", threshold=K))}
    for policy, relative in DECODING_FREE:
        engines[f"{policy}{' (relative)' if relative else ''}"] = ExitEngine(
            model, ExitConfig(policy, relative=relative, min_steps=K))
    # The same rules with the C probe switched off: what a build without a compiler pays.
    tensor_path = {f"{p} (tensor path)": ExitEngine(model, ExitConfig(p, min_steps=K)) for p, _ in DECODING_FREE[:3:2]}
    engines.update(tensor_path)
    engines["kl"] = ExitEngine(model, ExitConfig("kl", min_steps=K))
    for name, engine in engines.items():
        _, mean = run(engine, reqs[:1], 1)
        assert abs(mean - K) < 1e-9, f"{name} fired; the probe benchmark needs it to run all {K} iterations"
    extra_by_repeat = paired_extra(engines, "fixed", reqs, args.repeats, set(tensor_path))
    fixed = engines["fixed"]
    core_per_iter = fixed.stats["core"] / (fixed.stats["tokens"] * K)
    iterations = n_tokens * K
    # Two readings: the end-to-end difference over `fixed` (includes any knock-on cost, e.g. on memory reuse),
    # and the engine's own probe timer around signal + exit decision, less the timer cost `fixed` shows.
    timer_floor = fixed.stats["probe"] / (fixed.stats["tokens"] * K)
    print(f"{'policy':32} {'extra/iter':>12} {'± s.e.':>8} {'of core iter':>13} {'probe timer':>12} {'of core iter':>13}")
    for name, diffs in extra_by_repeat.items():
        extra = statistics.median(diffs) / iterations
        stderr = statistics.stdev(diffs) / len(diffs) ** 0.5 / iterations
        st = engines[name].stats
        timed = st["probe"] / (st["tokens"] * K) - timer_floor
        figures[f"probe_{name}"] = {"extra_seconds_per_iteration": extra, "standard_error_seconds": stderr,
                                    "share_of_core_iteration": extra / core_per_iter,
                                    "probe_timer_seconds_per_iteration": timed,
                                    "probe_timer_share_of_core_iteration": timed / core_per_iter}
        print(f"{name:32} {extra * 1e6:>10.2f}µs {stderr * 1e6:>6.2f}µs {100 * extra / core_per_iter:>12.2f}% "
              f"{timed * 1e6:>10.2f}µs {100 * timed / core_per_iter:>12.2f}%")
    print(f"(core iteration: {core_per_iter * 1e6:.1f}µs at batch size 1)")

    # 2b. The same with all programs in one batch: one C call serves every token in the loop.
    batch = len(reqs)
    print(f"\n[probe overhead per iteration, batch size {batch}]  (no target; the sweeps run batched)")
    engines = {"fixed": ExitEngine(model, ExitConfig("fixed", threshold=K))}
    for policy, relative in DECODING_FREE[::2]:
        engines[policy] = ExitEngine(model, ExitConfig(policy, relative=relative, min_steps=K))
    tensor_path = {f"{p} (tensor path)": ExitEngine(model, ExitConfig(p, min_steps=K)) for p, _ in DECODING_FREE[:3:2]}
    engines.update(tensor_path)
    extra_by_repeat = paired_extra(engines, "fixed", reqs, args.repeats, set(tensor_path), batch)
    fixed = engines["fixed"]
    core_batched = fixed.stats["core"] / (fixed.stats["tokens"] / batch * K)  # one iteration of the batch
    for name, diffs in extra_by_repeat.items():
        per_iter = statistics.median(diffs) / (n_tokens / batch * K)
        stderr = statistics.stdev(diffs) / len(diffs) ** 0.5 / (n_tokens / batch * K)
        figures[f"probe_bs{batch}_{name}"] = {"extra_seconds_per_iteration": per_iter, "standard_error_seconds": stderr,
                                              "share_of_core_iteration": per_iter / core_batched}
        print(f"{name:32} {per_iter * 1e6:>10.2f}µs {stderr * 1e6:>6.2f}µs {100 * per_iter / core_batched:>12.2f}%")
    print(f"(core iteration of the batch: {core_batched * 1e6:.1f}µs)")

    # 3. The same probe measurement on a wider random model of the same layout: a probe costs a fixed few
    # microseconds of Python dispatch and a C call, so its share shrinks as the core iteration grows.
    if args.wide:
        wide = wide_model(ck.model.config, args.wide)
        wide_reqs = [(t[:24], n) for t, n in reqs[:4]]
        n_wide = sum(len(t) - n for t, n in wide_reqs)
        engines = {"fixed": ExitEngine(wide, ExitConfig("fixed", threshold=K))}
        for policy, relative in DECODING_FREE[:3]:
            engines[f"{policy}{' (relative)' if relative else ''}"] = ExitEngine(
                wide, ExitConfig(policy, relative=relative, min_steps=K))
        times = median_times(engines, wide_reqs, 1, max(3, args.repeats // 2))
        core = engines["fixed"].stats["core"] / (engines["fixed"].stats["tokens"] * K)
        print(f"\n[probe overhead on a random model with n_embd={args.wide}, 4 core layers]  core iteration "
              f"{core * 1e6:.0f}µs")
        for name in engines:
            if name != "fixed":
                extra = (times[name] - times["fixed"]) / (n_wide * K)
                figures[f"probe_wide_{name}"] = {"extra_seconds_per_iteration": extra, "share_of_core_iteration": extra / core}
                print(f"{name:32} {extra * 1e6:>10.2f}µs {100 * extra / core:>12.2f}%")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
