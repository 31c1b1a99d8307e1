"""Milliseconds per token of fixed depth, second_order and kl, at batch size 1 and 16, on a device.

    python bench/gpu.py                                   # CUDA, a random Huginn-0125-sized model in bf16
    python bench/gpu.py --checkpoint huginn-0125 --json bench/gpu-results.json
    python bench/gpu.py --device cpu --checkpoint tiny-raven [--compile]    # the same measurement on CPU

Each variant scores random token sequences teacher-forced (every position runs its own loop and exits on its
own, as in decoding): one sequence at batch size 1, sixteen at batch size 16. ms/token is the wall time of
the engine call over the scored tokens, CUDA synchronised before the clock stops, the median over
--repeats after one warm-up call (which pays torch.compile under --compile, and CUDA's lazy start). The
variants take turns within each repeat, so a drift in the machine's speed hits them alike. Figures go to
--json in the form bench/engine.py writes (name → figures; a run updates its own names, keeps the others').

Inkling 2 Mini, the real release (thinkingmachines/Inkling-2-Mini downloaded beforehand: 19 GB as shipped, 52 GB
once its experts are dequantised to bf16, so a GPU of 80 GB or more), its three passes and exits after pass 1 or 2:

    python bench/gpu.py --checkpoint /path/to/Inkling-2-Mini --dtype bfloat16 --max-steps 3 \
        --json bench/gpu-results.json

Without --checkpoint: Huginn-0125's published shape (shared/reference/huginn-0125.md §1.1) with random
weights at its init scales, built on the device in bf16 (7.1 GB; no files are written). Without a CUDA device
`--device cuda` (the default) ends with one line, as every exitbench command does.

`--decode N` adds the engine's greedy decoding of N new tokens at batch sizes 1 and 16 against the memory
floor, and the scoring rules against the fixed-depth time line (issue 57's table, docs/engine.md):
- floor: a decoding step must read the weights it uses once (the embedding row aside): prelude, coda, norm and
  head once per token, the core block once per iteration; at batch 16 once per batched step for all rows. The
  device's read rate is measured in the same run (an on-device copy of a buffer far larger than its caches:
  bytes read ÷ time), so floor = bytes ÷ rate, and the table prints measured ÷ floor;
- time line: fixed depths r = K/8, K/4, K/2, K scored at batch 16 give a + b·r (least squares); each rule's
  time over the line's value at its own mean iterations is what its exits cost beyond their arithmetic.
    python bench/gpu.py --decode 32 --json bench/gpu-results.json     # on a GPU: about 5 minutes on one H200
    python bench/gpu.py --device cpu --checkpoint tiny-raven --decode 8 --tokens 16   # a dry run

--json gets each part's figures (scoring, the time line, decoding) as the part ends, so a run cut short keeps
them. On a GPU lent for minutes (the development machines' `device` tool), bench/gpu_kit.sh and
bench/gpu_before_after.sh run this bench on this engine and an earlier one in one call.
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

from exitbench.runtime.devices import resolve_device  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402
from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.errors import ExitbenchError  # noqa: E402
from exitbench.runtime.files import atomic_write  # noqa: E402
from exitbench.models import Raven, RavenConfig  # noqa: E402

HUGINN = dict(n_embd=5280, n_heads=55, vocab_size=65536, intermediate_size=17920, n_layers_in_prelude=2,
              n_layers_in_recurrent_block=4, n_layers_in_coda=2, block_size=4096, rope_base=50000.0,
              mean_recurrence=32)
# (name, policy, threshold): the thresholds are the usual ones (Huginn's paper's kl 5e-4), not tuned to a
# target depth: on random weights a rule may run to max depth, which this benchmark reports as it is.
VARIANTS = [("fixed", "fixed", None), ("second_order", "second_order", None), ("kl", "kl", 5e-4)]
BATCHES = (1, 16)


def random_huginn(device: str) -> Raven:
    with torch.device(device):
        model = Raven(RavenConfig(**HUGINN)).to(torch.bfloat16)
    model.init_weights(torch.Generator(device=device).manual_seed(0))
    return model.eval()


def load_model(checkpoint: str | None, device: str, dtype: str):
    if checkpoint is None:
        return random_huginn(device)
    return open_checkpoint(checkpoint, dtype, device).model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure(model, device: str, tokens: int, repeats: int, max_steps: int | None, seed: int = 0) -> dict:
    """name → figures for every (variant, batch size)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (tokens + 1,), generator=g).tolist() for _ in range(max(BATCHES))]
    engines, work = {}, {}
    for name, policy, tau in VARIANTS:
        knobs = {} if max_steps is None or policy == "fixed" else {"max_steps": max_steps}
        threshold = max_steps if policy == "fixed" else tau
        for batch in BATCHES:
            key = f"{name}_bs{batch}"
            engines[key] = ExitEngine(model, ExitConfig(policy, threshold=threshold, **knobs))
            work[key] = ([(s, 1) for s in seqs[:batch]], batch)

    def call(key: str):
        requests, batch = work[key]
        sync(device)
        t0 = time.perf_counter()
        results = engines[key].score(requests, batch_size=batch)
        sync(device)
        return time.perf_counter() - t0, results

    warmup = {key: call(key)[0] for key in engines}
    times: dict[str, list[float]] = {key: [] for key in engines}
    iterations: dict[str, float] = {}
    for _ in range(repeats):
        for key in engines:
            seconds, results = call(key)
            times[key].append(seconds)
            its = [i for r in results for i in r.iterations]
            iterations[key] = sum(its) / len(its)
    figures = {}
    for key in engines:
        scored = sum(len(r) - 1 for r, _ in work[key][0])
        median = statistics.median(times[key])
        figures[key] = {"ms_per_token": 1000 * median / scored, "tokens": scored, "batch_size": work[key][1],
                        "mean_iterations": iterations[key], "max_steps": engines[key].policies[0].max_steps,
                        "threshold": engines[key].policies[0].threshold, "seconds": times[key],
                        "warmup_seconds": warmup[key]}
    return figures


