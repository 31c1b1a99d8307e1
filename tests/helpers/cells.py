"""Result cells: reading the ones a sweep writes, checking one against the schema documented in
exitbench/cells.py, hand-made ones with known answers for the readers (pareto, check), and copies of the committed
baseline's cells, changed as a test needs."""
from __future__ import annotations

import contextlib
import json
import socket
import statistics
import subprocess
import threading
from pathlib import Path
from typing import Any

from exitbench.store import cells, disk
from exitbench.engine import ExitConfig

from helpers.paths import BASELINE, REPO

EXIT_KNOBS = set(ExitConfig().to_dict())


def cell_files(directory: Path) -> list[Path]:
    """What a reader of the directory counts as cells: the *.json files (never the .tmp leftovers)."""
    return sorted(directory.glob("*.json"))


def load_cells(directory: Path) -> dict[str, dict[str, Any]]:
    """file name → parsed cell, every *.json under `directory` (each must be a readable cell)."""
    return {p.name: cells.read(p) for p in cell_files(directory)}


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """file name → (inode, mtime_ns, size) of every cell file."""
    out = {}
    for p in cell_files(directory):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def baseline_cells(task: str = "chains_mc", series: tuple[str, ...] = ("fixed", "kl", "oracle")) -> list[Path]:
    """A few committed cells of one task: enough for a frontier, a full depth and an oracle."""
    return sorted(p for p in BASELINE.glob(f"{task}__*.json")
                  if any(p.name.startswith(f"{task}__{s}-") for s in series))


