"""The third embedded model, tiny-ouro: shipped like the others, its iterations matter, its two gates are the
two stages of one training run, and the committed sweep is its own."""
from __future__ import annotations

import pytest
import torch

from exitbench.store import loading
from exitbench.models import checkpoint, embedded
from exitbench.store.identity import checkpoint_identity
from exitbench.studies.depth import depth_report
from exitbench.training.gate_objectives import exit_distribution

from helpers.paths import REPO

NAME = "tiny-ouro"
pytestmark = pytest.mark.skipif(NAME not in embedded.embedded_names(), reason="tiny-ouro is not shipped here")


@pytest.fixture(scope="module")
def ouro():
    return checkpoint.open_checkpoint(NAME)


@pytest.fixture(scope="module")
def depth(ouro):
    return depth_report(ouro, r_values=(1, 4, 8, 12, 24), n_programs=64)


def test_it_is_an_ouro_with_a_gate_smaller_than_the_other_two(ouro):
    assert ouro.model.architecture == "ouro" and ouro.model.gated
    sizes = {name: checkpoint.open_checkpoint(name).model.num_parameters() for name in ("tiny-raven",
                                                                                        "tiny-looped-gpt2")}
    assert ouro.model.num_parameters() < min(sizes.values())
    training = ouro.provenance["training"]
    assert training["command"].startswith("exitbench train --out tiny-ouro") and "--arch ouro" in training["command"]
    assert training["train_config"]["arch"] == "ouro" and training["stage"] == 2
    assert training["training_seconds"] < 3600  # the issue's budget: under an hour on 2 cores


def test_the_hardest_hop_needs_the_loop_and_the_trained_depth_covers_it(depth):
    by_r = {row["r"]: row for row in depth["by_r"]}
    hardest = depth["levels"]
    trained = by_r[12]["accuracy_by_hop"]
    assert trained[hardest] >= 0.95, "T = 12 covers the hardest hop"
    assert trained[hardest] - by_r[1]["accuracy_by_hop"][hardest] >= 0.5
    assert trained[hardest] - by_r[4]["accuracy_by_hop"][hardest] >= 0.5, "hop 12 needs more than 4 steps"
    assert by_r[1]["accuracy_by_hop"][1] >= 0.95, "hop 1 needs no lookup"


def test_stage_one_checkpoint_is_the_same_lm_with_the_untrained_gate(ouro):
    first = checkpoint.open_checkpoint(f"{NAME}/stage-1")
    assert first.provenance["training"]["stage"] == 1
    final, initial = ouro.model.state_dict(), first.model.state_dict()
    differ = {k for k in final if not torch.equal(final[k], initial[k])}
    assert differ == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}


def test_stage_two_gate_exits_earlier_on_easy_tokens_than_on_hard_ones(ouro):
    """What stage II is for: the gate's exit step follows the difficulty."""
    from exitbench.harness.documents import heldout_batch

    (x, y, hops), _ = heldout_batch(ouro, 32, 1)
    group = ouro.model.loop_groups()[0]
    states = ouro.model.iterates(x, 12)[0][1:]
    lams = torch.sigmoid(torch.stack([group.gate(s) for s in states]))
    cdf = exit_distribution(lams.flatten(1)).view_as(lams).cumsum(0)
    exit_step = (cdf >= 0.5).float().argmax(0) + 1
    assert exit_step[hops == 1].float().mean() + 3 <= exit_step[hops == 12].float().mean()


def test_committed_sweep_is_of_this_model_and_has_every_part_the_issue_names():
    cells = loading.load([REPO / "results" / NAME])
    fingerprint = checkpoint_identity(embedded.resolve(NAME)).short
    assert {c["model"]["fingerprint"] for c in cells} == {fingerprint}
    policies = {c["policy"]["policy"] for c in cells}
    assert {"qexit", "oracle", "kl", "confidence", "second_order", "second_order_magnitude", "first_order",
            "learned", "fixed"} <= policies
    modes = {c["key"]["exit"].get("exit_mode") or "physical" for c in cells}
    assert modes == {"physical", "select"}
    qs = {c["policy"]["threshold"] for c in cells if c["policy"]["policy"] == "qexit"}
    assert len(qs) >= 5
    stage1 = loading.load([REPO / "results" / f"{NAME}-stage1"])
    assert {c["policy"]["policy"] for c in stage1} >= {"qexit", "fixed"}
    # The report opens with the three embedded models: report.yaml names the other two's sweeps, and the
    # stage-I gate's.
    from exitbench.analysis.compare import compare_dirs

    others = [loading.load([d])[0]["model"]["source"] for d in compare_dirs(REPO / "results" / NAME, None)]
    assert sorted(others) == ["embedded:tiny-looped-gpt2", "embedded:tiny-ouro/stage-1", "embedded:tiny-raven"]
