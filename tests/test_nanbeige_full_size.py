"""Nanbeige4.2-3B at its real size (4.17B parameters in one bf16 file, 166,144-token vocabulary, 22 layers × 2
loops), random weights: `info` without the weights, a `trace` with an exit rule, one `run` cell, each within its
memory bound.

Slow (a few minutes on 2 cores): bench/make_nanbeige_size.py writes 8.3 GB under the temporary directory, deleted
afterwards. The fast tests of the same code on the tiny layout: tests/test_nanbeige.py.

Bounds: `info` peaks under 1 GB. A command that loads the model peaks under the weights' bytes plus 1 GB: the
process's own footprint, measured 0.77 GB (trace) and 0.87 GB (run) above the weights here, against Ouro-1.4B's
0.37-0.49 (tests/test_ouro_full_size.py): this model's RoPE table covers 262,144 positions (134 MB in float32),
its tokenizer 166,144 words, and each scored position's log-probabilities over them are float64 (1.3 MB). A second
copy of the weights would add 8.3 GB.
"""
from __future__ import annotations

import json

import pytest

from helpers.cli import full_size_env, written_full_size
from helpers.cli import run_exitbench_measured as exitbench  # (args, env, tmp_path): the process and its peak

pytestmark = pytest.mark.slow

PARAMETERS = 4_169_800_704
WEIGHT_BYTES = 2 * PARAMETERS  # bf16, untied
LOAD_BOUND = WEIGHT_BYTES + 1.0e9
INFO_BOUND = 1e9
DISK_NEEDED = 10e9


@pytest.fixture(scope="module")
def nanbeige_dir(tmp_path_factory):
    yield from written_full_size(tmp_path_factory, "nanbeige-size", "make_nanbeige_size.py", [], DISK_NEEDED, 1200)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return full_size_env(tmp_path_factory.mktemp("hash-cache"))


def test_info_reads_headers_only(nanbeige_dir, env, tmp_path):
    proc, peak = exitbench(["info", "-c", str(nanbeige_dir), "--json", "--plan", "--batch-size", "4", "--context",
                            "1000"], env, tmp_path)
    report = json.loads(proc.stdout)
    assert report["architecture"] == "nanbeige" and report["parameters"] == PARAMETERS
    assert report["dtype"] == report["stored_dtype"] == "bfloat16" and report["weight_bytes"] == WEIGHT_BYTES
    assert report["loop_groups"] == [{"name": "loops", "layers": 22, "default_steps": 2, "max_steps": 4,
                                      "random_init": False}]
    assert report["tokenizer"]["vocab_size"] == 166144
    # One KV slot per loop per layer (the reference's 44 caches), of the 8 key/value heads of 128.
    assert report["plan"]["kv_layout"]["slots_per_loop_layer"] == [2]
    assert report["plan"]["kv_cache"] == 2 * (2 * 22) * 4 * 1000 * 8 * 128 * 2
    assert peak < INFO_BOUND, f"info peaked at {peak / 1e9:.2f} GB"


def test_trace_with_an_exit_after_loop_one(nanbeige_dir, env, tmp_path):
    out = tmp_path / "trace.json"
    proc, peak = exitbench(["trace", "a=7 b=a", "-c", str(nanbeige_dir), "--policy", "confidence", "--threshold",
                            "0.001", "--generate", "2", "--json", str(out)], env, tmp_path)
    (trace,) = json.loads(out.read_text())["traces"]
    assert len(trace["generated_ids"]) == 2 and all(1 <= t["exit_steps"][0] <= 2 for t in trace["tokens"])
    assert peak <= LOAD_BOUND, f"trace peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"


def test_one_run_cell(nanbeige_dir, env, tmp_path):
    out = tmp_path / "results"
    proc, peak = exitbench(["run", "-c", str(nanbeige_dir), "--tasks", "chains_lambada", "--policy", "first_order",
                            "--thresholds", "1", "--baselines", "2", "--limit", "1", "--out", str(out), "--quiet"],
                           env, tmp_path)
    cells = [json.loads(f.read_text()) for f in out.glob("*.json")]
    # first_order: second_order cannot exit before the second of two loops, and is refused there
    assert sorted(c["policy"]["policy"] for c in cells) == ["first_order", "fixed"]
    assert all(c["model"]["dtype"] == "bfloat16" and c["model"]["parameters"] == PARAMETERS for c in cells)
    assert peak <= LOAD_BOUND, f"run peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"
