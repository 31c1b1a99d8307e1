"""Do exits save wall-clock, what does the harness cost, what does a probe cost? Ratios measured in one run.

    python bench/engine.py --quick                     # the headline ratios, in under 3 minutes on 2 cores
    python bench/engine.py --json bench/engine-results.json --before REV    # the full run for RESULTS.md

On held-out programs of the embedded checkpoint's synthetic task (every statement is a scored position, run
with its own loop as in decoding):
1. Exits and wall-clock. For each rule a threshold whose mean iterations are about half of max is found on a
   calibration split; `time(policy) / time(fixed max)` is then compared with `mean iterations / max`, teacher
   forced (scoring) and greedy (generation), at batch size 1 and 16. Targets: ≤ 1.10 at batch size 1 and
   ≤ 1.15 at batch size 16 for the decoding-free rules; kl is reported. Beside it: loop steps over fixed
   depth's (batched iterations, what time follows where a step costs the same whatever it holds), and time
   per iteration over fixed depth at max/2, which runs in lockstep with no probe and nobody joining or
   leaving: fixed max/2's own ratio is what the model's per-token work (inputs, outputs, records) alone
   makes of the ratio, and the rules' excess over it is what exits cost the engine.
   The same at realistic width (a random model, n_embd 1024, 4 core layers), where arithmetic dominates.
2. The harness. The engine at fixed depth against a bare loop of the same model's layers (its stage walk per
   position through a KV cache, then the head: no exits, no bookkeeping), batch size 1. Target ≤ 1.10.
3. The probe, on a random model of realistic width (n_embd 1024, 4 core layers): each decoding-free rule with
   min_steps = max computes its signal and exit decision every iteration yet runs exactly as many iterations
   as fixed depth. The engine's probe timer per iteration, over one core iteration: target ≤ 2%. Its extra
   time end to end is reported too, beside fixed depth against itself, which shows the machine's own drift.
4. With --before REV: tokens per second at batch size 1 and 16 of the engine at git revision REV and of this
   one, on the same programs, each in its own process, taking turns.
Variants take turns within each repeat and each figure is a median, so a drift in machine speed hits them
alike. Paired figures come with the standard error of the median difference.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exitbench.training import synthetic  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402
from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.models import AttnContext  # noqa: E402

DECODING_FREE = [("first_order", False), ("first_order", True), ("second_order", False),
                 ("second_order_magnitude", False), ("cosine", False)]


def programs(ck, n: int, seed: str) -> list[list[int]]:
    cfg = ck.provenance["training"]["train_config"]
    task = synthetic.make_task(cfg["task"], n_chains=cfg["n_chains"], length=cfg["max_hop"])
    rng = random.Random(seed)
    return [[ck.tokenizer.bos_token_id] + ck.tokenizer.encode(task.sample(rng).text) for _ in range(n)]


def scoring(progs):
    return [(p, 1) for p in progs]


def prompts(progs, new_tokens: int):
    return [p[: len(p) - new_tokens] for p in progs]


def run(engine: ExitEngine, work, batch: int, generate: int = 0) -> tuple[float, float, int, int]:
    """(seconds, mean iterations per token, tokens, loop steps) of scoring `work` (or generating `generate`
    tokens) with `batch` rows, each taking the next request when its own is done. Generating, the prompts'
    prefill (at full depth, the same for every policy, and no part of what exits change) is left out of the
    seconds, as a cell's per-token time leaves it out."""
    t0, prefill, steps = time.perf_counter(), engine.stats["prefill"], engine.stats["steps"]
    results = (engine.generate(work, generate, batch_size=batch) if generate
               else engine.score(work, batch_size=batch))
    seconds = time.perf_counter() - t0 - (engine.stats["prefill"] - prefill)
    its = [k for r in results for k in r.iterations]
    return seconds, sum(its) / len(its), len(its), int(engine.stats["steps"] - steps)


