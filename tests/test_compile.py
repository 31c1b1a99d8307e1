"""--compile: each loop group's step torch.compile'd, marked on the model and in every cell's key."""
from __future__ import annotations

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.sweep import SweepConfig, cell_key

from helpers.models import make_gpt2, make_tiny_raven, random_ids


@pytest.mark.parametrize("make", [make_tiny_raven, make_gpt2])
def test_compile_loops_replaces_each_step_once(make):
    """torch.compile is lazy, so this costs nothing: the step is swapped and marked, and a second call keeps it."""
    model = make()
    originals = [g.step for g in model.loop_groups()]
    assert not model.compiled
    model.compile_loops()
    steps = [g.step for g in model.loop_groups()]
    assert model.compiled and all(g.compiled for g in model.loop_groups())
    assert all(s is not o for s, o in zip(steps, originals))
    model.compile_loops()
    assert [g.step for g in model.loop_groups()] == steps


def test_a_compiled_cell_has_its_own_key_and_others_keep_theirs():
    cfg, exit_cfg = SweepConfig(tasks=["chains"], policies=["kl"]), ExitConfig("kl")
    plain = {"fingerprint": "f" * 16, "dtype": "float32"}
    key = cell_key(plain, "chains", "t", exit_cfg, cfg, "cpu")
    assert "compiled" not in key  # cells computed before --compile existed keep their ids
    assert cell_key({**plain, "compiled": True}, "chains", "t", exit_cfg, cfg, "cpu") == {**key, "compiled": True}


@pytest.mark.slow
def test_compiled_engine_gives_the_same_answers():
    """The compiled step (about half a minute to compile on 2 cores) scores as the eager one does: same exit
    steps, log-probabilities within float32 rounding. Its fast stand-ins are the two tests above."""
    model = make_tiny_raven(mean_recurrence=4, max_recurrence=8)
    requests = [(random_ids(1, n, seed=n)[0].tolist(), 2) for n in (7, 11, 9)]
    config = ExitConfig("second_order", threshold=1e-2)
    eager = ExitEngine(model, config).score(requests, batch_size=2)
    model.compile_loops()
    compiled = ExitEngine(model, config).score(requests, batch_size=2)
    for a, b in zip(eager, compiled):
        assert [r.exit_steps for r in a.records] == [r.exit_steps for r in b.records]
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