def copy_cells(dst: Path, paths: list[Path], change=None, renamed: bool = False) -> Path:
    """The cells copied into `dst`, each passed through `change(cell)` first (which may edit it in place), under
    its own name, or (`renamed`) under the name its new content gives it."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in paths:
        cell = json.loads(p.read_text())
        if change is not None:
            change(cell)
        (dst / (cells.filename(cell) if renamed else p.name)).write_text(json.dumps(cell))
    return dst


def by_config(cell_map: dict[str, dict]) -> dict[tuple[str, str, float], dict]:
    """(task, policy, threshold) → cell."""
    out = {}
    for cell in cell_map.values():
        key = (cell["task"]["name"], cell["policy"]["policy"], float(cell["policy"]["threshold"]))
        assert key not in out, f"two cells for {key}"
        out[key] = cell
    return out


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_cell(cell: dict[str, Any], path: Path | None = None, source: str = "embedded:tiny-raven",
               architecture: str = "huginn_raven") -> None:
    """Assert `cell` follows the schema documented in exitbench/cells.py (exitbench.cell, version 2)."""
    assert cell["schema"] == "exitbench.cell" == cells.SCHEMA
    assert cell["schema_version"] == 2 == cells.SCHEMA_VERSION
    key = cell["key"]
    assert cell["cell_id"] == cells.cell_id(key)
    assert len(cell["cell_id"]) == 16 and int(cell["cell_id"], 16) >= 0
    if path is not None:
        assert path.name == cells.filename(cell)
        assert path.name.endswith(f"__{cell['cell_id']}.json")
        assert path.name.startswith(f"{cell['task']['name']}__{cell['policy']['policy']}")

    model = cell["model"]
    for field in ("path", "source", "architecture", "parameters", "fingerprint", "dtype"):
        assert field in model, field
    assert model["dtype"] == key["dtype"]
    assert model["source"] == source and model["architecture"] == architecture
    assert model["parameters"] > 0 and model["fingerprint"] == key["model"]

    task = cell["task"]
    for field in ("name", "version", "n_shot", "limit", "n_samples", "metrics", "stderr", "higher_is_better",
                  "primary_metric"):
        assert field in task, field
    assert task["name"] == key["task"] and task["limit"] == key["limit"]
    assert task["metrics"] and all(_number(v) for v in task["metrics"].values())
    assert all("," in k and "_stderr" not in k for k in task["metrics"])
    assert set(task["higher_is_better"]) == set(task["metrics"])
    assert task["primary_metric"] in task["metrics"]

    quality = cell["quality"]
    assert set(quality) >= {"metric", "value", "stderr", "higher_is_better"}
    assert quality["metric"] == task["primary_metric"]
    assert quality["value"] == task["metrics"][quality["metric"]]
    assert quality["higher_is_better"] == task["higher_is_better"][quality["metric"]]

    policy = cell["policy"]
    assert set(policy) >= EXIT_KNOBS | {"max_steps", "baseline"}
    assert {k: policy[k] for k in EXIT_KNOBS if k not in ("max_steps", "patience", "threshold")} == \
        {k: key["exit"][k] for k in EXIT_KNOBS if k not in ("max_steps", "patience", "threshold")}
    assert policy["baseline"] == (policy["policy"] == "fixed")
    assert isinstance(policy["max_steps"], int) and policy["max_steps"] >= 1
    if policy["baseline"]:
        assert policy["max_steps"] == policy["threshold"]

    its = cell["iterations"]
    for field in ("mean", "median", "p90", "max", "histogram", "tokens", "requests"):
        assert field in its, field
    assert its["tokens"] > 0 and its["requests"] > 0
    hist = {int(k): v for k, v in its["histogram"].items()}
    # A token's iterations are summed over loop groups (one for Raven, several for a looped GPT-2).
    groups = len(its["per_group_mean"])
    assert groups >= 1 and abs(sum(its["per_group_mean"]) - its["mean"]) < 1e-9
    assert sum(hist.values()) == its["tokens"]
    assert its["max"] == max(hist) <= groups * policy["max_steps"]
    assert abs(its["mean"] - sum(k * v for k, v in hist.items()) / its["tokens"]) < 1e-9
    assert min(hist) <= its["median"] <= its["p90"] <= its["max"]
    if policy["baseline"]:
        assert hist == {groups * policy["threshold"]: its["tokens"]}

    wall = cell["wall_clock"]
    for field in ("per_token_s", "total_s", "request_s", "probe_share", "phases_s", "cell_s"):
        assert field in wall, field
    assert wall["total_s"] > 0 and wall["per_token_s"] > 0 and 0 <= wall["probe_share"] <= 1
    assert set(wall["phases_s"]) >= {"prelude", "core", "probe", "coda"}

    assert cell["flops"]["per_token"] > 0 and cell["flops"]["probe_per_token"] >= 0

    run = cell["run"]
    for field in ("seed", "batch_size", "device", "dtype", "world_size", "versions", "git_revision", "started",
                  "host", "machine"):
        assert field in run, field
    assert run["seed"] == key["seed"] and run["batch_size"] == key["batch_size"]
    assert run["device"] == key["device"] and run["dtype"] == key["dtype"]
    assert run["host"] == socket.gethostname()
    # Which CPU and kernels: float32 results, so exits near a threshold, differ in their last bits between them.
    assert {"cpu", "cpu_capability", "cores"} <= set(run["machine"]), run["machine"]
    import lm_eval
    import torch

    assert run["versions"]["torch"] == torch.__version__
    assert run["versions"]["lm_eval"] == getattr(lm_eval, "__version__", run["versions"]["lm_eval"])
    assert run["versions"]["exitbench"]
    head = git_head()
    if head is not None:
        assert run["git_revision"] in (head, head + "-dirty")

    # strict JSON on disk: no NaN / Infinity
    if path is not None:
        json.loads(path.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def computed(cell: dict[str, Any]) -> dict[str, Any]:
    """The parts of a cell that are results (not timing or provenance): must agree between equivalent runs."""
    return {"cell_id": cell["cell_id"], "key": cell["key"], "model": cell["model"], "task": cell["task"],
            "quality": cell["quality"], "policy": cell["policy"], "iterations": cell["iterations"],
            "flops": cell["flops"]}


def hand_made_cell(task, metric, higher, policy, tau, quality, iters, sec, max_steps=16) -> dict[str, Any]:
    """A cell with only the fields pareto and check read, the numbers given (iterations `iters`, `sec` s/token)."""
    key = {"task": task, "policy": policy, "tau": tau}
    return {"schema": cells.SCHEMA, "schema_version": cells.SCHEMA_VERSION, "cell_id": cells.cell_id(key), "key": key,
            "model": {"fingerprint": "m", "architecture": "huginn_raven", "dtype": "float32"},
            "task": {"name": task, "limit": None, "n_shot": 0, "metrics": {metric: quality}, "primary_metric": metric},
            "quality": {"metric": metric, "value": quality, "higher_is_better": higher},
            "policy": {"policy": policy, "threshold": tau, "relative": False, "max_steps": tau if policy == "fixed"
                       else max_steps},
            "iterations": {"mean": iters, "tokens": 100}, "wall_clock": {"per_token_s": sec, "probe_share": 0.0},
            "flops": {"per_token": 1000 * iters}, "run": {"started": "2026-11-30T00:00:00+00:00", "run_id": "r1"}}


# Two hand-made tasks with known frontiers (test_pareto) and regressions to find in them (test_check).
ACC = [  # accuracy, higher is better; full depth = fixed 16 at 0.90, 1.0 ms/token
    hand_made_cell("t", "acc", True, "fixed", 4, 0.50, 4, 0.25e-3),
    hand_made_cell("t", "acc", True, "fixed", 16, 0.90, 16, 1.0e-3),
    hand_made_cell("t", "acc", True, "kl", 1e-3, 0.90, 6, 0.8e-3),        # on the frontier
    hand_made_cell("t", "acc", True, "kl", 1e-2, 0.80, 5, 0.6e-3),        # on the frontier
    # within 0.5% of 0.90, dominated (kl 6 @ 0.90)
    hand_made_cell("t", "acc", True, "second_order", 0.1, 0.896, 7, 0.5e-3),
    # dominated everywhere on iterations; 2.08× as fast as full depth, within its iteration bound 16 / 7.5
    hand_made_cell("t", "acc", True, "second_order", 1.0, 0.70, 7.5, 0.48e-3),
    hand_made_cell("t", "acc", True, "oracle", 0.01, 0.90, 4.5, 2e-3),     # on the frontier
]
PPL = [  # perplexity, lower is better; full depth 1.00
    hand_made_cell("u", "ppl", False, "fixed", 1, 9.0, 1, 0.1e-3),
    hand_made_cell("u", "ppl", False, "fixed", 16, 1.00, 16, 1.0e-3),
    hand_made_cell("u", "ppl", False, "first_order", 0.1, 1.004, 8, 0.5e-3),
    hand_made_cell("u", "ppl", False, "first_order", 1.0, 1.5, 4, 0.3e-3),
    hand_made_cell("u", "ppl", False, "oracle", 0.01, 1.00, 4, 2e-3),
]


def paired(cell, ratios, full_depth=16, drawn=True, corrected=None, clock=None, documents=16):
    """`cell` as a sweep leaves it after retiming it beside full depth (timing/retime.py) with these ratios: on
    `documents` of 128 documents drawn across the task, or (`drawn` false) as cells written before the draw, on
    the task's first requests; `corrected`, the ratio carried to the whole task where the draw's FLOPs strayed.
    `clock`: None as cells written before the two clocks (their one clock under `repeats`, no `clock` field),
    "throughput" (under `repeats`, at batch size 16, its steady state) or "latency" (under `latency`, batch size 1)
    as a sweep since writes them."""
    median = statistics.median(ratios)
    timed = {"repeats": len(ratios), "requests": documents, "full_depth": full_depth, "ratios": ratios,
             "ratio": median, "spread": (max(ratios) - min(ratios)) / median}
    if drawn:
        timed.update({"documents": list(range(0, 128, 128 // documents)), "of_documents": 128,
                      "drawn": "stratified by cost", "representative": corrected is None, "corrected_ratio": corrected})
    if clock is not None:
        latency = clock == "latency"
        timed.update({"clock": clock, "batch_size": 1 if latency else 16,
                      "measured": "whole pass" if latency else "steady state"})
    cell["wall_clock"]["latency" if clock == "latency" else "repeats"] = timed
    return cell


def two_clocks(cell, throughput, latency, full_depth=16):
    """`cell` retimed on both clocks as a sweep since the two clocks leaves it (`paired`): the throughput clock's
    ratios on a stream of 64 documents, the latency clock's on 8."""
    paired(cell, throughput, full_depth, clock="throughput", documents=64)
    return paired(cell, latency, full_depth, clock="latency", documents=8)


