"""How close does the learned exit rule get to the oracle? The matched-quality table on both embedded models.

    python bench/learned.py                   # fits, sweeps and times everything (about 10 minutes on 2 cores)
    python bench/learned.py --json bench/learned-results.json

For each embedded model: `exitbench fit-exit` on documents no evaluation reads, a replay sweep of every policy
(with `learned` on that exit model) on the tasks, the matched-quality rows at ≤ 1% quality loss (iterations /
oracle), and exact cells at batch size 1 of fixed depth, second_order and learned at their matched thresholds
for wall-clock, from one run each (ms per token; ratios within one run only).
- tiny-raven: fitted on 256 held-out programs of its chains task (any that begins with a `chains` evaluation
  prompt dropped); evaluated on chains, chains_mc, chains_lambada.
- tiny-looped-gpt2: fitted on GSM8K train text (`--task gsm8k_text`, 64 documents); evaluated on gsm8k_text
  (the test split) and on chains_lambada, a task whose text (variable bindings) it was not fitted on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
EXITBENCH = [sys.executable, "-m", "exitbench"]
TOLERANCE = 0.01

MODELS = {
    "tiny-raven": {"checkpoint": [], "fit": ["--limit", "256"],
                   "tasks": [("chains,chains_mc,chains_lambada", [])]},
    "tiny-looped-gpt2": {"checkpoint": ["-c", "tiny-looped-gpt2"],
                         "fit": ["--task", "gsm8k_text", "--data-dir", str(GSM8K), "--limit", "64"],
                         "tasks": [("gsm8k_text", ["--data-dir", str(GSM8K), "--limit", "20"]),
                                   ("chains_lambada", [])]},
}


def exitbench(*args: str) -> None:
    subprocess.run([*EXITBENCH, *args], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def matched(directory: Path) -> dict[str, list[dict]]:
    """Per task · metric, the matched-quality rows at TOLERANCE (exact cells preferred over replay twins)."""
    from exitbench.analysis.frontier import report
    from exitbench.store.loading import load

    rep = report(load([directory]))
    return {group: [r for r in entry["matched_quality"] if r["tolerance"] == TOLERANCE]
            for group, entry in rep.items()}


def wall_clock(ck_args: list[str], task: str, task_args: list[str], rows: list[dict], full: float,
               exit_model: Path, out: Path) -> dict[str, float]:
    """ms per token at batch size 1 of full depth, second_order and learned at their matched thresholds: exact
    cells of one run (the two rules share the run's threshold list, so each also gets the other's τ)."""
    from exitbench.store.loading import load

    chosen = {r["policy"]: r["threshold"] for r in rows if r["policy"] in ("second_order", "learned")}
    limit = [] if "--limit" in task_args else ["--limit", "100"]  # 100 documents: enough for a time per token
    exitbench("run", *ck_args, "--tasks", task, *task_args, *limit, "--batch-size", "1", "--policy", "second_order",
              "--policy", "learned", "--exit-model", str(exit_model),
              "--thresholds", f"{chosen['second_order']:g},{chosen['learned']:g}", "--baselines", f"{full:g}",
              "--out", str(out), "--quiet")
    ms = {}
    for cell in load([out]):
        name, tau = cell["policy"]["policy"], cell["policy"]["threshold"]
        if tau == chosen.get(name) or (name == "fixed" and tau == full):
            ms[name] = 1e3 * cell["wall_clock"]["per_token_s"]
    return ms


def by_hop(model_file: Path, tau: float, programs: int = 128) -> list[dict]:
    """tiny-raven on held-out programs of its own stream (not the fitting one): per hop, the oracle's exit, the
    learned rule's and second_order's (τ 0.1, its matched threshold on chains), and how often each exits with a
    prediction that differs from full depth. Hop h needs about h − 1 iterations (tasks/README.md)."""
    import numpy as np

    from exitbench.harness.documents import heldout_batch
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.studies.fit_exit import Rows, exits_by_threshold, record_rows, risk_of
    from exitbench.policies import REGISTRY

    ck = open_checkpoint(None)
    (inputs, _, hops), _ = heldout_batch(ck, programs, "learned-by-hop")
    docs = inputs.tolist()
    rows = record_rows(ck.model, docs, 0, 16)
    hop = hops[:, :-1].reshape(-1).numpy()  # one per predicted position, in the order rows number tokens
    assert len(np.unique(rows.token)) == len(hop)
    risk = risk_of(json.loads(model_file.read_text()), rows.x)
    # second_order's own signal, from the feature columns: ‖Δ_k − Δ_{k−1}‖ (defined from k = 2, patience 2)
    policy = REGISTRY["second_order"](threshold=0.1).bind(16)
    out = []
    for h in sorted(set(hop.tolist()) - {0}):
        tokens = np.flatnonzero(hop == h)
        mask = np.isin(rows.token, tokens)
        mine = Rows(**{f: getattr(rows, f)[mask] for f in Rows.__dataclass_fields__})
        learned = exits_by_threshold(mine, risk[mask], [tau])[0]
        first = np.r_[True, mine.token[1:] != mine.token[:-1]]
        second = np.exp(mine.x[:, 3]).reshape(-1, 16)  # log_second column, back to a norm
        second[:, 0] = np.inf
        so_exit = np.array([policy.first_exit(list(r)) for r in second])
        changed = mine.changed.reshape(-1, 16)
        out.append({"hop": h, "tokens": int(len(tokens)), "oracle": float(mine.oracle[first].mean()),
                    "learned": learned["mean_iterations"], "learned_changed": learned["disagreement"],
                    "second_order": float(so_exit.mean()),
                    "second_order_changed": float(changed[np.arange(len(so_exit)), so_exit - 1].mean())})
    return out


def main() -> None:
    from exitbench.store.loading import load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    ap.add_argument("--models", default=",".join(MODELS), help="Which embedded models (comma-separated).")
    ap.add_argument("--keep", type=Path, default=None, help="Keep the exit models and cells here.")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="exitbench-learned-"))
    figures: dict[str, dict] = {}
    for name in args.models.split(","):
        spec = MODELS[name]
        model_file = work / f"{name}.json"
        exitbench("fit-exit", *spec["checkpoint"], *spec["fit"], "--out", str(model_file))
        fitted = json.loads(model_file.read_text())
        figures[name] = {"exit_model": {"kind": fitted["kind"], "data": fitted["data"],
                                        "validation": fitted["metrics"]["validation"],
                                        "permutation_log_loss_increase":
                                            fitted["metrics"]["permutation_log_loss_increase"]}, "tasks": {}}
        for tasks, task_args in spec["tasks"]:
            out = work / name / tasks.replace(",", "+")
            exitbench("run", *spec["checkpoint"], "--tasks", tasks, *task_args, "--policy", "all", "--exit-model",
                      str(model_file), "--replay", "--out", str(out), "--quiet")
            for group, rows in matched(out).items():
                task = group.split(" · ")[0]
                full = max(c["policy"]["threshold"] for c in load([out])
                           if c["policy"]["policy"] == "fixed" and c["task"]["name"] == task)
                timed = wall_clock(spec["checkpoint"], task, task_args, rows, full, model_file,
                                   work / name / f"bs1-{task}")
                figures[name]["tasks"][group] = {"rows": rows, "ms_per_token_batch_1": timed}
                print(f"\n[{name}] {group}: ≤ {TOLERANCE:.0%} quality loss (replay cells; ms/token exact, batch 1)")
                print(f"{'policy':24} {'τ':>8} {'iterations':>11} {'/ oracle':>9}")
                for r in sorted(rows, key=lambda r: r["mean_iterations"]):
                    print(f"{r['policy']:24} {r['threshold']:>8g} {r['mean_iterations']:>11.2f} "
                          f"{r['iterations_over_oracle'] or float('nan'):>8.2f}×")
                base = timed.get("fixed")
                print("ms/token at batch size 1: " + ", ".join(
                    f"{p} {ms:.3f}" + (f" ({base / ms:.2f}× fixed)" if base and p != "fixed" else "")
                    for p, ms in sorted(timed.items())))
    if "tiny-raven" in figures:
        tau = next(r["threshold"] for r in figures["tiny-raven"]["tasks"]["chains · exact_match,none"]["rows"]
                   if r["policy"] == "learned")
        table = by_hop(work / "tiny-raven.json", tau)
        figures["tiny-raven"]["by_hop"] = {"threshold": tau, "rows": table}
        print(f"\n[tiny-raven] held-out programs by hop: mean exit iteration (share exiting with a changed "
              f"prediction); learned τ={tau:g}, second_order τ=0.1")
        print(f"{'hop':>4} {'tokens':>7} {'oracle':>7} {'learned':>16} {'second_order':>18}")
        for r in table:
            print(f"{r['hop']:>4} {r['tokens']:>7} {r['oracle']:>7.2f} {r['learned']:>7.2f} ({r['learned_changed']:5.1%}) "
                  f"{r['second_order']:>8.2f} ({r['second_order_changed']:5.1%})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"\nwrote {args.json}")
    print(f"exit models and cells: {work}")


if __name__ == "__main__":
    main()
