"""Chat templates, system instructions and multi-turn few-shot, against lm-eval's own `hf` model.

test_lm_eval_parity's random GPT-2 is saved both ways (an exitbench checkpoint and a Hugging Face directory
with the same weights and tokenizer.json), now with the same chat template in each tokenizer_config.json.
lm-eval's `simple_evaluate(apply_chat_template=True, system_instruction=…, fewshot_as_multiturn=True)` on a
generation task and a multiple-choice task must hand both models the same rendered requests, and both must
answer them alike: the same log-likelihoods (within test_lm_eval_parity's tolerance) and the same generations.

A checkpoint without a chat template says so in one line, whether lm-eval's CLI or Python asks for one.
"""
from __future__ import annotations

import json

import lm_eval
import pytest
from lm_eval.models.huggingface import HFLM
from test_lm_eval_parity import CORPUS, LOGLIK_TOL, save_both

from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.harness.chat import ChatTemplate
from exitbench.harness.model import ExitbenchLM
from exitbench.harness.task_set import resolve_tasks

from helpers.cli import assert_one_line_error, runner

# Only the corpus's characters, so every rendered character has a token of its own.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} said {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant said{% endif %}")
SYSTEM = "you are a small red cat"


# The chains tasks' characters beside the parity corpus, so every prompt and choice has tokens.
CHAINS_TEXT = ["f=3 X=0 c=X G=3 V=c t=4 g=f l=t y=l i=V h=i T=h m=g", "0 1 2 3 4 5 6 7 8 9 " +
               " ".join(f"{a}={b}" for a in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" for b in "0123")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    s = save_both("bos_template", tmp_path_factory.mktemp("chat"), CORPUS + CHAINS_TEXT * 4)
    hf_config = json.loads((s.hf_dir / "tokenizer_config.json").read_text())
    (s.hf_dir / "tokenizer_config.json").write_text(json.dumps({**hf_config, "chat_template": TEMPLATE}))
    (s.ck_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                                "chat_template": TEMPLATE}))
    return s


def run(lm, tasks) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=tasks.specs, task_manager=tasks.manager, limit=3, num_fewshot=2,
                                   apply_chat_template=True, system_instruction=SYSTEM, fewshot_as_multiturn=True,
                                   log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0, verbosity="ERROR")


def test_same_rendered_requests_and_answers_as_lm_eval_hf(saved):
    tasks = resolve_tasks(["chains", "chains_mc"])
    hf = HFLM(pretrained=str(saved.hf_dir), device="cpu", dtype="float32", batch_size=1, logits_cache=False)
    ours = ExitbenchLM(checkpoint=str(saved.ck_dir), policy="fixed", threshold=1, batch_size=4, device="cpu")
    want, got = run(hf, tasks), run(ours, tasks)
    for task in ("chains", "chains_mc"):
        assert len(want["samples"][task]) == len(got["samples"][task]) == 3
        for a, b in zip(want["samples"][task], got["samples"][task]):
            assert a["arguments"] == b["arguments"]  # the same rendered prompts (and continuations)
            context = a["arguments"][0][0]
            assert context.startswith("<bos>system said " + SYSTEM) and context.count("user said") == 3
            if task == "chains":
                assert a["resps"] == b["resps"]  # the same generations
            else:
                for (lw, gw), (lo, go) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
                    assert abs(float(lw) - float(lo)) < LOGLIK_TOL and gw == go
    # what lm-eval's evaluation tracker records (and hashes) as the template
    assert ours.chat_template(True) == hf.chat_template(True) == TEMPLATE


