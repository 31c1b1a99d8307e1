"""The budgeted prefill exit (prefill_topk) and its random control (prefill_random), exitbench/policies/budget.py.

On the embedded tiny-raven (16 iterations, so the chosen iteration is 8): ρ = 1 is full depth; below it each
sequence keeps exactly ceil(ρ · n) positions looping past iteration 8, the ones whose state moved most there
(checked against the engine's recorded signals and against a plain walk of the model); the random control keeps
as many, reproducibly, whatever the batch; and what cannot mean anything is refused in one line.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import one_line
from helpers.engine import LOGP_TOL, exit_steps

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.errors import ExitbenchError
from exitbench.models import AttnContext
from exitbench.models.checkpoint import open_checkpoint
from exitbench.store import cells

K, CUT = 16, 8
CHAINS = Path(__file__).resolve().parents[1] / "tasks" / "chains" / "test.jsonl"


@functools.cache
def _model():
    return open_checkpoint(None).model.eval()


@functools.cache
def _chains() -> list[list[int]]:
    """Chains programs with their answers (tasks/chains/test.jsonl): the shipped scoring tasks' sequences."""
    tokenizer = open_checkpoint(None).tokenizer
    with open(CHAINS) as f:
        docs = [json.loads(line) for line in f]
    return [tokenizer.encode(f"{d['prompt']} {d['answer']}", add_bos=True) for d in docs]


def _requests(n_ctx_one: bool = True, n: int = 6, seed: int = 3) -> list[tuple[list[int], int]]:
    """n chains sequences drawn at random; with `n_ctx_one` every position is scored (n_context 1), so each
    position's exit is in a record, else the answer alone, as chains_lambada scores it."""
    rng = np.random.default_rng(seed)
    chains = _chains()
    return [(chains[i], 1 if n_ctx_one else len(chains[i]) - 1) for i in rng.choice(len(chains), n, replace=False)]


def _engine(policy: str, **knobs) -> ExitEngine:
    return ExitEngine(_model(), ExitConfig(policy, prefill="exit", **knobs))


def _kept(result) -> list[int]:
    """The positions of a request (all scored) that looped past the chosen iteration."""
    steps = [r.exit_steps[0] for r in result.records]
    assert set(steps) <= {CUT, K}, steps  # a position leaves at the chosen iteration or at full depth, never between
    return [r.position for r in result.records if r.exit_steps[0] > CUT]


@torch.no_grad()
def _relative_change(tokens: list[int], engine: ExitEngine) -> np.ndarray:
    """‖s_8 − s_7‖ / ‖s_8‖ of every input position, from a plain walk of the model to iteration 8 with the engine's
    initial-state noise (no position exits before iteration 8, so the rule's states are these)."""
    model = _model()
    ids = torch.tensor([tokens[:-1]])
    kept: list[torch.Tensor] = []
    model.walk(model.embed(ids), AttnContext(), [CUT],
               noise=lambda group, x: engine.noise.rows(0, ids.shape[1], x.dtype, x.device).unsqueeze(0)
               if group.random_init else None,
               on_state=lambda g, k, s: kept.append(s[0]))
    before, after = kept[CUT - 1].double(), kept[CUT].double()
    return (torch.linalg.vector_norm(after - before, dim=-1) / torch.linalg.vector_norm(after, dim=-1)).numpy()


@pytest.mark.parametrize("policy", ["prefill_topk", "prefill_random"])
def test_a_budget_of_every_position_is_full_depth(policy):
    requests = _requests(n_ctx_one=False)
    full = _engine("fixed").score(requests, batch_size=3)
    run = _engine(policy, threshold=1.0)
    assert run.policies[0].min_steps == CUT and run.policies[0].max_steps == K
    got = run.score(requests, batch_size=3)
    assert [r.logprobs for r in got] == [r.logprobs for r in full]  # the same waves, the same arithmetic
    assert all(k == K for r in got for k in r.iterations)
    assert sum(r.prompt_iterations for r in got) == K * sum(r.prompt_positions for r in got) > 0
    # and full depth with the prompt prefilled (prefill full): the same numbers to float rounding
    prefilled = ExitEngine(_model(), ExitConfig("fixed")).score(requests, batch_size=3)
    for a, b in zip(got, prefilled):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGP_TOL)


