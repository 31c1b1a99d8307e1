"""`--backend vllm`'s bad input, refused in one line with nothing written, and what the plugin refuses to serve
(exitbench.serving.vllm.forward.check_servable, vLLM-free): these run without vLLM, in the fast suite; the
parity of what it does serve is tests/test_vllm_parity.py."""
from __future__ import annotations

import importlib.util

import pytest

from exitbench.engine import ExitConfig
from exitbench.errors import ExitbenchError
from exitbench.models.checkpoint import open_checkpoint
from exitbench.serving.vllm.forward import check_servable

from helpers.cli import assert_one_line_error, run_cli
from helpers.paths import REPO

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the refusal of its absence cannot be seen")
def test_backend_vllm_without_vllm_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "cells"
    res, _ = run_cli("--backend", "vllm", "-p", "second_order", "--thresholds", "1", "--baselines", "16",
                     "--limit", "2", "--exit-mode", "freeze", "--out", str(out))
    assert_one_line_error(res, ("--backend vllm", "pip install", "exitbench[vllm]"))
    assert not out.exists()


def test_unknown_backend_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "cells"
    res, _ = run_cli("--backend", "tgi", "--limit", "2", "--out", str(out))
    assert_one_line_error(res, ("--backend", "hf", "vllm", "tgi"))
    assert not out.exists()


@pytest.fixture(scope="module")
def raven():
    return open_checkpoint("tiny-raven").model


def test_plugin_serves_freeze_and_fixed_depth(raven):
    check_servable(raven, ExitConfig("second_order", threshold=1.0, exit_mode="freeze"))
    check_servable(raven, ExitConfig("kl", threshold=1e-3, exit_mode="freeze"))
    check_servable(raven, ExitConfig("fixed", threshold=16))  # no token exits: any exit mode is the same run


@pytest.mark.parametrize("config,words", [
    (ExitConfig("second_order", threshold=1.0), ("exit mode freeze", "physical", "--exit-mode freeze")),
    (ExitConfig("second_order", threshold=1.0, exit_mode="select"), ("exit mode freeze", "select")),
    (ExitConfig("second_order", threshold=1.0, exit_mode="freeze", prefill="exit"), ("prefill",)),
    (ExitConfig("second_order", threshold=1.0, exit_mode="freeze", refill="eager"), ("--refill",)),
])
def test_plugin_refuses_what_it_cannot_run(raven, config, words):
    with pytest.raises(ExitbenchError) as err:
        check_servable(raven, config)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


@pytest.mark.parametrize("checkpoint", ["tiny-looped-gpt2", "tiny-ouro", "tests/fixtures/nanbeige-tiny",
                                        "tests/fixtures/dory-tiny"])
def test_plugin_refuses_architectures_it_does_not_serve(checkpoint):
    """The plugin registers Raven's model type alone: Ouro and Nanbeige have one loop group with a freeze step,
    and passed this check under --exit-mode freeze, then failed inside vLLM on their config (issue 72). The line says
    whether the installed vLLM has a model of that name (vLLM 0.33 ships Dory's, with a loop count fixed at start)."""
    model = open_checkpoint(REPO / checkpoint if "/" in checkpoint else checkpoint).model
    with pytest.raises(ExitbenchError, match="vLLM backend serves huginn_raven checkpoints") as err:
        check_servable(model, ExitConfig("second_order", threshold=1.0, exit_mode="freeze"))
    assert model.architecture in str(err.value) and "--backend hf" in str(err.value)
    assert ("the installed vLLM has" if HAS_VLLM else "no vLLM is installed") in str(err.value)


def test_plugin_refuses_a_decoding_rule_whose_readout_attends():
    from helpers.models import make_tiny_raven

    huginn_layout = make_tiny_raven()  # 2 prelude, 4 core, 2 coda layers: the readout runs the coda's attention
    check_servable(huginn_layout, ExitConfig("second_order", threshold=1.0, exit_mode="freeze"))
    with pytest.raises(ExitbenchError, match="coda") as err:
        check_servable(huginn_layout, ExitConfig("kl", threshold=1e-3, exit_mode="freeze"))
    assert "\n" not in str(err.value) and "--backend hf" in str(err.value)
