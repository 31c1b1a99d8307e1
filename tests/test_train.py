"""The trainer end to end on a tiny configuration, its determinism and resume, and its bad options."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from typer.testing import CliRunner

from exitbench.training import synthetic
from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.models import load_checkpoint
from exitbench.training.config import TrainConfig
from exitbench.training.recipe import sample_recurrence
from exitbench.training.train import train

from helpers.cli import assert_one_line_error

TINY = dict(n_embd=32, n_heads=2, intermediate_size=64, max_hop=4, n_chains=2, mean_recurrence=4,
            max_recurrence=8, backprop_depth=2, batch_size=8, steps=6, warmup=2)


def tiny_cfg(out, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), **{**TINY, **kw})


def test_trainer_end_to_end_writes_a_loadable_checkpoint(tmp_path):
    out = train(tiny_cfg(tmp_path / "run", save_every=3), command="exitbench train --test")
    ck = load_checkpoint(out)
    assert ck.model.architecture == "huginn_raven"
    assert ck.tokenizer is not None and ck.tokenizer.vocab_size == len(ck.tokenizer.backend.get_vocab())
    training = ck.provenance["training"]
    assert training["command"] == "exitbench train --test"
    assert training["seed"] == 0 and training["steps_done"] == 6 and training["training_seconds"] > 0
    assert ck.provenance["run"]["versions"]["torch"] == torch.__version__
    assert (out / "training" / "step-000003" / "config.json").exists()
    assert (out / "training" / "step-000006" / "config.json").exists()
    ids = torch.tensor([[synthetic.BOS] + ck.tokenizer.encode("a=3 b=a")])
    assert torch.isfinite(ck.model(ids, 2)).all()
    # The saved tokenizer puts <bos> first by itself, so lm-eval-style encodes condition as training did.
    assert ck.tokenizer.encode("a=3 b=a", add_special_tokens=True) == ids[0].tolist()


def test_same_seed_same_checkpoint_and_resume_continues_exactly(tmp_path):
    a = load_checkpoint(train(tiny_cfg(tmp_path / "a"))).model
    b = load_checkpoint(train(tiny_cfg(tmp_path / "b"))).model
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    c = load_checkpoint(train(tiny_cfg(tmp_path / "c", seed=1))).model
    assert not torch.equal(a.transformer.adapter.weight, c.transformer.adapter.weight)
    # Stop at 3, resume to 6: the same weights as 6 in one go.
    train(tiny_cfg(tmp_path / "r", steps=3))
    resumed = load_checkpoint(train(tiny_cfg(tmp_path / "r", steps=6, resume=True))).model
    for (name, pa), pr in zip(a.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(pa, pr, atol=1e-6), name


def test_recurrence_sampler_matches_huginn_schedule():
    rng = random.Random(0)
    draws = [sample_recurrence(rng, mean=16, backprop_depth=8, sigma=0.5, cap=64) for _ in range(4000)]
    totals = [n + k for n, k in draws]
    assert all(k == min(8, n + k) for n, k in draws)
    # E[1 + Poisson(e^τ)] with τ ~ N(log m − σ²/2, σ) is 1 + m.
    assert abs(sum(totals) / len(totals) - 17) < 0.5
    capped = [sum(sample_recurrence(rng, 16, 8, 0.5, cap=20)) for _ in range(500)]
    assert max(capped) == 20


@pytest.mark.parametrize("override,needle", [
    (dict(n_embd=-8), "--n-embd"),
    (dict(batch_size=0), "--batch-size"),
    (dict(steps=-1), "--steps"),
    (dict(task="sudoku"), "sudoku"),
    (dict(max_recurrence=2), "--max-recurrence"),
    (dict(n_chains=9, max_hop=12), "names"),
    (dict(lr=math.nan), "--lr"),
])
def test_bad_options_fail_before_writing(tmp_path, override, needle):
    with pytest.raises(ExitbenchError, match=needle.replace("-", r"\-")):
        train(tiny_cfg(tmp_path / "run", **override))
    assert not (tmp_path / "run").exists()


def test_resume_with_another_config_is_refused(tmp_path):
    train(tiny_cfg(tmp_path / "run", steps=2))
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(ExitbenchError, match="n_embd"):
        train(tiny_cfg(tmp_path / "run", steps=4, n_embd=64, resume=True))
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_existing_output_without_resume_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    with pytest.raises(ExitbenchError, match="not empty"):
        train(tiny_cfg(tmp_path / "run"))
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; permissions cannot make a dir unwritable")
def test_unwritable_output_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(ExitbenchError, match="cannot write"):
        train(tiny_cfg(locked / "run"))


def test_output_under_a_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "afile" / "run"), "--steps", "1"])
    assert_one_line_error(res, ["cannot write"])
    res = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "x"), "--n-embd", "-4"])
    assert res.exit_code == 2 and "--n-embd" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x").exists()


def test_cli_train_runs_and_records_its_command(tmp_path):
    out = tmp_path / "cli"
    args = ["train", "--out", str(out), "--steps", "3", "--n-embd", "32", "--n-heads", "2", "--intermediate-size",
            "64", "--max-hop", "3", "--chains", "2", "--mean-recurrence", "3", "--max-recurrence", "6",
            "--backprop-depth", "2", "--batch-size", "4"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["exitbench"]["training"]["train_config"]["max_hop"] == 3
    assert "--max-hop 3" in config["exitbench"]["training"]["command"]


# ---- looped GPT-2 on text ------------------------------------------------------------------------------
GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
     "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
    for a, b in [(3, 4), (10, 7), (21, 5), (8, 8), (14, 30), (2, 9), (40, 11), (6, 13)]
]
TEXT_TINY = dict(n_embd=32, n_heads=2, n_layer=4, loop_groups="1;2", context=16, vocab_size=300,
                 mean_recurrence=2, max_recurrence=4, backprop_depth=4, batch_size=4, steps=4, warmup=2)


@pytest.fixture
def gsm8k_dir(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return d


def text_cfg(out, data, **kw) -> TrainConfig:
    return TrainConfig.for_arch(str(out), "looped_gpt2", gsm8k_dir=str(data), **{**TEXT_TINY, **kw})


def test_looped_gpt2_trains_on_text_deterministically_and_resumes(tmp_path, gsm8k_dir):
    out = train(text_cfg(tmp_path / "a", gsm8k_dir, save_every=2))
    ck = load_checkpoint(out)
    model = ck.model
    assert model.architecture == "looped_gpt2"
    assert model.config.loop_groups == [[1], [2]]
    assert [g.max_steps for g in model.loop_groups()] == [4, 4]
    # A byte-level BPE fitted to the training text, <|endoftext|> as BOS/EOS ...
    assert ck.tokenizer.vocab_size == model.config.vocab_size <= 300
    assert ck.tokenizer.token(ck.tokenizer.bos_token_id) == "<|endoftext|>"
    text = GSM8K_ROWS[0]["question"]
    assert ck.tokenizer.decode(ck.tokenizer.encode(text)) == text
    # ... which the saved tokenizer does not add by itself (GPT-2's convention: rolling perplexity puts one first)
    assert ck.tokenizer.encode(text, add_special_tokens=True) == ck.tokenizer.encode(text)
    assert (out / "training" / "step-000002" / "config.json").exists()
    training = ck.provenance["training"]
    assert "--arch looped_gpt2" in training["command"] and training["steps_done"] == 4
    assert math.isfinite(training["final_loss"])
    b = load_checkpoint(train(text_cfg(tmp_path / "b", gsm8k_dir))).model
    for (name, pa), pb in zip(model.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    train(text_cfg(tmp_path / "r", gsm8k_dir, steps=2))
    resumed = load_checkpoint(train(text_cfg(tmp_path / "r", gsm8k_dir, steps=4, resume=True))).model
    for (name, pa), pr in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(pa, pr, atol=1e-6), name


def test_looped_gpt2_training_lowers_the_loss(tmp_path, gsm8k_dir):
    """The text recipe learns: the loss after training is well below the loss of the initial model."""
    from exitbench.training.gpt2 import Gpt2Recipe as TextRecipe
    from exitbench.training.recipe import TrainState

    cfg = text_cfg(tmp_path / "l", gsm8k_dir, steps=40, lr=3e-3)
    recipe = TextRecipe(cfg)
    before = recipe.build_model(torch.Generator().manual_seed(cfg.seed))
    inputs, targets, _ = recipe.batch(TrainState(step=10_000))
    loss = lambda m: torch.nn.functional.cross_entropy(m(inputs, 2).flatten(0, 1), targets.flatten()).item()  # noqa
    after = load_checkpoint(train(cfg)).model
    assert loss(after) < 0.8 * loss(before)


@pytest.mark.parametrize("override,needle", [
    (dict(loop_groups="1;x"), "--loop-groups"),
    (dict(loop_groups="1;1"), "--loop-groups"),
    (dict(loop_groups="2;7"), "--loop-groups"),
    (dict(context=0), "--context"),
])
def test_bad_text_options_fail_before_writing(tmp_path, gsm8k_dir, override, needle):
    with pytest.raises(ExitbenchError, match=needle.replace("-", r"\-")):
        train(text_cfg(tmp_path / "run", gsm8k_dir, **override))
    assert not (tmp_path / "run").exists()


def test_cli_text_training_errors_are_one_line(tmp_path, gsm8k_dir):
    res = CliRunner().invoke(app, ["train", "--arch", "looped_gpt2", "--out", str(tmp_path / "x"),
                                   "--gsm8k-dir", str(tmp_path / "nowhere")])
    assert_one_line_error(res, ["train.jsonl"])
    res = CliRunner().invoke(app, ["train", "--arch", "gpt3", "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "looped_gpt2" in res.stderr
    (gsm8k_dir / "train.jsonl").write_text('{"question": "no answer"}\n')
    res = CliRunner().invoke(app, ["train", "--arch", "looped_gpt2", "--out", str(tmp_path / "z"),
                                   "--gsm8k-dir", str(gsm8k_dir)])
    assert res.exit_code == 2 and "train.jsonl:1" in res.stderr
    assert not any((tmp_path / n).exists() for n in "xyz")


OURO_TINY = dict(n_embd=32, n_heads=2, intermediate_size=64, max_hop=4, n_chains=2, ut_steps=4, max_recurrence=8,
                 batch_size=8, steps=4, gate_steps=3, warmup=2)


def ouro_cfg(out, **kw) -> TrainConfig:
    return TrainConfig.for_arch(str(out), "ouro", **{**OURO_TINY, **kw})


def test_ouro_two_stages_keep_the_stage_one_gate_and_change_only_the_gate(tmp_path):
    out = train(ouro_cfg(tmp_path / "run"))
    final, first = load_checkpoint(out), load_checkpoint(out / "stage-1")
    assert final.model.architecture == "ouro" and final.model.gated
    assert final.provenance["training"]["steps_done"] == 7 and final.provenance["training"]["stage"] == 2
    assert first.provenance["training"]["steps_done"] == 4 and first.provenance["training"]["stage"] == 1
    changed = {name for name, p in final.model.state_dict().items()
               if not torch.equal(p, first.model.state_dict()[name])}
    # Stage II trains the gate alone: the LM is stage I's to the bit.
    assert changed == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    assert final.model.config.total_ut_steps == 4 and final.model.config.tie_word_embeddings
    ids = torch.tensor([[synthetic.BOS] + final.tokenizer.encode("a=3 b=a")])
    assert torch.isfinite(final.model(ids, 4)).all()


def test_ouro_training_is_deterministic_for_a_seed(tmp_path):
    a = load_checkpoint(train(ouro_cfg(tmp_path / "a"))).model.state_dict()
    b = load_checkpoint(train(ouro_cfg(tmp_path / "b"))).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load_checkpoint(train(ouro_cfg(tmp_path / "c", seed=1))).model.state_dict()
    assert not torch.equal(a["model.early_exit_gate.weight"], c["model.early_exit_gate.weight"])


@pytest.mark.parametrize("override,needle", [
    (dict(ut_steps=0), "--ut-steps"),
    (dict(max_recurrence=3), "--max-recurrence"),
    (dict(entropy_beta=-0.1), "--entropy-beta"),
    (dict(gate_lr=0.0), "--gate-lr"),
])
def test_bad_ouro_options_fail_before_writing(tmp_path, override, needle):
    with pytest.raises(ExitbenchError, match=needle.replace("-", r"\-")):
        train(ouro_cfg(tmp_path / "run", **override))
    assert not (tmp_path / "run").exists()
