"""What a result cell is: one (model, task, exit config) point of a sweep, its schema, and how it is built.

Schema `exitbench.cell` version 2 (documented in the README):

    schema, schema_version, cell_id, key           what determines the cell (hashed into cell_id)
    model      path, source, architecture, parameters, fingerprint (content hash), files {name: sha256}, dtype
    task       name, version, n_shot, limit, n_samples, metrics {metric,filter: value}, stderr {...},
               higher_is_better {...}, primary_metric
    quality    metric, value, stderr, higher_is_better             the primary metric
    policy     every exit knob, resolved max_steps, baseline (true for fixed-depth cells), needs_logits
    iterations mean, median, p90, max, histogram {k: tokens}, tokens, requests (over each token's iterations
               summed over loop groups), per_group_mean [one mean per loop group]; attention_token_steps and
               mlp_token_steps: the iterations each token's attention layers and its MLPs ran, summed over
               tokens and loop groups (IBM vLLM-Hook's cost axes; they differ under exit mode freeze; absent
               from cells written before them); schedule: per request, in the task's order (document id, then request index), each token's
               iterations, as text: requests by ";", tokens by "," (what serve-sim replays; absent from cells
               written before it)
    wall_clock per_token_s (the scored tokens' own loops: what exits change), total_s and request_s
               (engine time with the full-depth prefill), probe_share (probe / (core + probe)), phases_s
               {prelude, core, probe, coda}, cell_s (this task's share of the lm-eval call); repeats
               {clock, batch_size, measured, repeats, requests, full_depth, per_token_s, full_per_token_s,
               ratios, ratio, spread, flops_ratio, overhead, documents, of_documents, drawn, whole_flops_ratio,
               expected_flops_ratio, representative, corrected_ratio, steps_ratio, schedule}: the throughput
               clock, documents drawn across the task timed again beside full depth at the run's batch size
               over a stream (timing/retime.py; absent when not; measured: "steady state", "whole pass" or
               "phases"; cells written before the draw have no `documents` and timed the task's first requests;
               schedule: loop steps ÷ what the tokens' iterations need, against full depth, absent before it);
               latency: the latency clock, the same fields at batch size 1 (clock "latency", batch_size 1);
               cells written before the two clocks carry one, `repeats` without clock, batch_size or measured
               and no latency: "batch (before two clocks)", one batch of 16 documents at the run's batch size,
               the scored tokens' loop phases only; untimed: why a task was not retimed (too few documents);
               overhead: the throughput repeats' time ratio ÷ their FLOP ratio (absent when not retimed, and in
               cells written before it);
               warnings [why its timing is unreliable] (absent when none)
    flops      per_token, probe_per_token
    numerics   nonfinite_tokens: tokens whose exit state or logits held a NaN or an infinity;
               nonconverging_tokens (contraction only): tokens that reached max_steps still not contracting
    speculation  depth speculation's cells alone (--policy speculate): rounds, drafted, accepted, acceptance_rate,
               accepted_per_round, tokens_per_round, draft_iterations_per_token, verify_iterations_per_token,
               steps_per_token (loop steps run one after another); their iterations are each token's share of its
               round's drafts and verification, and they have no iterations.schedule
    samples    whether the cell was asked for with its samples file (CELL.samples.jsonl beside it)
    run        run_id (one per `exitbench run` invocation), seed, batch_size, device, dtype, world_size,
               versions, git_revision, started, host, machine, load {start, end, cpus}; thresholds {from,
               span, recorded, grids} where `--thresholds quantiles:N` derived the grids (sweep/quantiles.py)
    mode       "replay" for a cell computed from a recording (exitbench.replay; then also in its key, and
               wall_clock.estimated is true); absent for an exact cell
    replay     recording_depth, record_s, cost_model_s, costs, generation {documents, diverged},
               exact_by_construction

A file that carries the schema tag must have every field above that readers use, of the type they expect
(`cell_schema.Cell`); one that does not is reported by name, never half-read.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

from ..errors import ExitbenchError
from ..runtime.validation import describe

SCHEMA = "exitbench.cell"
SCHEMA_VERSION = 2

def cell_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def series(policy: dict[str, Any]) -> str:
    """The name of the series a cell's policy section puts it in: the rule, `-rel` for relative step norms, and
    `-kvC` under a KV window (its own series, beside the same rule on the full cache), `-select` in exit mode
    select (every token runs every iteration; beside the physical exits), `-weighted` and `-freeze` likewise;
    depth speculation `speculate-k4` (drafts at depth τ, 4 a round), `speculate:second_order-k4` (drafts by a rule;
    no brackets, which the terminal tables read as markup)."""
    rel = "-rel" if policy.get("relative") else ""
    window = f"-kv{policy['kv_window']}" if policy.get("kv_window") else ""
    mode = f"-{policy['exit_mode']}" if policy.get("exit_mode") in ("select", "weighted", "freeze") else ""
    rule = conjunction(policy) if policy.get("rules") else policy["policy"]
    if policy.get("draft_tokens"):  # depth speculation: its draft (a depth is the cell's τ, a rule named) and k
        rule += (f":{policy['draft']['policy']}" if policy.get("draft") else "") + f"-k{policy['draft_tokens']}"
    return rule + rel + window + mode


def conjunction(policy: dict[str, Any]) -> str:
    """An all_of cell's series: its rules joined by ∧, each fixed threshold beside its rule and the varied rule
    bare (its threshold is the cell's τ), e.g. `margin 0.125 ∧ argmax_stability`."""
    rules = policy["rules"]
    vary = policy.get("vary") or next((r["policy"] for r in rules if r.get("threshold") is None), rules[0]["policy"])
    return " ∧ ".join(r["policy"] + ("-rel" if r.get("relative") else "")
                      + ("" if r["policy"] == vary or r.get("threshold") is None else f" {r['threshold']:g}")
                      for r in rules)


def filename(cell: dict[str, Any]) -> str:
    p = cell["policy"]
    threshold = "" if p["threshold"] is None else f"{p['threshold']:g}"
    name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", series(p))  # a conjunction's ∧ and spaces stay out of file names
    return f"{cell['task']['name']}__{name}-{threshold}__{cell['cell_id']}.json"


def mode(cell: dict[str, Any]) -> str:
    """"replay" for a cell computed from a recording (exitbench.replay), "exact" otherwise (older cells too)."""
    return cell.get("mode", "exact")


def is_cell(obj: Any) -> bool:
    """Whether a parsed JSON document claims to be a cell (other exitbench reports carry other schema tags)."""
    return isinstance(obj, dict) and obj.get("schema") == SCHEMA


def validate(cell: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The cell itself, or ExitbenchError naming the file and the first thing wrong with it: a field a reader
    uses that is missing or of the wrong type (`cell_schema.Cell`)."""
    from pydantic import ValidationError

    from .schema import Cell

    version = cell.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # 2.0 or true is not version 2: a hand edit
        raise ExitbenchError(f"{path} has cell schema version {cell.get('schema_version')!r}; this exitbench reads "
                             f"version {SCHEMA_VERSION} (rerun the sweep into a new --out)")
    try:
        Cell.model_validate(cell)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(map(str, first["loc"]))
        if first["type"] == "missing":
            problem = f"it lacks {where}"
        elif first["type"] == "value_error":  # a check of the cell against itself (schema.py), said as it is
            said = first["msg"].removeprefix("Value error, ")
            problem = f"{where}: {said}" if where else said
        else:
            problem = describe(exc)
        raise ExitbenchError(f"{path} is a broken cell: {problem}; delete it or rerun the cell") from None
    return cell


def read(path: Path) -> dict[str, Any]:
    """A cell, or ExitbenchError naming the file when it is not a whole cell of this schema version."""
    try:
        cell = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExitbenchError(f"{path} is not a readable JSON cell: {exc}") from None
    if not is_cell(cell):
        raise ExitbenchError(f"{path} is not an exitbench result cell (schema {SCHEMA!r} expected)")
    return validate(cell, path)


def scan(paths: Iterable[Path], strict: bool = False) -> tuple[list[tuple[Path, dict[str, Any]]], list[Path]]:
    """(path, cell) for every file that is a cell, and the files skipped because they are not cells (other
    JSON reports, unreadable files). A file tagged as a cell but broken stops the scan (ExitbenchError). With
    `strict` (a gate), so does a file that cannot be read as JSON at all: it may be a cell cut short, and a
    gate that skipped it would pass without comparing it."""
    found, skipped = [], []
    for path in sorted(paths):
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            if strict:
                raise ExitbenchError(f"{path} cannot be read as JSON ({exc}); it may be a result cell cut short, "
                                     "and a gate does not skip what it cannot read: repair, rerun or remove it") from None
            skipped.append(path)
            continue
        if not is_cell(obj):
            skipped.append(path)
            continue
        found.append((path, validate(obj, path)))
    return found, skipped


# ---- what a cell's numbers are built from ---------------------------------------------------------------------
def request_stats(records: list[Any], seconds: float, prompt: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """What one lm-eval request cost, from its tokens' engine records: exit steps, iterations, FLOPs,
    wall-clock and the probe's share. `seconds` is the request's share of its batches' wall-clock; `prompt`:
    the prompt positions that ran with exits (prefill exit) and their iterations, which no record holds."""
    iterations = [sum(r.exit_steps) for r in records]
    phase: dict[str, float] = defaultdict(float)
    for r in records:
        for k, v in r.time_s.items():
            phase[k] += v
    core_probe = phase["core"] + phase["probe"]
    return {
        "tokens": len(records),
        # each token's context length summed: what its cost at any other depth follows (FlopModel's a + b · context)
        "context_sum": sum(r.position + 1 for r in records),
        "exit_steps": [r.exit_steps for r in records],
        "iterations": iterations,
        "mean_iterations": sum(iterations) / len(iterations) if iterations else 0.0,
        "flops": sum(r.flops["total"] for r in records),
        "probe_flops": sum(r.flops["probe"] for r in records),
        "seconds": seconds,
        # only what the scored tokens' own loops cost: the part exits change (the prefill is in `seconds`)
        "token_seconds": sum(phase.values()),
        "phase_seconds": dict(phase),
        "probe_share": phase["probe"] / core_probe if core_probe else 0.0,
        "nonfinite": sum(1 for r in records if r.nonfinite),
        "attention_token_steps": sum(r.token_steps[0] for r in records),
        "mlp_token_steps": sum(r.token_steps[1] for r in records),
        # only under a rule that can tell (contraction): tokens at the cap still not settling by its measure
        **({"nonconverging": sum(1 for r in records if r.stalled)}
           if any(getattr(r, "stalled", None) is not None for r in records) else {}),
        **({"prompt_positions": prompt[0], "prompt_iterations": prompt[1]} if prompt[0] else {}),
    }


def every_position(stats: list[dict[str, Any]], its: list[int]) -> dict[str, Any]:
    """Where prompt positions looped too (prefill exit): the mean iterations over every position the requests ran,
    scored or not (`every_position`). The cell's `mean` stays the scored tokens', the positions every cell counts;
    a rule that ranks all positions (the budgeted prefill exit) spends most of its loops on the prompt."""
    positions = sum(s.get("prompt_positions", 0) for s in stats)
    if not positions:
        return {}
    total = sum(its) + sum(s.get("prompt_iterations", 0) for s in stats)
    return {"every_position": {"positions": positions + len(its), "mean": total / (positions + len(its))}}


def task_order(stats: dict[str, Any]) -> tuple:
    """A request's place in its task: its document's id (numbers before names), then its own index."""
    doc = stats.get("doc_id")
    return (0, doc, "") if isinstance(doc, int) else (1, 0, str(doc)), stats.get("idx") or 0


def summarize(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The iterations, wall_clock, flops and numerics sections of a cell from per-request stats."""
    its = [k for s in stats for k in s["iterations"]]
    tokens = len(its)
    # Each token's exit step per loop group (looped GPT-2 has several groups; iterations above are their sum).
    per_token = [steps for s in stats for steps in s["exit_steps"]]
    per_group = [statistics.fmean(g) for g in zip(*per_token)] if per_token else []
    seconds = sum(s["seconds"] for s in stats)
    token_seconds = sum(s["token_seconds"] for s in stats)
    phases: Counter = Counter()
    for s in stats:
        phases.update(s["phase_seconds"])
    core_probe = phases["core"] + phases["probe"]
    ordered = sorted(its)
    out = {
        "iterations": {
            "mean": statistics.fmean(its) if its else None, "median": statistics.median(its) if its else None,
            "p90": ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)] if its else None,
            "max": max(its) if its else None, "histogram": {str(k): v for k, v in sorted(Counter(its).items())},
            "tokens": tokens, "requests": len(stats), "per_group_mean": per_group,
            **{name: sum(s[name] for s in stats) for name in ("attention_token_steps", "mlp_token_steps")},
            # each request's tokens' iterations, in the task's order (its documents', then their requests'), not
            # the order a run took them, which torchrun's ranks change: what a serving simulation replays
            # (analysis/serve_sim.py); as text ("5,6;16,3": requests by ";", tokens by ","), since a list of lists
            # indents to a line a token
            "schedule": ";".join(",".join(map(str, s["iterations"])) for s in sorted(stats, key=task_order)),
            **every_position(stats, its)},
        "wall_clock": {"total_s": seconds, "per_token_s": token_seconds / tokens if tokens else None,
                       "request_s": seconds / len(stats) if stats else None,
                       "probe_share": phases["probe"] / core_probe if core_probe else 0.0,
                       "phases_s": dict(phases)},
        "flops": {"per_token": sum(s["flops"] for s in stats) / tokens if tokens else None,
                  "probe_per_token": sum(s["probe_flops"] for s in stats) / tokens if tokens else None},
        "numerics": {"nonfinite_tokens": sum(s.get("nonfinite", 0) for s in stats),
                     **({"nonconverging_tokens": sum(s.get("nonconverging", 0) for s in stats)}
                        if any("nonconverging" in s for s in stats) else {})},
        # How the engine ran the cell's requests (exitbench.engine.waves): depth_major, token_major, or both.
        "engine": {"schedule": "+".join(sorted({s["schedule"] for s in stats if "schedule" in s})) or None},
    }
    rounds = speculation(stats, tokens)
    if rounds:
        # (no schedule: a token's share of its round's drafts and verification is no loop a serving simulation
        # could replay, and it may exceed full depth where drafts were rejected)
        del out["iterations"]["schedule"]
    return out | rounds


