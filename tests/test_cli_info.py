"""`exitbench info`: the report on a good checkpoint, and one clean line (exit code 2) on each bad one."""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.models import save_checkpoint

from helpers.cli import assert_one_line_error
from helpers.files import listing, truncate_shard
from helpers.models import make_tiny_raven

INDEX = "model.safetensors.index.json"
runner = CliRunner()  # click ≥ 8.2 keeps result.stdout and result.stderr apart


def info(*args: str):
    return runner.invoke(app, ["info", *args])


def tiny_parameter_count(h=32, H=2, I=64, V=100, layers=8) -> int:
    D = h // H
    per_layer = 4 * h + 3 * h * h + 2 * H * D + h * h + 2 * I * h + I * h
    return V * h + layers * per_layer + 2 * h * h + h  # embedding (tied head once), layers, adapter, ln_f


# ---- a good checkpoint -------------------------------------------------------------------------------------

def test_info_json(tiny_checkpoint):
    before = listing(tiny_checkpoint)
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    report = json.loads(res.stdout)
    assert report["source"] == str(tiny_checkpoint)
    assert report["architecture"] == "huginn_raven"
    assert report["parameters"] == tiny_parameter_count() == 88_736
    assert sum(report["parameter_breakdown"].values()) == report["parameters"]
    assert report["layers"] == {"prelude": 2, "core": 4, "coda": 2}
    assert (report["hidden_size"], report["heads"], report["context"]) == (32, 2, 128)
    assert report["loop_groups"] == [{"name": "core_block", "layers": 4, "default_steps": 4, "max_steps": 8,
                                      "random_init": False}]
    assert report["dtype"] == "float32"
    assert report["weights"] == "3 safetensors shards with an index"
    assert report["tokenizer"] == {
        "vocab_size": 18,
        "special_tokens": {"bos": {"id": 0, "token": "<|begin_text|>"},
                           "eos": {"id": 1, "token": "<|end_text|>"},
                           "pad": {"id": 2, "token": "<|pad|>"}},
    }
    assert listing(tiny_checkpoint) == before