def half_depth_threshold(model, policy: str, relative: bool, work, K: int, coarse: bool = False) -> float:
    """The log-grid threshold (quarter decades; half decades when `coarse`) whose mean iterations come
    closest to K/2 on `work`."""
    best = None
    for tau in [10 ** (e / 4) for e in range(-28, 5, 2 if coarse else 1)]:
        _, mean, _, _ = run(ExitEngine(model, ExitConfig(policy, threshold=tau, relative=relative)), work, 16)
        if best is None or abs(mean - K / 2) < abs(best[1] - K / 2):
            best = (tau, mean)
    return best[0]


def taking_turns(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Each variant is a no-argument callable returning seconds; per repeat they run in a rotating order."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(variants[name]())
    return times


def paired(times: dict[str, list[float]], base: str) -> dict[str, tuple[float, float]]:
    """Per variant: median over repeats of (its time − base's time), and that median's standard error."""
    out = {}
    for name, ts in times.items():
        if name == base:
            continue
        diffs = [a - b for a, b in zip(ts, times[base])]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out[name] = (statistics.median(diffs), 1.2533 * se)  # s.e. of a median ≈ 1.25 × that of a mean
    return out


# ---- 1. exits and wall-clock ------------------------------------------------------------------------------------
def exits_and_wall_clock(model, K, calib, progs, repeats, quick, figures):
    # kl is reported, not held to a target: the quick run leaves it out to stay within three minutes.
    rules = [("first_order", False), ("second_order", False)] if quick else DECODING_FREE + [("kl", False)]
    taus = {r: half_depth_threshold(model, *r, scoring(calib[:8] if quick else calib), K, coarse=quick)
            for r in rules}
    modes = [("score", 16), ("generate", 16), ("score", 1)] + ([] if quick else [("generate", 1)])
    half = K // 2
    for mode, batch in modes:
        work, new = (scoring(progs), 0) if mode == "score" else (prompts(progs, 8), 8)
        engines = {"fixed": ExitEngine(model, ExitConfig("fixed", threshold=K)),
                   f"fixed {half}": ExitEngine(model, ExitConfig("fixed", threshold=half))}
        for (policy, relative), tau in taus.items():
            engines[f"{policy}{' (relative)' if relative else ''}"] = ExitEngine(
                model, ExitConfig(policy, threshold=tau, relative=relative))
        counts = {name: run(e, work, batch, new) for name, e in engines.items()}
        iters = {name: c[1] for name, c in counts.items()}
        times = taking_turns({name: (lambda e=e: run(e, work, batch, new)[0]) for name, e in engines.items()},
                             repeats)
        target = 1.10 if batch == 1 else 1.15
        print(f"\n[exits and wall-clock: {mode}, batch size {batch}]  target (decoding-free): time ratio ≤ "
              f"{target:.2f} × iteration ratio")
        print(f"{'policy':28} {'τ':>9} {'iters/max':>10} {'steps/fixed':>12} {'time/fixed':>11} {'ratio':>7} "
              f"{f'per iter/fixed {half}':>17}")
        base = statistics.median(times["fixed"])
        for name in engines:
            if name == "fixed":
                continue
            it_ratio = iters[name] / K
            t_ratio = statistics.median([a / b for a, b in zip(times[name], times["fixed"])])
            # Against fixed depth at half the iterations (lockstep, no probe, no joining or leaving): what the
            # engine's exits cost per iteration beyond what the model's per-token costs make of the ratio.
            per_iter = statistics.median([a / b for a, b in zip(times[name], times[f"fixed {half}"])]) \
                / (iters[name] / half)
            tau = engines[name].config.threshold
            step_ratio = counts[name][3] / counts["fixed"][3]
            figures[f"{mode}_bs{batch}_{name}"] = {"threshold": tau, "iteration_ratio": it_ratio,
                                                   "step_ratio": step_ratio, "time_ratio": t_ratio,
                                                   "ratio_over_iterations": t_ratio / it_ratio,
                                                   f"per_iteration_over_fixed_{half}": per_iter}
            print(f"{name:28} {tau:>9.3g} {it_ratio:>10.3f} {step_ratio:>12.3f} {t_ratio:>11.3f} "
                  f"{t_ratio / it_ratio:>7.3f} {per_iter:>17.3f}")
        tokens = run(engines["fixed"], work, batch, new)[2]
        print(f"(fixed depth: {tokens / base:,.0f} tokens/s; fixed {half} is the floor a lockstep engine with no "
              f"exit costs would reach: per-token work that no exit saves)")


def wide_thresholds(model, progs, K: int) -> dict[str, float]:
    """first_order and second_order thresholds under which tokens of this random model exit about halfway: the
    median ‖Δ_k‖ and ‖Δ_k − Δ_{k−1}‖ at k = K/2 (its steps shrink by ~15% an iteration, so exits spread
    around K/2)."""
    from exitbench.studies.geometry import step_quantities

    with torch.no_grad():
        states = model.iterates(torch.tensor([progs[0][:12]]), K)[0]
    q = step_quantities(states.flatten(1, 2))
    return {"first_order": float(q["step"][K // 2 - 1].median()),
            "second_order": float(q["accel"][K // 2 - 1].median())}


def wide_exits_and_wall_clock(ck, K, progs, repeats, width, quick, figures):
    """Exits and wall-clock where compute dominates: a random model n_embd wide, scoring and generating at batch
    size 16, and (full run) scoring at batch size 1."""
    wide = wide_model(ck.model.config, width)
    taus = wide_thresholds(wide, progs, K)
    n = 32 if quick else 64
    sized = (progs * (1 + n // len(progs)))[:n]
    cases = [("score", 16, scoring([p[:12] for p in sized]), 0)]
    if quick:
        taus = {"first_order": taus["first_order"]}
    else:  # each token is ~16 ms an iteration at this width and batch size 1
        cases += [("generate", 16, prompts([p[:12] for p in sized], 4), 4),
                  ("score", 1, scoring([p[:12] for p in sized[:6]]), 0)]
    engines = {"fixed": ExitEngine(wide, ExitConfig("fixed", threshold=K))}
    engines.update({p: ExitEngine(wide, ExitConfig(p, threshold=t)) for p, t in taus.items()})
    print(f"\n[exits and wall-clock where compute dominates: random model, n_embd {width}, 4 core layers]  target "
          f"≤ 1.15 at batch size 16, ≤ 1.10 at 1")
    for mode, batch, work, new in cases:
        counts = {name: run(e, work, batch, new) for name, e in engines.items()}
        times = taking_turns({name: (lambda e=e: run(e, work, batch, new)[0]) for name, e in engines.items()},
                             max(2, repeats // 2))
        for name, tau in taus.items():
            it_ratio = counts[name][1] / K
            # Steps over fixed depth's: rows that run dry at the end of the queue (a short workload's drain)
            # show here as steps beyond the iterations.
            step_ratio = counts[name][3] / counts["fixed"][3]
            t_ratio = statistics.median([a / b for a, b in zip(times[name], times["fixed"])])
            figures[f"{mode}_bs{batch}_n{width}_{name}"] = {"threshold": tau, "iteration_ratio": it_ratio,
                                                            "step_ratio": step_ratio, "time_ratio": t_ratio,
                                                            "ratio_over_iterations": t_ratio / it_ratio}
            print(f"{mode} bs{batch} ({len(work)} requests) {name} τ={tau:.3g}: iterations/max {it_ratio:.3f}, "
                  f"steps/fixed {step_ratio:.3f}, time/fixed {t_ratio:.3f}, ratio {t_ratio / it_ratio:.3f}")


# ---- 2. the harness against a bare loop ---------------------------------------------------------------------------
@torch.no_grad()
def bare_loop(model, work, K: int, noise) -> None:
    """What the engine computes at fixed depth, written plainly: prefill, then each position through the stage
    walk at depth K with the KV cache, then the head; no exits, no timers, no records."""
    for tokens, n_ctx in work:
        cache = model.new_cache(1, len(tokens), [K] * len(model.loop_groups()))
        depths = [K] * len(model.loop_groups())
        ids = torch.tensor([tokens])
        if n_ctx > 1:
            model.walk(model.embed(ids[:, : n_ctx - 1]), AttnContext(start=0, cache=cache), depths,
                       noise=lambda g, x: noise.rows(0, n_ctx - 1, x.dtype, x.device).unsqueeze(0))
        for pos in range(n_ctx - 1, len(tokens) - 1):
            x = model.walk(model.embed(ids[:, pos:pos + 1], pos), AttnContext(start=pos, cache=cache), depths,
                           noise=lambda g, x, pos=pos: noise.rows(pos, 1, x.dtype, x.device).unsqueeze(0))
            logp = torch.log_softmax(model.head(x)[0, 0].float(), -1)
            float(logp[tokens[pos + 1]])


def harness_overhead(model, K, progs, repeats, figures):
    work = scoring(progs)
    engine = ExitEngine(model, ExitConfig("fixed", threshold=K))
    # Same answers first: the bare loop is the engine's computation, not a cheaper one.
    ref = engine.score(work[:1])[0].logprobs
    times = taking_turns({"engine": lambda: run(engine, work, 1)[0],
                          "bare": lambda: _timed(lambda: bare_loop(model, work, K, engine.noise))}, repeats)
    ratio = statistics.median([a / b for a, b in zip(times["engine"], times["bare"])])
    figures["harness_over_bare_bs1"] = {"ratio": ratio, "engine_s": statistics.median(times["engine"]),
                                        "bare_s": statistics.median(times["bare"])}
    print(f"\n[the harness at fixed depth {K}, batch size 1]  target ≤ 1.10 × a bare loop of the same layers")
    print(f"engine / bare loop: {ratio:.3f}  ({len(ref)} log-probs of the first program checked equal)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check_bare_loop_agrees(model, K, progs) -> None:
    engine = ExitEngine(model, ExitConfig("fixed", threshold=K))
    work = scoring(progs[:1])
    want = engine.score(work)[0].logprobs
    got = []
    tokens, n_ctx = work[0]
    cache = model.new_cache(1, len(tokens), [K])
    ids = torch.tensor([tokens])
    with torch.no_grad():
        for pos in range(n_ctx - 1, len(tokens) - 1):
            x = model.walk(model.embed(ids[:, pos:pos + 1], pos), AttnContext(start=pos, cache=cache), [K],
                           noise=lambda g, x, pos=pos: engine.noise.rows(pos, 1, x.dtype, x.device).unsqueeze(0))
            got.append(float(torch.log_softmax(model.head(x)[0, 0].float(), -1)[tokens[pos + 1]]))
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, "the bare loop must compute what the engine does"


# ---- 3. the probe at realistic width ----------------------------------------------------------------------------
def wide_config(config, n_embd: int) -> dict:
    """The arguments of a Raven with the embedded model's vocabulary and loop depths, n_embd wide, 4 core layers."""
    return dict(n_embd=n_embd, n_heads=max(1, n_embd // 64), vocab_size=config.vocab_size,
                intermediate_size=2 * n_embd, n_layers_in_prelude=0, n_layers_in_recurrent_block=4,
                n_layers_in_coda=0, block_size=config.block_size, mean_recurrence=config.mean_recurrence,
                max_recurrence=config.max_recurrence)


def wide_model(config, n_embd: int):
    """A random Raven of `wide_config`, weights from seed 0."""
    from exitbench.models import Raven, RavenConfig

    model = Raven(RavenConfig(**wide_config(config, n_embd)))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def exit_model_file() -> str:
    """An exit model of the shape `exitbench fit-exit` writes by default (an MLP of 32 on every feature), with
    random weights: what a probe costs does not depend on them."""
    import json
    import tempfile

    from exitbench.studies.fit_exit import MLP_HIDDEN
    from exitbench.policies.learned import FEATURES, SCHEMA, SCHEMA_VERSION

    g = torch.Generator().manual_seed(0)
    n = len(FEATURES)
    raw = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": "mlp", "features": list(FEATURES),
           "mean": [0.0] * n, "scale": [1.0] * n, "hidden_weights": torch.randn(MLP_HIDDEN, n, generator=g).tolist(),
           "hidden_bias": [0.0] * MLP_HIDDEN, "weights": torch.randn(MLP_HIDDEN, generator=g).tolist(), "bias": 0.0}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(raw, fh)
    return fh.name


def probe_cost(ck, K, progs, repeats, width, quick, figures):
    wide = wide_model(ck.model.config, width)
    work = [(p[:12], 1) for p in progs[:1]] if quick else [(p[:16], 1) for p in progs[:4]]
    iterations = sum(len(t) - n for t, n in work) * K
    # "fixed, again" is the null comparison: the same engine twice shows how far this machine moves end-to-end
    # figures by itself.
    engines = {"fixed": ExitEngine(wide, ExitConfig("fixed", threshold=K)),
               "fixed, again": ExitEngine(wide, ExitConfig("fixed", threshold=K))}
    for policy, relative in (DECODING_FREE[:3] if quick else DECODING_FREE):
        # min_steps = max: the rule computes its signal and decides every iteration, and no token leaves early.
        engines[f"{policy}{' (relative)' if relative else ''}"] = ExitEngine(
            wide, ExitConfig(policy, relative=relative, min_steps=K))
    engines["learned (mlp)"] = ExitEngine(wide, ExitConfig("learned", exit_model=exit_model_file(), min_steps=K))
    for name, e in engines.items():
        assert abs(run(e, work[:1], 1)[1] - K) < 1e-9, f"{name} fired: the probe bench needs all {K} iterations"
    for e in engines.values():
        e.stats = dict.fromkeys(e.stats, 0.0)
    times = taking_turns({n: (lambda e=e: run(e, work, 1)[0]) for n, e in engines.items()}, repeats)
    per_iter = lambda e, phase: e.stats[phase] / (e.stats["tokens"] * K)  # noqa: E731
    core = per_iter(engines["fixed"], "core")
    floor = per_iter(engines["fixed"], "probe")  # what the probe timer reads with no probe: its own cost
    print(f"\n[the probe on a random model, n_embd {width}, 4 core layers, batch size 1]  target ≤ 2% of a core "
          f"iteration ({core * 1e3:.2f} ms)")
    print(f"{'policy':28} {'probe timer/iter':>17} {'of a core iteration':>20} {'end to end/iter':>16} {'± s.e.':>9}")
    for name, (extra, se) in paired(times, "fixed").items():
        timed = per_iter(engines[name], "probe") - floor
        figures[f"probe_n{width}_{name}"] = {"probe_timer_seconds_per_iteration": timed,
                                             "probe_timer_share_of_core_iteration": timed / core,
                                             "end_to_end_seconds_per_iteration": extra / iterations,
                                             "end_to_end_standard_error_seconds": se / iterations}
        print(f"{name:28} {timed * 1e6:>15.1f}µs {100 * timed / core:>19.2f}% {extra / iterations * 1e6:>14.1f}µs "
              f"{se / iterations * 1e6:>7.1f}µs")


# ---- 4. before and after ------------------------------------------------------------------------------------------
WORKER = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from exitbench.models.checkpoint import open_checkpoint
from exitbench.engine import ExitConfig, ExitEngine
policy, tau, batch, wide = sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
work = [(p, 1) for p in json.loads(sys.stdin.read())]
if wide:  # the random model of realistic width, built by this tree's own classes
    from exitbench.models import Raven, RavenConfig
    model = Raven(RavenConfig(**wide))
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()
else:
    model = open_checkpoint(None).model
engine = ExitEngine(model, ExitConfig(policy, threshold=tau))
engine.score(work[:batch])  # warm up
t0 = time.perf_counter()
n = 0
for i in range(0, len(work), batch):  # one batch per call: the first engine took no batch size
    n += sum(len(r.records) for r in engine.score(work[i:i + batch]))
print(json.dumps({"tokens_per_s": n / (time.perf_counter() - t0)}))
"""


def tokens_per_second(tree: Path, policy: str, tau: float, batch: int, progs, threads: int,
                      wide: dict | None = None) -> float:
    out = subprocess.run([sys.executable, "-c", WORKER, str(threads), policy, repr(tau), str(batch),
                          json.dumps(wide or {})],
                         input=json.dumps(progs), capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def before_and_after(rev, config, K, second_order_tau, progs, repeats, threads, width, figures):
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), rev], check=True,
                       capture_output=True)
        try:
            if (old / "setup.py").exists():  # that revision's optional C probe, built as its install would
                subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=old, check=True,
                               capture_output=True)

            def compare(label, policy, tau, batch, work, wide=None):
                times = taking_turns({"before": lambda: tokens_per_second(old, policy, tau, batch, work, threads, wide),
                                      "after": lambda: tokens_per_second(REPO, policy, tau, batch, work, threads,
                                                                         wide)}, repeats)
                b, a = statistics.median(times["before"]), statistics.median(times["after"])
                figures[label] = {"before": b, "after": a, "before_revision": rev}
                print(f"{policy + (f' τ={tau:.3g}' if policy != 'fixed' else ''):24} {batch:>5} {b:>10,.0f} "
                      f"{a:>10,.0f} {a / b:>13.2f}")
                return b, a

            print(f"\n[tokens per second, embedded model, scoring: {rev} (before) vs this tree (after)]")
            print(f"{'policy':24} {'batch':>5} {'before':>10} {'after':>10} {'after/before':>13}")
            for policy, tau in (("fixed", K), ("second_order", second_order_tau)):
                for batch in (1, 16):
                    compare(f"tokens_per_s_{policy}_bs{batch}", policy, tau, batch, progs)
            if width:
                # Where arithmetic dominates, batch size 16: what exits buy each engine on its own fixed depth.
                cfg = wide_config(config, width)
                tau = wide_thresholds(wide_model(config, width), progs, K)["first_order"]
                work = [p[:12] for p in (progs * 2)[:32]]
                print(f"\n[tokens per second, random model n_embd {width}, 4 core layers, scoring, batch size 16]")
                print(f"{'policy':24} {'batch':>5} {'before':>10} {'after':>10} {'after/before':>13}")
                fixed = compare(f"tokens_per_s_n{width}_fixed_bs16", "fixed", K, 16, work, cfg)
                exits = compare(f"tokens_per_s_n{width}_first_order_bs16", "first_order", tau, 16, work, cfg)
                print(f"exits' speed-up over fixed depth: before {exits[0] / fixed[0]:.3f}, "
                      f"after {exits[1] / fixed[1]:.3f}")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="The headline ratios only, fewer repeats (≤ 3 minutes).")
    ap.add_argument("--programs", type=int, default=None, help="Timed programs [quick 8, full 16].")
    ap.add_argument("--repeats", type=int, default=None, help="Repeats per figure [quick 3, full 7].")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wide", type=int, default=1024, help="Hidden size of the random model for the probe.")
    ap.add_argument("--before", default=None, help="Also time the engine at this git revision (tokens/s).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    ap.add_argument("--sections", default="exits,harness,wide,probe,before",
                    help="Which parts to run (comma-separated): exits, harness, wide, probe, before.")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    n_progs = args.programs or (8 if args.quick else 16)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    ck = open_checkpoint(None)
    model = ck.model
    K = model.loop_groups()[0].default_steps
    calib, progs = programs(ck, 16, "bench-calibration"), programs(ck, n_progs, "bench-timing")
    print(f"embedded {ck.path.name} · max steps {K} · {n_progs} programs, {sum(len(p) - 1 for p in progs)} scored "
          f"tokens · {args.threads} thread(s) · medians of {repeats}")
    figures: dict[str, dict] = {}
    started = time.perf_counter()
    if "exits" in sections:
        exits_and_wall_clock(model, K, calib, progs, repeats, args.quick, figures)
    if "harness" in sections:
        check_bare_loop_agrees(model, K, progs)
        harness_overhead(model, K, progs[:4] if args.quick else progs, repeats, figures)
    if args.wide and "wide" in sections:
        wide_exits_and_wall_clock(ck, K, progs, repeats, args.wide, args.quick, figures)
    if args.wide and "probe" in sections:
        probe_cost(ck, K, progs, repeats, args.wide, args.quick, figures)
    if args.before and "before" in sections:
        tau = figures.get("score_bs16_second_order", {}).get("threshold", 1.0)
        before_and_after(args.before, model.config, K, tau, progs, repeats, args.threads, args.wide, figures)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:  # a run of some sections updates their figures and keeps the others'
        earlier = json.loads(args.json.read_text()) if args.json.exists() else {}
        args.json.write_text(json.dumps({**earlier, **figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