def test_a_checkpoint_without_a_template_is_one_line(saved, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((saved.ck_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ExitbenchError, match="has no chat template"):
        ChatTemplate(tmp_path)
    with pytest.raises(ExitbenchError, match="one unnamed chat template"):
        ChatTemplate(saved.ck_dir, "tool_use")


def assert_keyed_on_the_prompt(plain: dict, chat: dict, chat_dir) -> None:
    """The chat cell's key holds the settings (the plain one's none), and its samples the rendered prompts."""
    assert "prompt" not in plain["key"]
    assert chat["key"]["prompt"] == {"apply_chat_template": True, "system_instruction": SYSTEM,
                                     "fewshot_as_multiturn": True, "gen_kwargs": {"max_gen_toks": 3}}
    assert chat["cell_id"] != plain["cell_id"]
    (samples,) = chat_dir.glob("**/*samples*")
    assert f"<bos>system said {SYSTEM}" in samples.read_text()


def test_a_sweep_keys_on_the_prompt_settings_and_samples_the_rendered_prompts(saved, tmp_path):
    """The library half of the command below: the same sweep with and without the prompt settings."""
    from exitbench.harness.prompting import Prompting
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.schedule import run_cells

    ck, tasks = open_checkpoint(str(saved.ck_dir)), resolve_tasks(["chains"])
    common = dict(tasks=["chains"], policies=["fixed"], baselines=[1], limit=2, log_samples=True, quiet=True,
                  timing_repeats=0)
    (plain,) = run_cells(ck, tasks, SweepConfig(**common), tmp_path / "plain", "cpu")
    chat_prompting = Prompting(True, SYSTEM, True, "max_gen_toks=3")
    (chat,) = run_cells(ck, tasks, SweepConfig(**common, num_fewshot=1, prompting=chat_prompting),
                        tmp_path / "chat", "cpu")
    assert_keyed_on_the_prompt(plain, chat, tmp_path / "chat")


def test_a_template_file_edited_after_a_run_makes_a_new_cell(saved, tmp_path):
    """transformers prefers chat_template.jinja to tokenizer_config.json's template: adding or editing it
    renders other prompts, so the rerun must compute a new cell, not reuse the old one."""
    import shutil

    from exitbench.harness.prompting import Prompting
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.store import cells
    from exitbench.sweep.config import SweepConfig
    from exitbench.sweep.schedule import run_cells

    ck_dir = shutil.copytree(saved.ck_dir, tmp_path / "ck")
    tasks, out = resolve_tasks(["chains"]), tmp_path / "cells"
    cfg = SweepConfig(tasks=["chains"], policies=["fixed"], baselines=[1], limit=2, log_samples=True, quiet=True,
                      timing_repeats=0, prompting=Prompting(True))
    rendered = []
    for template in (None, TEMPLATE.replace(" said ", " says "), TEMPLATE.replace(" said ", " wrote ")):
        if template:
            (ck_dir / "chat_template.jinja").write_text(template)
        (cell,) = run_cells(open_checkpoint(str(ck_dir)), tasks, cfg, out, "cpu")
        samples = out / cells.filename(cell).replace(".json", ".samples.jsonl")
        rendered.append(json.loads(samples.read_text().splitlines()[0])["arguments"])
    assert len(list(out.glob("*.json"))) == 3  # three templates, three cells
    assert "user said" in str(rendered[0]) and "user says" in str(rendered[1]) and "user wrote" in str(rendered[2])


@pytest.mark.slow  # 16 s: two runs and lm-eval's own CLI (which builds lm-eval's task index); the keys and the
# samples are checked fast through the library (test_a_sweep_keys_on_the_prompt_settings_and_samples_…)
def test_exitbench_run_keys_on_the_prompt_settings(saved, tmp_path):
    """`exitbench run --apply-chat-template --system-instruction … --gen-kwargs …`: the cell's key holds what
    was set (and nothing when nothing is), its samples the rendered prompts; `exitbench lm-eval run` takes
    lm-eval's own spelling on the same checkpoint."""
    from exitbench.cli import app

    from helpers.cli import explain, runner

    common = ["run", "-c", str(saved.ck_dir), "--tasks", "chains", "--limit", "2", "-p", "fixed", "--baselines", "1",
              "--log-samples", "--quiet"]
    res = runner.invoke(app, [*common, "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0, explain(res)
    res = runner.invoke(app, [*common, "--apply-chat-template", "--system-instruction", SYSTEM,
                              "--fewshot-as-multiturn", "--num-fewshot", "1", "--gen-kwargs", "max_gen_toks=3",
                              "--out", str(tmp_path / "chat")])
    assert res.exit_code == 0, explain(res)
    (plain,) = [json.loads(f.read_text()) for f in (tmp_path / "plain").glob("*.json")]
    (chat,) = [json.loads(f.read_text()) for f in (tmp_path / "chat").glob("*.json")]
    assert_keyed_on_the_prompt(plain, chat, tmp_path / "chat")
    res = runner.invoke(app, ["lm-eval", "run", "--model", "exitbench", "--model_args",
                              f"pretrained={saved.ck_dir},policy=fixed,threshold=1", "--tasks", "chains", "--limit",
                              "2", "--apply_chat_template", "--system_instruction", SYSTEM])
    assert res.exit_code == 0, explain(res)


def test_a_template_file_beside_the_tokenizer_is_read(saved, tmp_path):
    """transformers ≥ 4.43 writes the template to chat_template.jinja rather than into tokenizer_config.json."""
    (tmp_path / "tokenizer.json").write_bytes((saved.ck_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    rendered = ChatTemplate(tmp_path).render([{"role": "user", "content": "the cat"}])
    assert rendered == "<bos>user said the cat. assistant said"


# ---- no chat template ----------------------------------------------------------------------------------------------

def test_apply_chat_template_is_one_line(capfd):
    capfd.readouterr()
    res = runner.invoke(app, ["lm-eval", "run", "--model", "exitbench", "--model_args", "policy=fixed", "--tasks",
                              "chains_lambada", "--limit", "2", "--apply_chat_template"])
    assert_one_line_error(res, ["--apply_chat_template", "no chat template"], fd=capfd.readouterr())


def test_the_model_itself_says_it_has_no_chat_template():
    """Called from Python (simple_evaluate(apply_chat_template=True)) the model's answer is the same line, not
    lm-eval's NotImplementedError (tiny-raven's tokenizer has no template; tests/test_chat.py has one that does)."""
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.engine import ExitConfig
    from exitbench.harness.model import ExitbenchLM

    lm = ExitbenchLM.from_checkpoint(open_checkpoint(None), ExitConfig("fixed", threshold=4))
    with pytest.raises(ExitbenchError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "a=1 q=a"}])
