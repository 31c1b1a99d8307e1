"""bench/gpu.py, on CPU with the embedded tiny model: the figures it writes, and one line without CUDA."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers.paths import REPO


def gpu_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figures_for_each_variant_and_batch_size(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"earlier": {"kept": True}}))
    assert gpu_bench().main(["--device", "cpu", "--checkpoint", "tiny-raven", "--tokens", "3", "--max-steps", "4",
                             "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures.pop("earlier") == {"kept": True}  # a run updates its own names and keeps the others'
    assert sorted(figures) == sorted(f"cpu_{v}_bs{b}" for v in ("fixed", "second_order", "kl") for b in (1, 16))
    for name, f in figures.items():
        assert f["ms_per_token"] > 0 and f["tokens"] == 3 * f["batch_size"], name
        assert 1 <= f["mean_iterations"] <= f["max_steps"] == 4, name
        assert f["device"] == "cpu" and f["compile"] is False
    assert figures["cpu_fixed_bs1"]["mean_iterations"] == 4
    assert "cpu_kl_bs16" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_no_cuda_is_one_line(capsys):
    assert gpu_bench().main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: this machine has no CUDA device") and err.count("\n") == 1