def read_rate(device: str, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes per second the device reads, from an on-device copy of a buffer far larger than its caches (a
    copy reads each byte once and writes it once: bytes read = the buffer's size; the fastest of `repeats`)."""
    n = int(gib * 2**30) // 4 if device.startswith("cuda") else 2**26  # 256 MiB on a CPU: past its caches
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return n * 4 / best


def weight_bytes(model) -> tuple[int, int]:
    """(bytes read once per token, bytes read once per core iteration) of a Raven: every stage's weights but
    the embedding table, of which a token reads one row (a tied head reads it whole, once per token)."""
    t = model.transformer
    per_iteration = sum(p.numel() * p.element_size() for m in (t.adapter, t.core_block) for p in m.parameters())
    once = sum(p.numel() * p.element_size() for m in (t.prelude, t.coda, t.ln_f, model.lm_head)
               for p in m.parameters())
    return once, per_iteration


def decode(model, device: str, new_tokens: int, repeats: int, max_steps: int | None, seed: int = 1) -> dict:
    """Greedy decoding at batch sizes 1 and 16: ms per new token (per row: a batch's step serves every row)
    beside the memory floor of the weights the tokens' iterations read."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(max(BATCHES))]
    rate = read_rate(device)
    once, per_iteration = weight_bytes(model)
    figures = {}
    for name, policy, tau in VARIANTS:
        knobs = {} if max_steps is None or policy == "fixed" else {"max_steps": max_steps}
        engine = ExitEngine(model, ExitConfig(policy, threshold=max_steps if policy == "fixed" else tau, **knobs))
        for batch in BATCHES:
            rows = prompts[:batch]
            engine.generate(rows, max_new_tokens=2, batch_size=batch)  # warm-up

            def timed(count: int):
                sync(device)
                t0 = time.perf_counter()
                results = engine.generate(rows, max_new_tokens=count, batch_size=batch)
                sync(device)
                return time.perf_counter() - t0, results
            # the prefill and first token cancel out of the difference of a long and a one-token run
            times = []
            for _ in range(repeats):
                long_s, results = timed(new_tokens + 1)
                times.append(long_s - timed(1)[0])
            its = [i for r in results for i in r.iterations[1:]]
            n = len(its)  # new tokens past the first, over the rows
            mean = sum(its) / n
            # a batch reads the weights once per batched step: per row, the bytes of its tokens ÷ the batch
            floor_s = n * (once + mean * per_iteration) / batch / rate
            ms = 1000 * statistics.median(times) / n
            figures[f"decode_{name}_bs{batch}"] = {
                "ms_per_token": ms, "tokens": n, "batch_size": batch, "mean_iterations": mean,
                "max_steps": engine.policies[0].max_steps, "threshold": engine.policies[0].threshold,
                "seconds": times, "floor_ms": 1000 * floor_s / n, "over_floor": ms / (1000 * floor_s / n),
                "read_rate_gb_s": rate / 1e9, "weight_bytes_once": once, "weight_bytes_per_iteration": per_iteration}
    return figures


def against_line(model, device: str, tokens: int, repeats: int, max_steps: int | None, measured: dict) -> dict:
    """Fixed depths K/8 … K scored at batch 16: the time line a + b·r, and each rule at batch 16 over the
    line at its own mean iterations."""
    K = max_steps or model.config.mean_recurrence
    depths = sorted({max(1, K // 8), max(1, K // 4), max(1, K // 2), K})
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (tokens + 1,), generator=g).tolist() for _ in range(16)]
    requests = [(s, 1) for s in seqs]
    points = []
    for r in depths:
        engine = ExitEngine(model, ExitConfig("fixed", threshold=r))
        engine.score(requests, batch_size=16)
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            engine.score(requests, batch_size=16)
            sync(device)
            times.append(time.perf_counter() - t0)
        points.append((r, 1000 * statistics.median(times) / (16 * tokens)))
    n = len(points)
    mean_r, mean_t = sum(r for r, _ in points) / n, sum(t for _, t in points) / n
    b = sum((r - mean_r) * (t - mean_t) for r, t in points) / sum((r - mean_r) ** 2 for r, _ in points)
    a = mean_t - b * mean_r
    figures = {f"line_fixed_r{r}_bs16": {"ms_per_token": t, "mean_iterations": float(r), "batch_size": 16,
                                         "line_ms": a + b * r, "over_line": t / (a + b * r)} for r, t in points}
    for name, _, _ in VARIANTS[1:]:
        got = measured.get(f"{name}_bs16")
        if got:
            on_line = a + b * got["mean_iterations"]
            figures[f"line_{name}_bs16"] = {**got, "line_ms": on_line, "over_line": got["ms_per_token"] / on_line}
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda).")
    ap.add_argument("--checkpoint", default=None, help="Checkpoint directory or embedded name (default: a random "
                    "Huginn-0125-sized model built on the device).")
    ap.add_argument("--dtype", default="auto", help="With --checkpoint: auto, float32, bfloat16 or float16.")
    ap.add_argument("--tokens", type=int, default=64, help="Scored tokens per sequence.")
    ap.add_argument("--max-steps", type=int, default=None, help="Iterations at most [the model's default depth].")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the loop step (exitbench --compile).")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own).")
    ap.add_argument("--decode", type=int, default=0, help="Also decode this many new tokens per prompt, against "
                    "the memory floor, and score the rules against the fixed-depth time line (0: not).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = ap.parse_args(argv)
    try:
        if args.tokens < 1 or args.repeats < 1:
            raise ExitbenchError(f"--tokens and --repeats must be ≥ 1, got {args.tokens} and {args.repeats}")
        device = resolve_device(args.device)
        model = load_model(args.checkpoint, device, args.dtype)
        if args.tokens + 1 > model.config.block_size:
            raise ExitbenchError(f"--tokens {args.tokens} exceeds the model's context of {model.config.block_size}")
    except ExitbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        model.compile_loops()
    tag = "_compiled" if args.compile else ""
    on = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"

    def report(measured: dict) -> None:
        """Print a part's figures and add them to --json at once: a run cut short (a lent GPU's time limit)
        keeps every part it finished."""
        figures = {f"{device.split(':')[0]}{tag}_{key}": {**value, "device": on, "compile": args.compile,
                                                          "dtype": str(model.dtype)}
                   for key, value in measured.items()}
        for key, value in figures.items():
            extra = "".join(f"  {name} {value[name]:.2f}" for name in ("floor_ms", "over_floor", "over_line")
                            if name in value)
            print(f"{key:36s} {value['ms_per_token']:9.3f} ms/token  mean iterations "
                  f"{value['mean_iterations']:.2f}{extra}", flush=True)
        if args.json:
            earlier = json.loads(args.json.read_text()) if args.json.exists() else {}
            atomic_write(args.json, lambda f: f.write(json.dumps({**earlier, **figures}, indent=2) + "\n"))

    measured = measure(model, device, args.tokens, args.repeats, args.max_steps)
    report(measured)
    if args.decode:
        report(against_line(model, device, args.tokens, args.repeats, args.max_steps, measured))
        report(decode(model, device, args.decode, args.repeats, args.max_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