def write_cells(directory: Path, cell_list: list[dict[str, Any]]) -> dict[str, Path]:
    """Each cell as a file under `directory`, named as a sweep names it; cell_id → path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for cell in cell_list:
        path = directory / cells.filename(cell)
        path.write_text(json.dumps(cell))
        out[cell["cell_id"]] = path
    return out


def write_samples(cell_path: Path, docs: dict[int, tuple[float, list[int]]]) -> Path:
    """A samples file beside a cell in the format `exitbench run --log-samples` writes: doc_id → (acc, exit
    step of each of the doc's tokens). The tokens are named t0, t1, …; the last one is a greedy miss."""
    lines = []
    for doc, (acc, steps) in docs.items():
        n = len(steps)
        lines.append(json.dumps({
            "doc_id": doc, "arguments": [[f"context of doc {doc}", " answer"]], "metrics": ["acc"], "acc": acc,
            "exitbench": {"mean": sum(steps) / n, "tokens": n, "exit_steps": [[k] for k in steps],
                          "token_text": [f" t{i}" for i in range(n)], "logprobs": [-0.5] * n,
                          "greedy": [True] * (n - 1) + [False]}}))
    path = cell_path.with_suffix(".samples.jsonl")
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def held_by_another_sweep(out: Path, key: dict[str, Any], made: dict[str, Any], staging: Path, after_s: float):
    """The cell of `key` claimed here as another sweep would claim it; `after_s` seconds in, that sweep writes
    it (`made` under this key, run_id "the-other-sweep", atomically) and lets go. An flock belongs to the open
    file, so the claim refuses the sweep's own as another process's would."""
    theirs = {**made, "cell_id": cells.cell_id(key), "key": key, "run": {**made["run"], "run_id": "the-other-sweep"}}
    held = disk.Claim(out, cells.cell_id(key))
    assert held.acquire()

    def the_holder_finishes():
        staging.write_text(json.dumps(theirs))
        staging.replace(out / cells.filename(theirs))
        held.release()

    timer = threading.Timer(after_s, the_holder_finishes)
    timer.start()
    try:
        yield
    finally:
        timer.join()
        held.release()