@pytest.mark.parametrize("rho", [0.1, 0.25, 0.5])
def test_topk_keeps_the_fraction_whose_state_moved_most(rho):
    requests = _requests()
    run = _engine("prefill_topk", threshold=rho, record_signals=True)
    for (tokens, _), result in zip(requests, run.score(requests, batch_size=4)):
        n = len(tokens) - 1
        kept = _kept(result)
        assert len(kept) == math.ceil(round(rho * n, 9)), (n, kept)
        # the engine's own signal at the chosen iteration, and the same change from a plain walk of the model
        recorded = np.array([r.signals[0][CUT - 1] for r in result.records])
        direct = _relative_change(tokens, run)
        np.testing.assert_allclose(recorded, direct, rtol=1e-4)
        for values in (recorded, direct):
            top = sorted(np.argsort(-values, kind="stable")[:len(kept)].tolist())
            assert kept == top
        # (no near tie decides it: the last kept and the first left are apart by more than rounding)
        ranked = np.sort(direct)[::-1]
        assert len(kept) == n or ranked[len(kept) - 1] - ranked[len(kept)] > 1e-3 * ranked[len(kept)]


def test_fractions_are_read_as_the_decimals_given():
    policy = ExitConfig("prefill_topk", threshold=0.1, prefill="exit").build_policy()
    assert [policy.kept(n) for n in (1, 9, 10, 11, 30)] == [1, 1, 1, 2, 3]  # float's 0.1 · 30 would ceil to 4


def test_random_keeps_as_many_reproducibly_and_alone_as_batched():
    requests = _requests(n=8)
    topk = _engine("prefill_topk", threshold=0.25).score(requests, batch_size=4)
    random = _engine("prefill_random", threshold=0.25)
    batched = random.score(requests, batch_size=3)
    alone = [random.score([r])[0] for r in requests]
    again = _engine("prefill_random", threshold=0.25).score(requests, batch_size=8)
    assert exit_steps(batched) == exit_steps(alone) == exit_steps(again)
    assert [len(_kept(r)) for r in batched] == [len(_kept(r)) for r in topk]
    assert [_kept(r) for r in batched] != [_kept(r) for r in topk]
    # the draw is the seed's and the sequence's: another seed draws otherwise
    other = _engine("prefill_random", threshold=0.25, seed=1).score(requests, batch_size=3)
    assert [_kept(r) for r in other] != [_kept(r) for r in batched]
    # and the sequence's inputs alone: another last token (another option of a multiple-choice question) draws alike
    options = [(tokens[:-1] + [tokens[-1] + 1], n) for tokens, n in requests]
    assert [_kept(r) for r in random.score(options, batch_size=3)] == [_kept(r) for r in batched]
    for a, b in zip(batched, alone):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGP_TOL)


def test_topk_alone_as_batched():
    requests = _requests(n_ctx_one=False, n=8, seed=4)
    run = _engine("prefill_topk", threshold=0.25)
    batched = run.score(requests, batch_size=3)
    alone = [run.score([r])[0] for r in requests]
    assert exit_steps(batched) == exit_steps(alone)
    for a, b in zip(batched, alone):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGP_TOL)
        assert (a.prompt_positions, a.prompt_iterations) == (b.prompt_positions, b.prompt_iterations)


def test_a_cell_counts_the_prompt_positions_beside_the_scored_ones():
    result = _engine("prefill_topk", threshold=0.1).score(_requests(n_ctx_one=False, n=3))
    stats = [cells.request_stats(r.records, 0.0, prompt=(r.prompt_positions, r.prompt_iterations)) for r in result]
    iterations = cells.summarize([{**s, "task_name": "t", "doc_id": i, "idx": 0, "schedule": "depth_major"}
                                  for i, s in enumerate(stats)])["iterations"]
    scored = [k for r in result for k in r.iterations]
    prompt = sum(r.prompt_iterations for r in result)
    positions = sum(r.prompt_positions for r in result) + len(scored)
    assert iterations["mean"] == pytest.approx(sum(scored) / len(scored))
    assert iterations["every_position"] == {"positions": positions, "mean": pytest.approx((sum(scored) + prompt)
                                                                                          / positions)}
    assert CUT < iterations["every_position"]["mean"] < K


