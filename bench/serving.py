"""Generation throughput of the two backends on one machine, in one run: exitbench's engine (hf) and vLLM with the
exitbench plugin (exitbench.serving.vllm), at batch 1 and 16, full depth against per-token exits (freeze).

    python bench/serving.py [--prompts 16] [--new-tokens 32] [--repeats 3] [--out bench/vllm-results.json]

Needs vLLM (pip install 'exitbench[vllm]'). Both run in this process under the same threads, repeats interleaved
(every backend and rule once per round), medians reported; batch 1 is one prompt at a time, 16 all at once (vLLM
serves each call with one engine started beforehand: its ~40 s start is not in any figure). Tokens/s counts
generated tokens; each run's mean exit iteration is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = {"fixed r=16": ("fixed", 16.0, None), "second_order τ=1": ("second_order", 1.0, "freeze")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "vllm-results.json")
    a = ap.parse_args()

    import torch

    from exitbench.engine import ExitConfig, ExitEngine
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.serving.vllm.engine import VllmEngine, shutdown

    ck = open_checkpoint("tiny-raven", dtype="float32")
    lines = (ROOT / "tasks/chains/test.jsonl").read_text().splitlines()[: a.prompts]
    prompts = [ck.tokenizer.encode(json.loads(line)["prompt"]) for line in lines]
    configs = {name: ExitConfig(p, threshold=t, exit_mode=m) for name, (p, t, m) in RULES.items()}
    engines = {("vllm", name): VllmEngine(ck, cfg, rows=16) for name, cfg in configs.items()}
    engines.update({("hf", name): ExitEngine(ck.model, cfg) for name, cfg in configs.items()})

    def run(backend: str, rule: str, batch: int) -> tuple[float, float]:
        engine = engines[(backend, rule)]
        t0 = time.perf_counter()
        results = []
        for i in range(0, len(prompts), batch):
            results += engine.generate(prompts[i:i + batch], a.new_tokens, batch_size=batch)
        seconds = time.perf_counter() - t0
        its = [r.exit_steps[0] for res in results for r in res.records]
        return sum(len(res.tokens) for res in results) / seconds, statistics.fmean(its)

    cases = [(b, r, n) for n in (1, 16) for r in RULES for b in ("hf", "vllm")]
    samples: dict[tuple, list[float]] = {c: [] for c in cases}
    iterations: dict[tuple, float] = {}
    for _ in range(a.repeats):
        for case in cases:
            rate, its = run(*case)
            samples[case].append(rate)
            iterations[case] = its
    shutdown()
    rows = []
    for (backend, rule, batch) in cases:
        med = statistics.median(samples[(backend, rule, batch)])
        rows.append({"backend": backend, "rule": rule, "batch": batch, "tokens_per_s": med,
                     "samples": samples[(backend, rule, batch)], "mean_iterations": iterations[(backend, rule, batch)]})
        print(f"{backend:5s} {rule:17s} batch {batch:2d}: {med:7.1f} tokens/s (mean iterations "
              f"{iterations[(backend, rule, batch)]:.2f})")
    by = {(r["backend"], r["rule"], r["batch"]): r["tokens_per_s"] for r in rows}
    for batch in (1, 16):
        for rule in RULES:
            print(f"batch {batch:2d} {rule:17s}: vllm/hf {by[('vllm', rule, batch)] / by[('hf', rule, batch)]:.2f}")
        for backend in ("hf", "vllm"):
            print(f"batch {batch:2d} {backend:5s}: exits/fixed "
                  f"{by[(backend, 'second_order τ=1', batch)] / by[(backend, 'fixed r=16', batch)]:.2f}")
    a.out.write_text(json.dumps({"argv": sys.argv, "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