def speculation(stats: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """A speculation cell's `speculation` section from its requests' rounds (none for an exit rule's cell):
    rounds, drafts made and kept, tokens per round (a round emits its kept drafts and one token of full depth's
    own), and the loop iterations per emitted token that drafts and verification ran (their sum is the cell's
    mean iterations)."""
    rounds = [s["speculation"] for s in stats if s.get("speculation")]
    if not rounds:
        return {}
    n = sum(len(r["accepted"]) for r in rounds)
    kept, drafted = sum(sum(r["accepted"]) for r in rounds), sum(r["drafted"] for r in rounds)

    def per_token(name: str) -> float | None:
        return sum(r[name] for r in rounds) / tokens if tokens else None

    return {"speculation": {"rounds": n, "drafted": drafted, "accepted": kept,
                            "acceptance_rate": kept / drafted if drafted else None,
                            "accepted_per_round": kept / n if n else None,
                            "tokens_per_round": (kept + n) / n if n else None,
                            "draft_iterations_per_token": per_token("draft_iterations"),
                            "verify_iterations_per_token": per_token("verify_iterations"),
                            # loop steps one after another: a verify pass runs its positions' iterations side by side
                            "steps_per_token": per_token("steps")}}


def attach_exits(samples: list[dict[str, Any]], stats: list[dict[str, Any]]) -> None:
    """Join each lm-eval sample with its requests' exits (by doc_id), in place: `sample["exitbench"]` holds its
    iteration summary and each exited token's exit steps, text, log-probability and greedy flag."""
    by_doc: dict[Any, list[dict]] = {}
    for s in stats:
        by_doc.setdefault(s["doc_id"], []).append(s)
    for sample in samples:
        doc = by_doc.get(sample.get("doc_id"), [])
        its = {k: v for k, v in summarize(doc)["iterations"].items() if k != "schedule"}  # exit_steps says it
        sample["exitbench"] = {"requests": len(doc), **its,
                               **{k: [e for s in doc for e in s.get(k, [])]
                                  for k in ("exit_steps", "token_text", "logprobs", "greedy")}}


def task_record(results: dict[str, Any], name: str, limit: int | float | None) -> dict[str, Any]:
    """The task section of a cell, from lm-eval's results dict, its numbers unchanged."""
    r = results["results"][name]
    skip = {"alias", "name", "sample_len", " ", ""}
    metrics = {k: v for k, v in r.items() if k not in skip and "_stderr," not in k and isinstance(v, (int, float))}
    stderr = {k.replace("_stderr,", ","): v for k, v in r.items() if "_stderr," in k}
    hib_raw = results.get("higher_is_better", {}).get(name, {})
    higher = {k: bool(hib_raw.get(k.split(",")[0], True)) for k in metrics}
    if not metrics:
        raise ExitbenchError(f"lm-eval reported no metric for task {name}")
    primary = next(iter(metrics))
    return {"name": name, "version": results.get("versions", {}).get(name),
            "n_shot": results.get("n-shot", {}).get(name), "limit": limit,
            "n_samples": results.get("n-samples", {}).get(name), "metrics": metrics, "stderr": stderr,
            "higher_is_better": higher, "primary_metric": primary}


def build(key: dict[str, Any], model: dict[str, Any], task: dict[str, Any], policy: dict[str, Any],
          stats: list[dict[str, Any]], run: dict[str, Any], samples: bool) -> dict[str, Any]:
    primary = task["primary_metric"]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "cell_id": cell_id(key), "key": key, "model": model,
        "task": task,
        "quality": {"metric": primary, "value": task["metrics"][primary], "stderr": task["stderr"].get(primary),
                    "higher_is_better": task["higher_is_better"][primary]},
        "policy": policy, **summarize(stats), "samples": samples, "run": run,
    }


def strict(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None: cells are strict JSON, and a non-finite metric
    (a broken model's perplexity, say) reads as "no number", with numerics.nonfinite_tokens saying why."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return strict(value.item())  # numpy / torch scalars from lm-eval metrics
    return value


def jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()  # numpy / torch scalars from lm-eval metrics
    return str(value)
