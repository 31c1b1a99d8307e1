"""One tidy table of result cells: a row per cell, plain columns (no "task · metric" compound keys), for
pandas, R or a spreadsheet. Every cell under the directories is a row, of every model and both modes; a
script filters on the columns."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ExitbenchError
from ..store import cells

COLUMNS = ["cell_id", "mode", "backend", "model", "fingerprint", "architecture", "dtype", "task", "n_shot", "limit",
           "metric", "quality", "stderr", "higher_is_better", "policy", "series", "threshold", "exit_mode",
           "min_steps", "max_steps", "patience", "relative", "kv_window", "mean_iterations", "p90_iterations",
           "ms_per_token", "wall_clock_estimated", "wall_clock_basis", "time_ratio", "time_spread", "timing_repeats",
           "speedup", "speedup_low", "speedup_high", "speedup_basis", "iteration_bound", "speedup_flag",
           "timed_documents", "of_documents", "sample_flops_ratio", "whole_flops_ratio", "overhead",
           "overhead_timing", "schedule", "clock", "clock_measured", "speedup_throughput", "overhead_throughput",
           "speedup_latency", "speedup_latency_low", "speedup_latency_high", "speedup_latency_basis",
           "speedup_latency_flag", "overhead_latency", "timing_warnings", "probe_share",
           "flops_per_token", "attention_token_steps", "mlp_token_steps", "draft", "draft_tokens", "acceptance_rate",
           "tokens_per_round", "steps_per_token", "batch_size", "device", "run_id",
           "git_revision",
           "started", "preset", "file"]


def row(path: Path, cell: dict[str, Any], full: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cell's columns; `full`, its full-depth cell (`frontier.references`), gives its overhead. `speedup` and
    `overhead` are the throughput clock's, or a cell's one clock before the two (`clock` says which);
    `speedup_throughput` and `overhead_throughput` are the throughput clock's paired repeats alone, the
    `_latency` columns the latency clock's (timing/speedup.py)."""
    from .frontier import latency_fields, overhead_fields
    from ..timing.speedup import REPEATED, clock_basis, estimate, record, repeats_clock

    policy, wall = cell["policy"], cell.get("wall_clock", {})
    per_token = wall.get("per_token_s")
    repeats = wall.get("repeats") or {}
    # (after the speed-up's own fields: `timing_repeats` is the repeats', present whatever the basis)
    speed = {k: v for k, v in estimate(cell, full).to_dict().items() if k != "timing_repeats"}
    overheads = overhead_fields(cell, full)
    clock = repeats_clock(cell) if speed["speedup_basis"] in REPEATED else None
    # (the throughput clock's own numbers: none from two evaluations divided, nor from the clock before the two)
    throughput = clock == "throughput"
    return {
        "cell_id": cell["cell_id"], "mode": cell.get("mode", "exact"),
        # the engine that ran it: hf (exitbench's own, and every cell written before vLLM's) or vllm
        "backend": cell.get("key", {}).get("backend", "hf"),
        "model": cell["model"].get("source") or cell["model"].get("path"), "fingerprint": cell["model"]["fingerprint"],
        "architecture": cell["model"]["architecture"], "dtype": cell["model"]["dtype"],
        "task": cell["task"]["name"], "n_shot": cell["task"].get("n_shot"), "limit": cell["task"].get("limit"),
        "metric": cell["quality"]["metric"], "quality": cell["quality"]["value"],
        "stderr": cell["quality"].get("stderr"), "higher_is_better": cell["quality"]["higher_is_better"],
        "policy": policy["policy"], "series": cells.series(policy), "threshold": policy.get("threshold"),
        "exit_mode": policy.get("exit_mode") or "physical", "min_steps": policy.get("min_steps"),
        "max_steps": policy.get("max_steps"), "patience": policy.get("patience"), "relative": policy.get("relative"),
        "kv_window": policy.get("kv_window"), "mean_iterations": cell["iterations"].get("mean"),
        "p90_iterations": cell["iterations"].get("p90"),
        "ms_per_token": None if per_token is None else 1000 * per_token,
        # a replay cell's time is priced by its cost model, not timed: said in every row that carries it
        "wall_clock_estimated": bool(wall.get("estimated")), "wall_clock_basis": clock_basis(cell) or "timed",
        "time_ratio": repeats.get("ratio"), "time_spread": repeats.get("spread"),
        "timing_repeats": repeats.get("repeats"), **speed,
        "sample_flops_ratio": repeats.get("flops_ratio"), "whole_flops_ratio": repeats.get("whole_flops_ratio"),
        **overheads, "clock": clock, "clock_measured": (record(cell) or {}).get("measured") if clock else None,
        "speedup_throughput": speed["speedup"] if throughput else None,
        "overhead_throughput": overheads["overhead"] if throughput and overheads["overhead_timing"] != "plain"
        else None,
        **{k: v for k, v in latency_fields(cell, full).items() if k != "speedup_latency_documents"},
        "timing_warnings": "; ".join(wall.get("warnings", [])) or None, "probe_share": wall.get("probe_share"),
        "flops_per_token": cell.get("flops", {}).get("per_token"),
        # (cells written before these counters existed have none)
        "attention_token_steps": cell["iterations"].get("attention_token_steps"),
        "mlp_token_steps": cell["iterations"].get("mlp_token_steps"),
        # depth speculation's cells alone: the draft (a depth, or the exit rule that drafts), k, and how it went
        **speculation_fields(policy, cell.get("speculation")), "batch_size": cell["run"].get("batch_size"),
        "device": cell["run"].get("device"), "run_id": cell["run"].get("run_id"),
        "git_revision": cell["run"].get("git_revision"), "started": cell["run"].get("started"),
        "preset": (cell.get("preset") or {}).get("name"), "file": str(path),
    }


def speculation_fields(policy: dict[str, Any], rounds: dict[str, Any] | None) -> dict[str, Any]:
    if not policy.get("draft_tokens"):
        return dict.fromkeys(("draft", "draft_tokens", "acceptance_rate", "tokens_per_round", "steps_per_token"))
    draft = (policy.get("draft") or {}).get("policy") or f"depth {policy['threshold']:g}"
    return {"draft": draft, "draft_tokens": policy["draft_tokens"],
            **{k: (rounds or {}).get(k) for k in ("acceptance_rate", "tokens_per_round", "steps_per_token")}}


def tidy(directories: list[Path]) -> list[dict[str, Any]]:
    """A row per result cell under `directories` (recursively; files that are not cells are left out)."""
    paths = sorted({p for d in directories for p in Path(d).rglob("*.json")})
    found, _ = cells.scan(paths)
    if not found:
        raise ExitbenchError(f"no result cells under {', '.join(map(str, directories))}")
    from .frontier import references

    full = references([cell for _, cell in found])
    return sorted((row(path, cell, full.get(cell["cell_id"])) for path, cell in found),
                  key=lambda r: (r["model"] or "", r["task"], r["metric"], r["series"], r["threshold"] or 0, r["mode"]))


def write(rows: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        import json

        return json.dumps(rows, indent=2)
    if fmt != "csv":
        raise ExitbenchError(f"--format must be csv or json; got {fmt!r}")
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
