"""The vLLM backend (exitbench.serving.vllm) against exitbench's own engine on tiny-raven in fp32: greedy tokens,
per-token exit iterations and log-probabilities under the same rule, threshold and exit mode (freeze), for
generation (16 new tokens) and teacher-forced scoring (a loglikelihood task's requests).

Needs vLLM (`pip install 'exitbench[vllm]'`, CI's vllm stage installs it in a venv of its own); skipped without.
vLLM starts once for the module (~40 s on 2 cores) and serves every rule (its model takes a rule per call).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("EXITBENCH_REQUIRE_VLLM"):  # CI: a missing vLLM fails, never skips
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'exitbench[vllm]'; CI's vllm stage "
                                       "runs these)")

from exitbench.engine import ExitConfig, ExitEngine  # noqa: E402
from exitbench.models.checkpoint import open_checkpoint  # noqa: E402
from exitbench.serving.vllm.engine import VllmEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The same float32 arithmetic in both, but vLLM's CPU attention kernel sums keys in another order than torch's
# SDPA and its batches have other shapes, so log-probabilities agree to float32 rounding of a 16-step loop:
# at most 1.8e-6 apart measured (2026-12-05, fixed, second_order and kl), held to ten times that.
LOGPROB_TOL = 2e-5
# fixed depth, the latent rules (step norms, contraction) and the decoding ones (a distribution's change, its
# confidence and margin), each at a threshold where tiny-raven's tokens exit at many different iterations
RULES = [("fixed", 16.0), ("second_order", 1.0), ("second_order", 0.1), ("first_order", 1e-3), ("contraction", 0.02),
         ("kl", 1e-3), ("confidence", 0.9), ("margin", 0.125)]


@pytest.fixture(scope="module")
def ck():
    return open_checkpoint("tiny-raven", dtype="float32")


@pytest.fixture(scope="module")
def docs(ck):
    rows = [json.loads(line) for line in (ROOT / "tasks/chains/test.jsonl").read_text().splitlines()[:6]]
    return [(ck.tokenizer.encode(r["prompt"]), ck.tokenizer.encode(" " + r["answer"])) for r in rows]


def config(policy: str, threshold: float) -> ExitConfig:
    return ExitConfig(policy, threshold=threshold, exit_mode=None if policy == "fixed" else "freeze")


@pytest.mark.parametrize("policy,threshold", RULES)
def test_generation_matches_engine(ck, docs, policy, threshold):
    prompts = [p for p, _ in docs]
    cfg = config(policy, threshold)
    want = ExitEngine(ck.model, cfg).generate(prompts, 16, batch_size=4)
    got = VllmEngine(ck, cfg, rows=16).generate(prompts, 16)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert [r.exit_steps for r in g.records] == [r.exit_steps for r in w.records]
        assert g.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_TOL)
    if policy != "fixed":  # the rule did let tokens go early, so the exits compared are not all K
        assert any(r.exit_steps[0] < 16 for res in got for r in res.records)


@pytest.mark.parametrize("policy,threshold", RULES)
def test_scoring_matches_engine(ck, docs, policy, threshold):
    requests = [(p + a, len(p)) for p, a in docs] + [(p + p, len(p)) for p, _ in docs[:2]]
    cfg = config(policy, threshold)
    want = ExitEngine(ck.model, cfg).score(requests, batch_size=4)
    got = VllmEngine(ck, cfg, rows=16).score(requests)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert g.greedy == w.greedy
        assert [r.exit_steps for r in g.records] == [r.exit_steps for r in w.records]
        assert g.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_TOL)
    if policy != "fixed":
        assert any(r.exit_steps[0] < 16 for res in got for r in res.records)


@pytest.fixture(scope="module")
def sandwich(tmp_path_factory):
    """A random checkpoint in Huginn-0125's layout (2 prelude, 4 core, 2 coda layers, sandwich blocks, qk bias,
    noise-initialised state), small: the plugin's prelude and coda attention, which tiny-raven has none of.
    Head size 32: vLLM's CPU attention takes no smaller."""
    from helpers.models import make_tiny_raven, make_tiny_tokenizer

    from exitbench.models.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("vllm") / "sandwich"
    model = make_tiny_raven(n_embd=64, n_heads=2, intermediate_size=128, init_scale=1.0, mean_recurrence=4,
                            max_recurrence=8)
    save_checkpoint(model, path, make_tiny_tokenizer())
    return open_checkpoint(path, dtype="float32")


