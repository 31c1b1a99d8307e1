"""`--backend vllm`'s cells are cells of their own: "backend": "vllm" in the key (hf cells keep their ids, with
no backend field) and a backend column in every export row (hf for every cell written before it)."""
from __future__ import annotations

import json
from pathlib import Path

from exitbench.analysis import export
from exitbench.engine import ExitConfig
from exitbench.store import cells
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