def test_info_single_file_bf16_and_table(tmp_path):
    model = make_tiny_raven(mean_recurrence=6, max_recurrence=20, init_scale=1.0)
    path = save_checkpoint(model, tmp_path / "single")
    res = info("-c", str(path), "--json", "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["dtype"] == "bfloat16"
    assert report["weights"] == "model.safetensors"
    assert report["tokenizer"] is None
    assert report["loop_groups"][0]["default_steps"] == 6
    assert report["loop_groups"][0]["max_steps"] == 20
    assert report["loop_groups"][0]["random_init"] is True
    assert report["parameters"] == 88_736

    res = info("-c", str(path))
    assert res.exit_code == 0, res.output
    assert "88,736" in res.stdout and "huginn_raven" in res.stdout


# ---- bad checkpoints -----------------------------------------------------------------------------------------

def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def drop_key(path: Path, key: str = "transformer.core_block.2.mlp.proj.weight", from_index: bool = False) -> None:
    """Delete `key` from its shard (rewritten); with `from_index` also from the index, leaving it consistent."""
    index = json.loads((path / INDEX).read_text())
    shard = path / index["weight_map"][key]
    with safe_open(str(shard), framework="pt") as fh:
        kept = {k: fh.get_tensor(k) for k in fh.keys() if k != key}
    save_file(kept, str(shard), metadata={"format": "pt"})
    if from_index:
        del index["weight_map"][key]
        (path / INDEX).write_text(json.dumps(index, indent=2))


def add_key(path: Path, key: str = "transformer.coda.2.norm_1.weight") -> None:
    index = json.loads((path / INDEX).read_text())
    shard = path / sorted(set(index["weight_map"].values()))[-1]
    with safe_open(str(shard), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors[key] = tensors["transformer.ln_f.weight"].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"][key] = shard.name
    (path / INDEX).write_text(json.dumps(index, indent=2))


BAD_CASES = {
    # name: (how to break a good checkpoint, words the error line must contain)
    "missing-directory": (lambda p: shutil.rmtree(p), ["not found"]),
    "no-config": (lambda p: (p / "config.json").unlink(), ["config.json"]),
    "unknown-architecture": (lambda p: edit_config(p, model_type="llama"), ["unknown architecture", "llama"]),
    "missing-key": (drop_key, ["transformer.core_block.2.mlp.proj.weight"]),
    "missing-key-and-index-entry": (lambda p: drop_key(p, "transformer.prelude.1.attn.qk_bias", from_index=True),
                                    ["lacks key transformer.prelude.1.attn.qk_bias"]),
    "shape-mismatch": (lambda p: edit_config(p, n_embd=48, hidden_size=48), ["shape", "transformer.wte.weight"]),
    "unexpected-key": (add_key, ["transformer.coda.2.norm_1.weight"]),
    "truncated-safetensors": (truncate_shard, ["model-00002-of-00003.safetensors", "truncated"]),
    "malformed-config": (lambda p: (p / "config.json").write_text('{"model_type": "huginn_raven", '),
                         ["config.json", "not valid JSON"]),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_checkpoint_one_line(tiny_checkpoint, case):
    breaker, words = BAD_CASES[case]
    breaker(tiny_checkpoint)
    exists = tiny_checkpoint.exists()
    before = listing(tiny_checkpoint) if exists else None
    parent_before = listing(tiny_checkpoint.parent)
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert_one_line_error(res, words)
    assert tiny_checkpoint.exists() == exists
    if exists:
        assert listing(tiny_checkpoint) == before
    assert listing(tiny_checkpoint.parent) == parent_before


def test_python_dash_m_exitbench_is_the_cli(tiny_checkpoint, monkeypatch, capsys):
    """exitbench/__main__.py, in this process (the subprocess test below runs it where coverage cannot see it):
    `python -m exitbench info --json` prints the same report as the CLI app and exits 0."""
    want = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert want.exit_code == 0, want.output
    monkeypatch.setattr(sys, "argv", ["exitbench", "info", "--checkpoint", str(tiny_checkpoint), "--json"])
    monkeypatch.delitem(sys.modules, "exitbench.__main__", raising=False)
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("exitbench", run_name="__main__")
    assert exc.value.code in (0, None)
    got = capsys.readouterr()
    assert json.loads(got.out) == json.loads(want.stdout) and got.err == ""


@pytest.mark.slow  # a second process (2.4 s); the same errors are checked in process by test_bad_checkpoint_one_line
def test_bad_checkpoint_via_subprocess(tiny_checkpoint):
    """The real entry point: exit code 2, one line on stderr, no traceback, nothing written."""
    truncate_shard(tiny_checkpoint)
    before = listing(tiny_checkpoint)
    env = {**os.environ, "COLUMNS": "40"}  # a narrow terminal must not wrap the line either
    proc = subprocess.run([sys.executable, "-m", "exitbench", "info", "--checkpoint", str(tiny_checkpoint)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert_one_line_error(proc, ["truncated"])
    assert listing(tiny_checkpoint) == before


def test_bad_dtype_option(tiny_checkpoint):
    res = info("--checkpoint", str(tiny_checkpoint), "--dtype", "int4")
    assert_one_line_error(res, ["int4", "dtype"])


# ---- malformed configs and indexes ----------------------------------------------------------------------

def test_edited_n_embd_alone_is_not_ignored(tiny_checkpoint):
    edit_config(tiny_checkpoint, n_embd=48)  # hidden_size still says 32
    before = listing(tiny_checkpoint)
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert listing(tiny_checkpoint) == before
    assert_one_line_error(res, [])


@pytest.mark.parametrize("field,value", [("rope_base", "fifty thousand"), ("norm_eps", None)])
def test_non_numeric_float_field(tiny_checkpoint, field, value):
    edit_config(tiny_checkpoint, **{field: value})
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert_one_line_error(res, [field])


def test_index_weight_map_not_an_object(tiny_checkpoint):
    (tiny_checkpoint / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": ["freqs_cis"]}))
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert_one_line_error(res, [INDEX])


# ---- info reads headers, never weights ---------------------------------------------------------------------------

def test_info_reads_no_weight(tiny_checkpoint, monkeypatch):
    """`info` describes a checkpoint from config.json, the tokenizer and the safetensors headers: with every way
    of reading a tensor broken it still reports everything, shard by shard."""
    import exitbench.models.shards as shards

    def refuse(*args, **kwargs):
        raise AssertionError("info read a weight")

    monkeypatch.setattr(shards, "read_tensors", refuse)
    monkeypatch.setattr(shards, "_fill", refuse)
    res = info("--checkpoint", str(tiny_checkpoint), "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["parameters"] == tiny_parameter_count()
    assert report["dtype"] == report["stored_dtype"] == "float32"
    assert report["weight_bytes"] == 4 * tiny_parameter_count()
    shard_files = sorted(p.name for p in tiny_checkpoint.glob("*.safetensors"))
    assert [s["file"] for s in report["shards"]] == shard_files
    assert sum(s["tensors"] for s in report["shards"]) == 77  # Huginn's key set: tied head and freqs_cis included
    assert sum(s["bytes"] for s in report["shards"]) == \
        json.loads((tiny_checkpoint / INDEX).read_text())["metadata"]["total_size"]
    res = info("--checkpoint", str(tiny_checkpoint), "--json", "--dtype", "bfloat16")
    assert json.loads(res.stdout)["weight_bytes"] == 2 * tiny_parameter_count()
