"""Depth speculation (exitbench/engine/speculation.py): drafts at a shallow depth, verified at full depth, give full
depth's greedy output token for token on every embedded model, whatever the draft depth and draft length."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from exitbench.engine import ExitConfig, ExitEngine
from exitbench.engine.speculation import DepthSpeculator
from exitbench.errors import ExitbenchError
from exitbench.models.checkpoint import open_checkpoint

PROMPTS = ("a=3 b=a c=b d=c. d?", "x=7 y=x. y?", "q=2 r=q s=r t=s u=t. u?")
NEW = 12


@lru_cache(maxsize=None)
def full_depth(name: str):
    """The model, its prompts, and full depth's greedy continuations through the engine."""
    ck = open_checkpoint(name)
    prompts = [ck.tokenizer.encode(p) for p in PROMPTS]
    return ck.model, prompts, ExitEngine(ck.model, ExitConfig("fixed")).generate(prompts, max_new_tokens=NEW)


@pytest.mark.parametrize("name", ["tiny-raven", "tiny-looped-gpt2", "tiny-ouro"])
@pytest.mark.parametrize("draft,k", [(1, 1), (2, 3), (4, 6), (1, 0)])
def test_speculation_generates_full_depths_greedy_output(name, draft, k):
    """Tiny-raven's loop starts from position-keyed noise, so this also holds the draft and verify passes to the
    engine's noise. 1e-5: chunk and token passes sum attention in another order (measured 7e-6 at most)."""
    model, prompts, want = full_depth(name)
    got = DepthSpeculator(model, draft, k).generate(prompts, max_new_tokens=NEW)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    torch.testing.assert_close(torch.tensor([g.logprobs for g in got]), torch.tensor([w.logprobs for w in want]),
                               atol=1e-5, rtol=0)
    full = sum(model.resolve_steps(None))
    for g in got:
        # the prefill's token, then per round its kept drafts and full depth's own token (one short where the
        # round reached max_new_tokens); every round verified k' + 1 positions at full depth
        assert 1 + sum(a + 1 for a in g.accepted) >= len(g.tokens) == NEW
        assert all(0 <= a <= k for a in g.accepted) and (k or g.draft_iterations == 0)
        assert g.verify_iterations % full == 0


def test_a_stop_id_ends_it_where_full_depth_stops():
    model, prompts, want = full_depth("tiny-ouro")
    stop = want[0].tokens[4]
    (got,) = DepthSpeculator(model, 2, 6).generate(prompts[:1], max_new_tokens=NEW, stop_ids=[stop])
    (alone,) = ExitEngine(model, ExitConfig("fixed")).generate(prompts[:1], max_new_tokens=NEW, stop_ids=[stop])
    assert got.tokens == alone.tokens and got.stopped_by == alone.stopped_by == "stop_id"


@pytest.mark.parametrize("draft,k,words", [(12, 4, "not below full depth"), (0, 4, "≥ 1"), (2, -1, "(k)")])
def test_a_draft_that_cannot_speculate_is_refused_in_one_line(draft, k, words):
    model = full_depth("tiny-ouro")[0]  # full depth 12
    with pytest.raises(ExitbenchError) as err:
        DepthSpeculator(model, draft, k)
    assert words in str(err.value) and "\n" not in str(err.value)
