"""bench/gpu.py, on CPU with the embedded tiny model: the figures it writes, and one line without CUDA."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.bench import bench_script


def gpu_bench():
    return bench_script("gpu")


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


def test_decoding_against_the_floor_and_rules_against_the_time_line(tmp_path):
    """--decode adds issue 57's table: decoding beside the memory floor (weights read ÷ the measured read
    rate), and the scoring rules beside the fixed-depth time line. On a CPU the floor means little (the
    tiny model's weights sit in cache); what is held here is the arithmetic of the figures."""
    out = tmp_path / "gpu.json"
    bench = gpu_bench()
    assert bench.main(["--device", "cpu", "--checkpoint", "tiny-raven", "--tokens", "3", "--max-steps", "8",
                       "--repeats", "1", "--threads", "1", "--decode", "3", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for v in ("fixed", "second_order", "kl"):
        for b in (1, 16):
            f = figures[f"cpu_decode_{v}_bs{b}"]
            assert f["tokens"] == 3 * b  # --decode 3 tokens past the first (a one-token run cancels the first)
            assert f["over_floor"] == pytest.approx(f["ms_per_token"] / f["floor_ms"])
            assert f["read_rate_gb_s"] > 0 and f["weight_bytes_per_iteration"] > 0
    # the floor follows the iterations: a bs 16 step reads the weights once for its sixteen rows
    fixed1, fixed16 = figures["cpu_decode_fixed_bs1"], figures["cpu_decode_fixed_bs16"]
    assert fixed16["floor_ms"] * 16 == pytest.approx(fixed1["floor_ms"], rel=0.05)  # two read-rate samples
    line = {r: figures[f"cpu_line_fixed_r{r}_bs16"] for r in (1, 2, 4, 8)}
    assert all(f["line_ms"] > 0 for f in line.values())
    assert figures["cpu_line_second_order_bs16"]["over_line"] == pytest.approx(
        figures["cpu_second_order_bs16"]["ms_per_token"] / figures["cpu_line_second_order_bs16"]["line_ms"])
    once, per_iteration = bench.weight_bytes(open_tiny())
    assert fixed1["weight_bytes_once"] == once and fixed1["weight_bytes_per_iteration"] == per_iteration


def open_tiny():
    from exitbench.models.checkpoint import open_checkpoint
    return open_checkpoint("tiny-raven").model


def test_a_run_cut_short_keeps_the_parts_it_finished(tmp_path, monkeypatch):
    """A lent GPU's time limit may end a run mid-way: each part's figures are in --json as soon as it is done."""
    out = tmp_path / "gpu.json"
    bench = gpu_bench()

    def cut(*args, **kwargs):
        raise KeyboardInterrupt  # as `timeout` ends the run, after the scoring part

    monkeypatch.setattr(bench, "against_line", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--device", "cpu", "--checkpoint", "tiny-raven", "--tokens", "2", "--max-steps", "4",
                    "--repeats", "1", "--threads", "1", "--decode", "2", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert sorted(figures) == sorted(f"cpu_{v}_bs{b}" for v in ("fixed", "second_order", "kl") for b in (1, 16))
