"""One table of the tiny families (each fixture beside what its public implementation computed on it), driving
what every family must do alike: greedy generation through the engine's cache equals the reference's at batch 1
and batched; the rules it can run exit batched as alone (the same exit steps, log-probabilities to float
rounding); `info` describes it from its headers. What is one family's own (its layout, its refusals, its
per-depth logits against the reference) stays in its own file; the full-size table is tests/test_full_size.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import pytest
import torch
from safetensors.torch import load_file

from exitbench.cli import app
from exitbench.engine import ExitConfig, ExitEngine
from exitbench.models.checkpoint import load_checkpoint

from helpers.cli import explain, runner
from helpers.files import FIXTURES

# (policy, threshold, knobs, must some token exit before the cap?)
Rule = tuple


@dataclass(frozen=True)
class Family:
    fixture: str
    depth: int | None = None  # the fixed depth greedy generation runs at (None: the checkpoint's default)
    batch: int = 3  # rows of the batched greedy run (the reference's prompts)
    # Scoring requests for batched ≡ alone: each prompt's length (of the reference's input_ids) and its context
    lengths: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    rules: tuple[Rule, ...] = ()
    schedules: tuple[str, ...] = ("auto",)
    generate_too: bool = False  # also hold batched generation with exits to generation alone
    slow_rules: frozenset[str] = field(default_factory=frozenset)  # rules whose case is marked slow


# Thresholds sit in wide gaps of each fixture's signals (the family files say which), so float rounding cannot
# move an exit between batch shapes.
FAMILIES = {
    # a token may stop after loop 1, 2 or 3 of 4; first order's steps fall 0.41-0.58, 0.17-0.28, 0.09-0.18 at loops 1-3
    # and second order's 0.30-0.47, 0.12-0.19 at loops 2-3, so both stop every token early, in a wide gap
    "dory": Family("dory-tiny", lengths=(12, 7, 10), contexts=(2, 3, 1),
                   rules=(("first_order", 0.34, {}, True), ("second_order", 0.55, {}, True)),
                   schedules=("token_major", "depth_major"), generate_too=True),
    "hrm-text": Family("hrm-text-tiny", lengths=(12, 7, 10), contexts=(2, 3, 1),
                       # a token may stop after H cycle 1; kl compares two readouts and first order's step out of
                       # the start state is five times any later one, so neither lets cycle 1 go (signals: confidence
                       # 0.014-0.027, kl 0.004-0.008 and first order 1.97-2.83 at cycle 2)
                       rules=(("kl", 1e-2, {"max_steps": 2}, False), ("confidence", 0.02, {"max_steps": 2}, True),
                              ("first_order", 2.4, {"max_steps": 2}, False), ("oracle", None, {"max_steps": 2}, True))),
    "nanbeige": Family("nanbeige-tiny", lengths=(12, 7, 10), contexts=(2, 2, 2),
                       rules=(("kl", 1e-3, {}, False), ("confidence", 0.2, {}, False),
                              ("second_order", 1.0, {}, False), ("oracle", None, {}, False))),
    "ouro": Family("ouro-tiny", lengths=(12, 7, 10), contexts=(2, 2, 2),
                   rules=(("qexit", 0.5, {}, False), ("gate", 0.4, {}, False), ("second_order", 1.0, {}, False),
                          ("kl", 1e-2, {}, False), ("confidence", 0.5, {}, False)),
                   schedules=("token_major", "depth_major"), generate_too=True),
    "inkling2": Family("inkling2-tiny", lengths=(20, 13, 17), contexts=(2, 3, 1),
                       # confidence and margin read one readout, so they may stop a token after pass 1 (signals:
                       # confidence 0.012-0.027, kl 0.07-0.25, margin 0.02-0.95); 3-5 s each, so one is fast
                       rules=(("confidence", 0.017, {}, True), ("confidence", 0.017, {"exit_mode": "select"}, True),
                              ("margin", 0.1, {}, True), ("kl", 0.1, {}, False), ("oracle", None, {}, False)),
                       slow_rules=frozenset({"margin", "kl", "oracle", "confidence-select"})),
    "retrofit-llama": Family("retrofit-llama-tiny", depth=4, batch=2),
    "retrofit-olmo": Family("retrofit-olmo-tiny", depth=4, batch=2),
}


@lru_cache(maxsize=None)
def loaded(name: str):
    fixture = FAMILIES[name].fixture
    return load_checkpoint(FIXTURES / fixture), load_file(str(FIXTURES / f"{fixture}-reference.safetensors"))


def greedy_prompts(ref) -> list[list[int]]:
    if "greedy_prompt" in ref:
        return [p.tolist() for p in ref["greedy_prompt"]]
    return [row[:n].tolist() for row, n in zip(ref["input_ids"], ref["greedy_prompt_lengths"].tolist())]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_generation_through_the_cache_matches_the_reference(name):
    family = FAMILIES[name]
    ck, ref = loaded(name)
    engine = ExitEngine(ck.model, ExitConfig("fixed", threshold=family.depth))
    for batch_size in (1, family.batch):
        out = engine.generate(greedy_prompts(ref), max_new_tokens=ref["greedy_tokens"].shape[1], batch_size=batch_size)
        assert [r.tokens for r in out] == ref["greedy_tokens"].tolist(), batch_size


def _label(policy: str, knobs: dict) -> str:
    return policy + ("-" + knobs["exit_mode"] if "exit_mode" in knobs else "")


EXIT_CASES = [pytest.param(name, rule, schedule, id=f"{name}-{_label(rule[0], rule[2])}-{schedule}",
                           marks=[pytest.mark.slow] if _label(rule[0], rule[2]) in f.slow_rules else [])
              for name, f in sorted(FAMILIES.items()) for rule in f.rules for schedule in f.schedules]


@pytest.mark.parametrize("name,rule,schedule", EXIT_CASES)
def test_exits_batched_equal_batch_size_one(name, rule, schedule):
    family = FAMILIES[name]
    ck, ref = loaded(name)
    policy, tau, knobs, early = rule
    requests = [(row[:n].tolist(), c) for row, n, c in zip(ref["input_ids"], family.lengths, family.contexts)]
    engine = ExitEngine(ck.model, ExitConfig(policy, threshold=tau, **knobs), schedule=schedule)
    solo = [engine.score([r], batch_size=1)[0] for r in requests]
    together = engine.score(requests, batch_size=len(requests))
    for a, b in zip(solo, together):
        assert [r.exit_steps for r in a.records] == [r.exit_steps for r in b.records]
        # 1e-5: the batch shape moves float32 rounding of the log-probabilities, never an exit
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-6)
    cap = engine.policies[0].max_steps
    exits = [r.exit_steps[0] for res in together for r in res.records]
    assert all(1 <= e <= cap for e in exits)
    if early:
        assert min(exits) < cap, exits  # the threshold does let tokens go: the case tests exits, not full depth
    if family.generate_too:
        gen_solo = [engine.generate([r[0][:4]], max_new_tokens=4)[0] for r in requests]
        gen = engine.generate([r[0][:4] for r in requests], max_new_tokens=4, batch_size=len(requests))
        assert [r.tokens for r in gen] == [r.tokens for r in gen_solo]
        assert [r.iterations for r in gen] == [r.iterations for r in gen_solo]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_info_describes_every_family_from_its_headers(name):
    res = runner.invoke(app, ["info", "-c", str(FIXTURES / FAMILIES[name].fixture)])
    assert res.exit_code == 0, explain(res)
    ck, _ = loaded(name)
    assert ck.model.architecture in res.output
