"""--compile: each loop group's step torch.compile'd, marked on the model and in every cell's key."""
from __future__ import annotations

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.sweep.config import SweepConfig
from exitbench.sweep.keys import cell_key

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


def test_the_functions_kept_outside_graphs_are_called_through_their_module():
    """`models.attention.OUTSIDE_GRAPHS` are marked for dynamo only when a step is first compiled (marking imports
    torch._dynamo, 1.1 s of every process's start): a module holding one by a name of its own would keep calling
    the unmarked function, which dynamo would then trace. Importing exitbench marks nothing."""
    import importlib
    import pkgutil
    import subprocess
    import sys

    import exitbench
    from exitbench.models import attention

    for info in pkgutil.walk_packages(exitbench.__path__, "exitbench."):
        if ".vllm" in info.name or info.name.endswith("__main__"):  # (vLLM's own imports; a program)
            continue
        module = importlib.import_module(info.name)
        held = [n for n, obj in vars(module).items() if module is not attention
                for f in attention.OUTSIDE_GRAPHS if obj is getattr(attention, f)]
        assert held == [], f"{info.name} holds {held}: call them as attention.<name>"
    code = "import sys, exitbench.cli, exitbench.models.attention; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_compiled_cell_has_its_own_key_and_others_keep_theirs():
    cfg, exit_cfg = SweepConfig(tasks=["chains"], policies=["kl"]), ExitConfig("kl")
    plain = {"fingerprint": "f" * 16, "dtype": "float32"}
    key = cell_key(plain, "chains", "t", exit_cfg, cfg, "cpu")
    assert "compiled" not in key  # cells computed before --compile existed keep their ids
    assert cell_key({**plain, "compiled": True}, "chains", "t", exit_cfg, cfg, "cpu") == {**key, "compiled": True}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["token_major", "depth_major"])
def test_compiled_engine_gives_the_same_answers_and_compiles_once(schedule):
    """The compiled step (about half a minute to compile on 2 cores) scores as the eager one does: same exit
    steps, log-probabilities within float32 rounding (the compiled kernels sum in another order; 1e-4 on
    log-probabilities of a 4-iteration tiny model is ~100 ulps, far below any exit decision's margin). The graphs
    compiled on the first pass serve a second pass of other lengths and batch shapes: none is added, and
    dynamo never reaches its recompile limit (it then runs the step eagerly, silently). Its fast stand-ins are
    the two tests above."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_tiny_raven(mean_recurrence=4, max_recurrence=8)
    passes = [([(random_ids(1, n, seed=n)[0].tolist(), 2) for n in lengths], batch)
              for lengths, batch in (((7, 11, 9), 2), ((5, 13, 6, 17, 8), 4), ((3, 4), 1), ((12, 3, 19, 10, 4, 15), 3))]
    config = ExitConfig("second_order", threshold=1e-2)
    eager = [ExitEngine(model, config, schedule=schedule).score(r, batch_size=b) for r, b in passes]
    model.compile_loops()
    engine = ExitEngine(model, config, schedule=schedule)
    compiled = [engine.score(r, batch_size=b) for r, b in passes[:3]]
    graphs = counters["stats"]["unique_graphs"]
    compiled.append(engine.score(*passes[3]))  # new lengths, a new batch size: nothing to compile
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    assert not [k for k in counters["unimplemented"] if "recompile" in k.lower()]
    for a, b in zip(sum(eager, []), sum(compiled, [])):
        assert [r.exit_steps for r in a.records] == [r.exit_steps for r in b.records]
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_compiled_continuous_step_traces_whole_and_generates_as_eager(monkeypatch):
    """Issue 69: under continuous depth batching a step's places keep their shapes, so a compiled step reads and
    writes the cache inside its graph: no step of places at their own slots calls the eager cache path (only
    chunks do: the prefill and steps in lockstep), and greedy generation gives eager's tokens and exits, its log-probabilities
    within float32 rounding (1e-4, as the scoring test above). About half a minute to compile on 2 cores."""
    import collections

    from torch._dynamo.utils import counters

    from exitbench.models import attention

    torch._dynamo.reset()
    counters.clear()
    model = make_tiny_raven(mean_recurrence=4, max_recurrence=8)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (7, 11, 9, 5, 13, 6, 17, 8, 3, 12, 4, 15)]
    config = ExitConfig("second_order", threshold=3.0, max_steps=8)  # (exits at 5 to 8 on this random model)
    eager = ExitEngine(model, config).generate(prompts, 6, batch_size=4)
    eager_paths = collections.Counter()
    original = attention._cache_attention

    def counted(q, k, v, ctx, layer_id):  # (prelude and coda run eagerly, outside compiled steps: not counted)
        if ctx.index is None:
            eager_paths["chunk"] += 1
        elif ctx.index.fixed and ctx.index.slot is None:
            eager_paths["places"] += 1
        return original(q, k, v, ctx, layer_id)

    monkeypatch.setattr(attention, "_cache_attention", counted)
    model.compile_loops()
    compiled = ExitEngine(model, config).generate(prompts, 6, batch_size=4)
    assert not [k for k in counters["unimplemented"] if "recompile" in k.lower()]
    assert eager_paths["chunk"] > 0 and eager_paths["places"] == 0, eager_paths
    # tokens exited at several depths, so places sat at different iterations
    assert len({tuple(r.exit_steps) for res in eager for r in res.records}) > 1
    for a, b in zip(eager, compiled):
        assert a.tokens == b.tokens
        assert [r.exit_steps for r in a.records] == [r.exit_steps for r in b.records]
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