def test_what_a_budget_cannot_mean_is_refused():
    with pytest.raises(ExitbenchError, match=r"prefill_topk: threshold ρ .* must be in \(0, 1\]; got 1.5"):
        ExitConfig("prefill_topk", threshold=1.5, prefill="exit")
    with pytest.raises(ExitbenchError, match="set prefill exit"):
        ExitConfig("prefill_random", threshold=0.5)
    with pytest.raises(ExitbenchError, match="patience has no meaning"):
        ExitConfig("prefill_topk", threshold=0.5, prefill="exit", patience=2)
    with pytest.raises(ExitbenchError, match="horizon late"):
        ExitConfig("prefill_topk", threshold=0.5, prefill="exit", horizon="late")
    for knob in ({"warm_start": True}, {"kv_window": 2}, {"kv_layout": "first_then_shared"}):
        with pytest.raises(ExitbenchError, match="scores one position at a time"):
            ExitConfig("prefill_topk", prefill="exit", **knob)
    with pytest.raises(ExitbenchError, match="only the depth-major schedule"):
        ExitEngine(_model(), ExitConfig("prefill_topk", prefill="exit"), schedule="token_major")
    with pytest.raises(ExitbenchError, match="generation makes one token at a time"):
        _engine("prefill_topk").generate([[1, 5, 9]], 2)
    with pytest.raises(ExitbenchError, match="cannot join a conjunction"):
        ExitConfig("all_of", prefill="exit", rules=[{"policy": "prefill_topk"}, {"policy": "kl"}])


@pytest.mark.parametrize("args,words", [
    (["--thresholds", "1.5"], ["prefill_topk", "(0, 1]", "1.5"]),
    (["--thresholds", "0"], ["--thresholds", "> 0"]),
    (["--thresholds", "-0.25"], ["--thresholds", "> 0"]),
    (["--tasks", "chains_mc,chains"], ["task chains", "generate_until", "chains_lambada"]),
    (["--prefill", "full"], ["--prefill full", "drop --prefill"]),
    (["--policy", "kl"], ["kl would then run so too", "--prefill exit"]),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(args, words, tmp_path, capfd):
    out = tmp_path / "out"
    base = {"--policy": "prefill_topk", "--tasks": "chains_mc", "--limit": "2", "--timing-repeats": "0"}
    extra = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    command = ["run", "--policy", "prefill_topk"] + [x for k, v in {**base, **extra}.items() if k != "--policy"
                                                     for x in (k, v)]
    if "--policy" in extra:
        command += ["--policy", extra["--policy"]]
    one_line([*command, "--out", str(out), "--quiet"], capfd, words)
    assert not out.exists()


def test_a_cell_says_the_chosen_iteration_the_rule_ran():
    from exitbench.sweep.exact import resolved_policy

    config = ExitConfig("prefill_topk", threshold=0.25, prefill="exit")
    section = resolved_policy(config, config.bound_policies(_model().loop_groups())[0])
    assert (section["min_steps"], section["earliest_exit"], section["max_steps"]) == (CUT, CUT, K)
    chosen = ExitConfig("prefill_topk", threshold=0.25, prefill="exit", min_steps=12)
    assert resolved_policy(chosen, chosen.bound_policies(_model().loop_groups())[0])["min_steps"] == 12
    ran = ExitEngine(_model(), chosen).score(_requests(n=3))
    assert {k for r in ran for k in r.iterations} == {12, K}


def test_calibrate_orders_a_budget_grid_from_the_largest_fraction():
    from exitbench.studies.calibrate import conservative_order

    assert conservative_order("prefill_topk", [0.1, 0.75, 0.25]) == [0.75, 0.25, 0.1]


def test_policy_all_leaves_the_budgets_out():
    from exitbench.sweep.config import expand_policies

    names = expand_policies(["all"])
    assert "second_order" in names and not {"prefill_topk", "prefill_random"} & set(names)