# latent rules only: a decoding rule's probe on a model with a coda is refused (tests/test_vllm_refusals.py)
@pytest.mark.parametrize("policy,threshold", [("fixed", 8.0), ("second_order", 3.0), ("first_order", 3.0)])
def test_prelude_and_coda_match_engine(sandwich, policy, threshold):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    cfg = ExitConfig(policy, threshold=threshold, **({} if policy == "fixed" else {"max_steps": 8,
                                                                                   "exit_mode": "freeze"}))
    vllm_engine = VllmEngine(sandwich, cfg, rows=16)
    pairs = [(ExitEngine(sandwich.model, cfg).generate(prompts, 16, batch_size=2), vllm_engine.generate(prompts, 16)),
             (ExitEngine(sandwich.model, cfg).score([(p + p, len(p)) for p in prompts], batch_size=2),
              vllm_engine.score([(p + p, len(p)) for p in prompts]))]
    for want, got in pairs:
        for w, v in zip(want, got):
            assert v.tokens == w.tokens
            assert [r.exit_steps for r in v.records] == [r.exit_steps for r in w.records]
            assert v.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_TOL)
    if policy != "fixed":
        assert len({r.exit_steps[0] for res in pairs[0][1] for r in res.records}) > 1


def test_run_backend_vllm_matches_hf_cells(tmp_path):
    """The issue's acceptance: `exitbench run --backend vllm` writes cells keyed "backend": "vllm" whose quality
    equals the hf backend's and whose mean iterations are within 2% of it, under --exit-mode freeze on both.
    (Last in the module: the command shuts vLLM down as it ends, process group included, so vllm runs first:
    the hf command's own teardown would otherwise take down the group vLLM made in this process.)"""
    from helpers.cli import run_ok

    from exitbench.store.loading import load

    args = ("-c", "tiny-raven", "-p", "second_order", "--thresholds", "1", "--baselines", "16", "--tasks", "chains",
            "--limit", "16", "--exit-mode", "freeze", "--timing-repeats", "0")
    found = {}
    for backend in ("vllm", "hf"):
        run_ok(*args, "--backend", backend, "--out", str(tmp_path / backend))
        found[backend] = {c["policy"]["policy"]: c for c in load([tmp_path / backend])}
    assert set(found["vllm"]) == {"fixed", "second_order"}
    for policy, cell in found["vllm"].items():
        hf = found["hf"][policy]
        assert cell["key"]["backend"] == "vllm" and "backend" not in hf["key"]
        assert cell["quality"]["value"] == hf["quality"]["value"]
        assert cell["iterations"]["mean"] == pytest.approx(hf["iterations"]["mean"], rel=0.02)


def test_a_vllm_run_keeps_vllms_logs_off_the_table(tmp_path):
    """Issue 72: vLLM logged 48 lines to stdout in the middle of the result table (a 15-line chat template
    warm-up traceback among them, in a run that succeeded). In its own process, as a user runs it: stdout is
    exitbench's progress and table alone, the table names the backend, and vLLM's start-up warnings are gone."""
    import subprocess
    import sys

    from helpers.cli import subprocess_env

    out = tmp_path / "vllm"
    done = subprocess.run([sys.executable, "-m", "exitbench", "run", "-c", "tiny-raven", "--backend", "vllm", "-p",
                           "second_order", "--thresholds", "1", "--baselines", "16", "--tasks", "chains", "--limit",
                           "8", "--exit-mode", "freeze", "--timing-repeats", "0", "--out", str(out)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(backend vllm)" in " ".join(done.stdout.split())  # (the title may fold)
    for line in done.stdout.splitlines():
        assert "WARNING" not in line and "INFO" not in line and "Traceback" not in line, done.stdout
    assert "Chat template warmup failed" not in done.stderr
