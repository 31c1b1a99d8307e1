"""The vLLM plugin's forward (exitbench.serving.vllm.forward.ExitForward) without vLLM: the same flat batch vLLM
hands the model, attention through a small per-(layer, iteration) key store standing in for vLLM's one KV cache
per Attention instance. Greedy generation through it gives the engine's tokens and per-token exits under freeze,
in the fast suite (tests/test_vllm_parity.py holds the real vLLM to the same, where vLLM is installed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.models.checkpoint import open_checkpoint
from exitbench.serving.vllm.forward import Bridge, ExitForward

ROOT = Path(__file__).resolve().parents[1]


class OneSequenceKV:
    """vLLM's attention for one sequence: each (layer, iteration) keeps its own keys and values, every call
    appends the scheduled tokens' and each token attends causally to its sequence's keys so far."""

    def __init__(self, heads: int, kv_heads: int):
        self.heads, self.kv_heads, self.store = heads, kv_heads, {}

    def __call__(self, layer: int, iteration: int, q, k, v):
        n = q.shape[0]
        old_k, old_v = self.store.get((layer, iteration), (k[:0], v[:0]))
        keys, values = torch.cat([old_k, k]), torch.cat([old_v, v])
        self.store[(layer, iteration)] = keys, values
        d = q.shape[1] // self.heads
        qh = q.view(n, self.heads, d).transpose(0, 1)
        kh = keys.view(-1, self.kv_heads, d).transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        vh = values.view(-1, self.kv_heads, d).transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        mask = torch.ones(n, keys.shape[0], dtype=torch.bool).tril(keys.shape[0] - n)
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(0, 1).reshape(n, -1)


def generate(ck, config: ExitConfig, prompt: list[int], new: int) -> tuple[list[int], list[int]]:
    """Greedy tokens and each one's exit iteration, as vLLM would step the plugin: the prompt in one forward
    (its last position with exits), then one token per forward."""
    heads_kv, _ = ck.model.cache_geometry()
    forward = ExitForward(ck.model, config)
    bridge = Bridge(OneSequenceKV(ck.model.config.n_heads, heads_kv))
    ids, exits = list(prompt), [False] * (len(prompt) - 1) + [True]
    positions = list(range(len(prompt)))
    tokens, steps = [], []
    for _ in range(new):
        hidden, k = forward(torch.tensor(ids), torch.tensor(positions), exits, bridge)
        token = int(ck.model.head(hidden[-1:]).argmax(-1))
        tokens.append(token)
        steps.append(k[-1])
        ids, positions, exits = [token], [positions[-1] + 1], [True]
    return tokens, steps


@pytest.fixture(scope="module")
def ck():
    return open_checkpoint("tiny-raven", dtype="float32")


@pytest.mark.parametrize("policy,threshold", [("fixed", 16.0), ("second_order", 1.0), ("kl", 1e-3)])
def test_plugin_forward_generates_the_engines_tokens_and_exits(ck, policy, threshold):
    lines = (ROOT / "tasks/chains/test.jsonl").read_text().splitlines()[:2]
    config = ExitConfig(policy, threshold=threshold, exit_mode=None if policy == "fixed" else "freeze")
    for line in lines:
        prompt = ck.tokenizer.encode(json.loads(line)["prompt"])
        want = ExitEngine(ck.model, config).generate([prompt], 12)[0]
        tokens, steps = generate(ck, config, prompt, 12)
        assert tokens == want.tokens
        assert steps == [r.exit_steps[0] for r in want.records]
        if policy != "fixed":
            assert min(steps) < 16  # the rule did let tokens go


def test_the_plugin_and_the_engine_read_a_rule_through_one_probe_sequence(ck, monkeypatch):
    """The probe (float64 log-probabilities, the signal, `read`, `decide`) is written once, on the policy
    (policies/base.py), and both the engine and the plugin's forward go through it: neither computes a rule's
    log-probabilities itself."""
    from exitbench.policies import ExitPolicy

    calls = {"signal": 0, "read": 0}
    signal, read = ExitPolicy.probe_signal, ExitPolicy.read

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(ExitPolicy, "probe_signal", counted("signal", signal))
    monkeypatch.setattr(ExitPolicy, "read", counted("read", read))
    prompt = ck.tokenizer.encode("f=3 X=0 c=X G=3 V=c")
    config = ExitConfig("second_order", threshold=1.0, exit_mode="freeze")  # read from its third iteration on
    ExitEngine(ck.model, config).generate([prompt], 2)
    assert calls["signal"] > 0 and calls["read"] > 0
    calls.update(signal=0, read=0)
    generate(ck, config, prompt, 2)
    assert calls["signal"] > 0 and calls["read"] > 0
    sources = [p for p in (ROOT / "exitbench").rglob("*.py") if "log_softmax(logits.double()" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in sources] == ["exitbench/policies/base.py"]
