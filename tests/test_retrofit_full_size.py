"""The retrofitted TinyLlama 4/8/4 at its real size (844M parameters, bf16, 32,000-token tokenizer), random
weights in the conversion's layout: `info` without the weights, a short `trace`, one `run` cell, each within its
memory bound.

Slow (about 2 minutes on 2 cores): bench/make_retrofit_size.py writes 1.7 GB under the temporary directory,
deleted afterwards. The fast tests of the same code on the tiny layouts: tests/test_retrofit.py.

Bounds as tests/test_ouro_full_size.py states them: `info` peaks under 1 GB; a command that loads the model
peaks under the weights' bytes plus 0.6 GB (the process's own footprint, measured 0.37-0.49 GB above the
weights for Ouro; a second copy of the weights would add 1.7 GB).
"""
from __future__ import annotations

import json

import pytest

from helpers.cli import full_size_env, written_full_size
from helpers.cli import run_exitbench_measured as exitbench  # (args, env, tmp_path): the process and its peak

pytestmark = pytest.mark.slow

PARAMETERS = 844_171_264
WEIGHT_BYTES = 2 * PARAMETERS  # bf16, untied
LOAD_BOUND = WEIGHT_BYTES + 0.6e9
INFO_BOUND = 1e9
DISK_NEEDED = 3e9


@pytest.fixture(scope="module")
def tinyllama(tmp_path_factory):
    yield from written_full_size(tmp_path_factory, "tinyllama-size", "make_retrofit_size.py",
                                 ["--size", "tinyllama-4-8-4"], DISK_NEEDED, 900)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return full_size_env(tmp_path_factory.mktemp("hash-cache"))



def test_info_reads_headers_only(tinyllama, env, tmp_path):
    proc, peak = exitbench(["info", "-c", str(tinyllama), "--json", "--plan", "--batch-size", "16", "--context",
                            "1000", "--kv-window", "2"], env, tmp_path)
    report = json.loads(proc.stdout)
    assert report["architecture"] == "huginn_raven" and report["variant"]["name"] == "llama"
    assert report["parameters"] == PARAMETERS and report["layers"] == {"prelude": 4, "core": 8, "coda": 4}
    assert report["dtype"] == report["stored_dtype"] == "bfloat16" and report["weight_bytes"] == WEIGHT_BYTES
    assert report["weights"] == "model.safetensors"  # save_pretrained's 5 GB shards: one file at 1.7 GB
    assert report["loop_groups"] == [{"name": "core_block", "layers": 8, "default_steps": 32, "max_steps": 64,
                                      "random_init": True}]
    assert report["tokenizer"]["vocab_size"] == 32000 and report["context"] == 2048
    assert report["tokenizer"]["special_tokens"]["bos"] == {"id": 1, "token": "<s>"}
    # The window counts iterations of this checkpoint's 8-layer core: 8 × 2 loop slots and 8 plain layers,
    # each slot the 4 key/value groups once (4 × 64 wide, not the 32 query heads).
    assert report["plan"]["kv_layout"]["slots_per_loop_layer"] == [2]
    assert report["plan"]["kv_cache"] == 2 * (8 * 2 + 8) * 16 * 1000 * 256 * 2
    assert peak < INFO_BOUND, f"info peaked at {peak / 1e9:.2f} GB"


def test_a_short_trace(tinyllama, env, tmp_path):
    out = tmp_path / "trace.json"
    proc, peak = exitbench(["trace", "a=7 b=a", "-c", str(tinyllama), "--policy", "second_order", "--threshold",
                            "1.0", "--max-steps", "8", "--generate", "3", "--json", str(out)], env, tmp_path)
    (trace,) = json.loads(out.read_text())["traces"]
    assert len(trace["generated_ids"]) == 3 and all(1 <= t["exit_steps"][0] <= 8 for t in trace["tokens"])
    assert peak <= LOAD_BOUND, f"trace peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"


def test_one_run_cell(tinyllama, env, tmp_path):
    out = tmp_path / "results"
    proc, peak = exitbench(["run", "-c", str(tinyllama), "--tasks", "chains_lambada", "--policy", "second_order",
                            "--thresholds", "1.0", "--baselines", "4", "--max-steps", "8", "--limit", "1",
                            "--out", str(out), "--quiet"], env, tmp_path)
    cells = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert sorted(c["policy"]["policy"] for c in cells) == ["fixed", "second_order"]
    assert all(c["model"]["dtype"] == "bfloat16" and c["model"]["parameters"] == PARAMETERS for c in cells)
    assert peak <= LOAD_BOUND, f"run peaked at {peak / 1e9:.2f} GB over {WEIGHT_BYTES / 1e9:.2f} GB of weights"
