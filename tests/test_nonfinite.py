"""Non-finite numbers are never silent: weights with NaN or infinity are refused at load unless
`--allow-nonfinite` asks for them (then `run` and `trace` warn), each cell counts the tokens whose states or logits
went non-finite (none in a finite run), and `pareto`, `check` and a run that reuses cells flag such cells however
they got there."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from exitbench.cli import app
from exitbench.sweep.schedule import run_cells

from helpers.cells import baseline_cells, copy_cells, load_cells
from helpers.cli import assert_one_line_error, explain, invoke, runner
from helpers.paths import BASELINE
from helpers.sweeps import SMALL


# ---- at load, and counted in a run -------------------------------------------------------------------------------

def _poison(ck: Path) -> None:
    tensors = load_file(str(ck / "model.safetensors"))
    key = "transformer.core_block.0.attn.Wqkv.weight"
    tensors[key].view(-1)[tensors[key].numel() // 2] = float("nan")
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})


def test_nan_weights_are_refused_at_load_unless_allowed(raven_copy, tmp_path, capfd):
    _poison(raven_copy)
    out = tmp_path / "out"
    capfd.readouterr()
    res = runner.invoke(app, ["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out)])
    assert_one_line_error(res, ["core_block.0.attn.Wqkv.weight", "--allow-nonfinite"], fd=capfd.readouterr())
    code, lines, _ = invoke(["run", *SMALL, "--checkpoint", str(raven_copy), "--out", str(out),
                             "--allow-nonfinite"], capfd)
    assert code == 0
    found = load_cells(out)
    assert found and all(c["numerics"]["nonfinite_tokens"] == c["iterations"]["tokens"] for c in found.values())
    assert sum("warning:" in line and "NaN or infinity" in line for line in lines) == len(found)
    # trace warns as run does, instead of printing nan log-probabilities as if they were numbers (a NaN in
    # every weight of the block: one NaN reaches only some of a short prompt's tokens)
    tensors = load_file(str(raven_copy / "model.safetensors"))
    tensors["transformer.core_block.0.attn.Wqkv.weight"].fill_(float("nan"))
    save_file(tensors, str(raven_copy / "model.safetensors"), metadata={"format": "pt"})
    code, lines, _ = invoke(["trace", "a=7 b=a", "--checkpoint", str(raven_copy), "--allow-nonfinite"], capfd)
    assert code == 0 and any("warning:" in line and "NaN or infinity" in line for line in lines), lines
    code, lines, _ = invoke(["trace", "a=7 b=a"], capfd)
    assert code == 0 and not any("warning:" in line for line in lines), lines


def test_finite_runs_count_no_nonfinite_tokens(tmp_path, small_sweep):
    ck, tasks, cfg = small_sweep
    for cell in run_cells(ck, tasks, cfg, tmp_path / "out", "cpu"):
        assert cell["numerics"] == {"nonfinite_tokens": 0}


# ---- cells with non-finite tokens, however they got here -------------------------------------------------------

def test_pareto_and_check_say_when_a_cell_had_nonfinite_tokens(tmp_path):
    def broke(cell):
        cell["numerics"]["nonfinite_tokens"] = 3
    victim = [p for p in baseline_cells() if "__kl-" in p.name][:1]
    d = copy_cells(tmp_path / "c", [p for p in baseline_cells() if p not in victim])
    copy_cells(d, victim, broke)
    res = runner.invoke(app, ["pareto", str(d), "--format", "md"])
    assert res.exit_code == 0 and "NaN or infinite" in res.stderr and victim[0].name in res.stderr, explain(res)
    res = runner.invoke(app, ["check", str(d), "--baseline", str(BASELINE), "--present-only"])
    assert "1 of the run's cells" in res.stdout and "NaN or infinite" in res.stdout, explain(res)


def test_a_reused_cell_with_nonfinite_tokens_is_warned_about(tmp_path):
    from exitbench.analysis.tables import reuse_note

    def broke(cell):
        cell["numerics"]["nonfinite_tokens"] = 2
    d = copy_cells(tmp_path / "c", baseline_cells(series=("kl",))[:1], broke)
    reused = [json.loads(p.read_text()) for p in d.glob("*.json")]
    note = reuse_note(reused, d)
    assert "warning: 1 reused cell(s)" in note and "NaN or infinite" in note
