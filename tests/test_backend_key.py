"""`--backend vllm`'s cells are cells of their own: "backend": "vllm" in the key (hf cells keep their ids, with
no backend field) and a backend column in every export row (hf for every cell written before it)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from exitbench.analysis import export
from exitbench.engine import ExitConfig
from exitbench.errors import ExitbenchError
from exitbench.store import cells
from exitbench.sweep import backends
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.keys import cell_key

ROOT = Path(__file__).resolve().parents[1]


def test_a_vllm_cell_has_its_own_key_and_hf_cells_keep_theirs():
    model, exit_cfg = {"fingerprint": "f" * 16, "dtype": "float32"}, ExitConfig("kl", exit_mode="freeze")
    hf = cell_key(model, "chains", "t", exit_cfg, SweepConfig(tasks=["chains"], policies=["kl"]), "cpu")
    vllm = cell_key(model, "chains", "t", exit_cfg, SweepConfig(tasks=["chains"], policies=["kl"], backend="vllm"),
                    "cpu")
    assert "backend" not in hf and vllm == {**hf, "backend": "vllm"}
    assert cells.cell_id(vllm) != cells.cell_id(hf)


def test_export_rows_name_the_backend():
    path = next((ROOT / "results/baseline").glob("chains__second_order-*.json"))
    cell = json.loads(path.read_text())
    assert export.row(path, cell)["backend"] == "hf"  # written before the backend existed
    cell["key"] = {**cell["key"], "backend": "vllm"}
    assert export.row(path, cell)["backend"] == "vllm"


def test_only_the_backend_registry_compares_a_backend_by_name():
    """Everything that differs between engines asks the backend object (exitbench/sweep/backends.py): a
    `backend ==` anywhere else is a branch that a new backend would have to find."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "exitbench").rglob("*.py")
             if p.name != "backends.py"
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"backend\s*(==|!=)|(==|!=)\s*['\"](hf|vllm)['\"]", line)]
    assert found == []


def test_a_backend_refuses_what_it_cannot_run_in_one_line():
    with pytest.raises(ExitbenchError, match=r"^--backend must be one of hf, vllm, got 'bogus'$"):
        SweepConfig(tasks=["chains"], policies=["kl"], backend="bogus").check_counts()
    with pytest.raises(ExitbenchError, match=r"^--backend vllm runs cells exactly, in vLLM's own loop: drop "
                                             r"--replay and --compile, or use --backend hf$"):
        SweepConfig(tasks=["chains"], policies=["kl"], backend="vllm", replay=True).check_counts()
    assert backends.backend("vllm").key_part() == {"backend": "vllm"} and backends.backend("hf").key_part() == {}
    assert not backends.backend("vllm").retimed and backends.backend("hf").retimed
