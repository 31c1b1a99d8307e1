"""HRM-Text-1B at its real size (1.18B parameters in one bf16 file, 65,536-token vocabulary, two stacks of 16
layers, 2 H cycles of 3 L cycles), random weights: `info` without the weights, a `trace` with an exit rule, one
`run` cell, each within its memory bound.

Slow (a minute or two on 2 cores): bench/make_hrm_text_size.py writes 2.4 GB under the temporary directory, deleted
afterwards. The fast tests of the same code on the tiny layout: tests/test_hrm_text.py.

Bounds: `info` peaks under 1 GB. A command that loads the model peaks under the weights' bytes plus 0.8 GB: the
process's own footprint (torch, lm-eval and the tokenizer), measured 0.42 GB (trace) and 0.55 GB (run) above the
weights here, as Ouro-1.4B's 0.37-0.49 GB (tests/test_ouro_full_size.py), and its KV cache, 128 slots of 12 heads
× 128 per position (768 KiB a position in bf16, the reference's count). A second copy of the weights would add
2.4 GB.
"""
from __future__ import annotations

import json

import pytest

from helpers.cli import full_size_env, written_full_size
from helpers.cli import run_exitbench_measured as exitbench  # (args, env, tmp_path): the process and its peak

pytestmark = pytest.mark.slow

PARAMETERS = 1_182_795_264
WEIGHT_BYTES = 2 * PARAMETERS  # bf16, untied
LOAD_BOUND = WEIGHT_BYTES + 0.8e9
INFO_BOUND = 1e9
DISK_NEEDED = 4e9


@pytest.fixture(scope="module")
def hrm_dir(tmp_path_factory):
    yield from written_full_size(tmp_path_factory, "hrm-text-size", "make_hrm_text_size.py", [], DISK_NEEDED, 600)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return full_size_env(tmp_path_factory.mktemp("hash-cache"))


def test_info_reads_headers_only(hrm_dir, env, tmp_path):
    proc, peak = exitbench(["info", "-c", str(hrm_dir), "--json", "--plan", "--batch-size", "4", "--context",
                            "1000"], env, tmp_path)
    report = json.loads(proc.stdout)
    assert report["architecture"] == "hrm_text" and report["parameters"] == PARAMETERS
    assert report["dtype"] == report["stored_dtype"] == "bfloat16" and report["weight_bytes"] == WEIGHT_BYTES
    assert report["loop_groups"] == [{"name": "cycles", "layers": 32, "default_steps": 2, "max_steps": 4,
                                      "random_init": False}]
    assert report["tokenizer"]["vocab_size"] == 65536
    # Per H cycle, four stack calls of 16 layers (64 cache layers), one slot per cycle: at the trained 2 cycles
    # the reference's 128 slots per position, keys and values of 12 heads × 128 in bf16.
    assert report["plan"]["kv_layout"]["slots_per_loop_layer"] == [2]
    assert report["plan"]["kv_cache"] == 2 * (2 * 64) * 4 * 1000 * 12 * 128 * 2
    assert peak < INFO_BOUND, f"info peaked at {peak / 1e9:.2f} GB"


def test_trace_with_an_exit_after_cycle_one(hrm_dir, env, tmp_path):
    out = tmp_path / "trace.json"
    proc, peak = exitbench(["trace", "Natalia sold clips", "-c", str(hrm_dir), "--policy", "confidence",
                            "--threshold", "0.001", "--generate", "2", "--json", str(out)], env, tmp_path)
    (trace,) = json.loads(out.read_text())["traces"]
    assert len(trace["generated_ids"]) == 2 and all(1 <= t["exit_steps"][0] <= 2 for t in trace["tokens"])
    assert peak <= LOAD_BOUND, f"trace peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"


def test_one_run_cell(hrm_dir, env, tmp_path):
    out = tmp_path / "results"
    proc, peak = exitbench(["run", "-c", str(hrm_dir), "--tasks", "chains_lambada", "--policy", "first_order",
                            "--thresholds", "1", "--baselines", "2", "--limit", "1", "--out", str(out), "--quiet"],
                           env, tmp_path)
    cells = [json.loads(f.read_text()) for f in out.glob("*.json")]
    # first_order: second_order cannot exit before the second of two loops, and is refused there
    assert sorted(c["policy"]["policy"] for c in cells) == ["first_order", "fixed"]
    assert all(c["model"]["dtype"] == "bfloat16" and c["model"]["parameters"] == PARAMETERS for c in cells)
    assert peak <= LOAD_BOUND, f"run peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"
