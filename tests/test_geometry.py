"""Two-scale geometry of loop iterates: the per-step quantities on trajectories with closed-form answers, the
drift-to-loop ratio and PCA paths on hand-made points, trajectories of a tiny looped GPT-2 against layers run by
hand, measure()/geometry_report() against step_quantities on the same iterates, and `exitbench geometry`."""
from __future__ import annotations

import cmath
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from exitbench.cli import app
from exitbench.errors import ExitbenchError
from exitbench.harness.documents import encode_documents, text_documents
from exitbench.studies.geometry import (
    QUANTITIES,
    SCHEMA,
    drift_to_loop,
    geometry_report,
    measure,
    pca_path,
    step_quantities,
    trajectories,
)
from exitbench.models import AttnContext, LoopedGPT2, load_checkpoint, save_checkpoint
from exitbench.training.textcorpus import fit_tokenizer

from helpers.cli import assert_one_line_error
from helpers.models import make_gpt2, make_tiny_raven, make_tiny_tokenizer, random_ids

runner = CliRunner()  # click ≥ 8.2 keeps result.stdout and result.stderr apart
GROUPS = [[1], [2, 3], [4]]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXTS = ["The cat sat on the mat and the dog ran fast.",
         "A loop runs the same block of layers again and again on its own output.",
         "Small red dogs and big slow cats sat on a mat in the sun."]


def geometry_gpt2(seed: int = 0, bos: int | None = None, **overrides) -> LoopedGPT2:
    """make_gpt2 as these tests use it: the model's own initialisation (what training starts from), 2 heads, a
    64-word vocabulary, loop groups [[1], [2, 3], [4]] at depth 1 by default, and `bos` as BOS, EOS and pad id."""
    shape = dict(vocab_size=64, n_head=2, loop_groups=GROUPS, loop_steps=None, max_loop_steps=None,
                 bos_token_id=bos, eos_token_id=bos, pad_token_id=bos)
    return make_gpt2(seed, init="model", **{**shape, **overrides})


def orthonormal_pair(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(d, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q[:, 0], q[:, 1]


def close(actual: torch.Tensor, expected, tol: float = 1e-10) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---- step_quantities on closed forms ------------------------------------------------------------------------

def test_geometric_steps():
    """s_k = s_{k−1} + r^k v: steps shrink (or grow) geometrically along one direction."""
    K, d = 6, 5
    g = torch.Generator().manual_seed(0)
    rs = [0.5, 0.8, 1.3]
    vs = [torch.randn(d, generator=g, dtype=torch.float64) for _ in rs]
    s0s = [torch.randn(d, generator=g, dtype=torch.float64) for _ in rs]
    states = torch.zeros(K + 1, len(rs), d, dtype=torch.float64)
    for j, (r, v, s0) in enumerate(zip(rs, vs, s0s)):
        states[0, j] = s0
        for k in range(1, K + 1):
            states[k, j] = states[k - 1, j] + r ** k * v
    q = step_quantities(states)
    assert set(q) == set(QUANTITIES)
    for name in QUANTITIES:
        assert q[name].shape == (K, len(rs)) and q[name].dtype == torch.float64
    for j, (r, v, s0) in enumerate(zip(rs, vs, s0s)):
        nv = v.norm().item()
        ks = range(1, K + 1)
        close(q["step"][:, j], [r ** k * nv for k in ks])
        s_k = [s0 + v * (r * (1 - r ** k) / (1 - r)) for k in ks]
        close(q["rel_step"][:, j], [r ** k * nv / s.norm().item() for k, s in zip(ks, s_k)])
        expected_accel = [abs(r ** k - r ** (k - 1)) * nv for k in range(2, K + 1)]
        close(q["accel"][1:, j], expected_accel)
        close(q["accel_mag"][1:, j], expected_accel)
        close(q["cosine"][1:, j], [1.0] * (K - 1))
    for name in ("cosine", "accel", "accel_mag"):
        assert torch.isnan(q[name][0]).all(), name
    for name in ("step", "rel_step"):
        assert not torch.isnan(q[name]).any(), name


def spiral(rhos, qs, thetas, K: int, d: int = 6, seed: int = 0):
    """Δ_k = ρ q^k (cos kθ u + sin kθ w) per token, u ⟂ w in R^d; returns states and the closed-form s_k."""
    u, w = orthonormal_pair(d, seed)
    s0 = torch.randn(len(rhos), d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    states = torch.zeros(K + 1, len(rhos), d, dtype=torch.float64)
    states[0] = s0
    closed = []
    for j, (rho, q, th) in enumerate(zip(rhos, qs, thetas)):
        for k in range(1, K + 1):
            amp = rho * q ** k
            states[k, j] = states[k - 1, j] + amp * (math.cos(k * th) * u + math.sin(k * th) * w)
        z = q * cmath.exp(1j * th)
        sums = [rho * z * (1 - z ** k) / (1 - z) for k in range(1, K + 1)]  # Σ_{i≤k} ρ z^i
        closed.append([s0[j] + c.real * u + c.imag * w for c in sums])
    return states, closed


def test_rotation_with_fixed_angle():
    K = 7
    rhos, thetas = [1.0, 0.3, 2.5, 0.7], [0.3, 1.0, 2.5, math.pi / 2]
    states, closed = spiral(rhos, [1.0] * 4, thetas, K)
    q = step_quantities(states)
    for j, (rho, th) in enumerate(zip(rhos, thetas)):
        close(q["step"][:, j], [rho] * K)
        close(q["cosine"][1:, j], [math.cos(th)] * (K - 1))
        close(q["accel"][1:, j], [2 * rho * math.sin(th / 2)] * (K - 1))
        close(q["accel_mag"][1:, j], [0.0] * (K - 1))
        close(q["rel_step"][:, j], [rho / s.norm().item() for s in closed[j]])
    # The signals differ: accel sees the turn, accel_mag (norms only) does not.
    assert (q["accel"][1:] > 0.1).all()


def test_decaying_spiral():
    K = 8
    rhos, qs, thetas = [1.0, 2.0, 0.5], [0.8, 0.5, 0.9], [0.4, 2.0, 1.2]
    states, closed = spiral(rhos, qs, thetas, K, d=9, seed=3)
    q = step_quantities(states)
    for j, (rho, f, th) in enumerate(zip(rhos, qs, thetas)):
        amps = [rho * f ** k for k in range(1, K + 1)]
        close(q["step"][:, j], amps)
        close(q["cosine"][1:, j], [math.cos(th)] * (K - 1))
        close(q["accel"][1:, j], [a * math.sqrt(1 + f ** -2 - 2 * math.cos(th) / f) for a in amps[1:]])
        close(q["accel_mag"][1:, j], [rho * f ** (k - 1) * (1 - f) for k in range(2, K + 1)])
        close(q["rel_step"][:, j], [a / s.norm().item() for a, s in zip(amps, closed[j])])


def test_step_quantities_edge_cases():
    # One step: only step and rel_step are defined.
    states = torch.tensor([[[0.0, 0.0]], [[3.0, 4.0]]])
    q = step_quantities(states)
    close(q["step"], [[5.0]])
    close(q["rel_step"], [[1.0]])
    for name in ("cosine", "accel", "accel_mag"):
        assert q[name].shape == (1, 1) and torch.isnan(q[name]).all()
    # A standing state: zero steps give no cosine (not a division by zero), accelerations are zero.
    still = torch.ones(4, 2, 3)
    q = step_quantities(still)
    assert torch.isnan(q["cosine"]).all()
    close(q["step"], torch.zeros(3, 2))
    close(q["accel"][1:], torch.zeros(2, 2))
    # float32 input is measured in float64.
    assert step_quantities(states.float())["step"].dtype == torch.float64
    for bad in (torch.zeros(1, 2, 3), torch.zeros(4, 3)):
        with pytest.raises(ExitbenchError, match="steps \\+ 1, tokens, dim"):
            step_quantities(bad)


# ---- drift-to-loop ------------------------------------------------------------------------------------------

def test_drift_to_loop_hand_made():
    # (K + 1 = 4 states, 3 tokens, 2 dims). Token 0: steps 5, 1, 0 (mean 2), ends at (3, 5); token 1: steps
    # 1, 1, 2 (mean 4/3), ends at (2, 2); token 2 never moves.
    states = torch.tensor([
        [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]],
        [[3.0, 4.0], [1.0, 0.0], [1.0, 1.0]],
        [[3.0, 5.0], [2.0, 0.0], [1.0, 1.0]],
        [[3.0, 5.0], [2.0, 2.0], [1.0, 1.0]],
    ])
    handoff = torch.tensor([[9.0, 13.0], [2.0, 2.0], [1.0, 1.0]])
    dlr = drift_to_loop(states, handoff)
    assert dlr.dtype == torch.float64
    close(dlr[:2], [10.0 / 2.0, 0.0])
    assert math.isnan(dlr[2].item())  # 0 / 0: no loop scale to compare with
    # The ratio is scale-free, and only the final state matters for the numerator.
    close(drift_to_loop(7 * states[:, :2], 7 * handoff[:2]), [5.0, 0.0])
    handoff1 = torch.tensor([[3.0, 5.0], [2.0, 4.0]])
    close(drift_to_loop(states[:, :2], handoff1), [0.0, 2.0 / (4.0 / 3.0)])


# ---- PCA paths ----------------------------------------------------------------------------------------------

def test_pca_path_planar():
    d = 7
    u, w = orthonormal_pair(d, seed=5)
    centre = torch.randn(d, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    coords_ab = [[(0.0, 0.0), (1.0, 0.5), (2.5, 0.7), (3.0, 2.0)], [(2.0, 3.0), (0.5, 2.5), (-1.0, 1.0)]]
    groups = [torch.stack([centre + a * u + b * w for a, b in g]).float() for g in coords_ab]
    out = pca_path(groups)
    ev = out["explained_variance"]
    assert len(ev) == 2 and ev[0] >= ev[1] > 0
    assert sum(ev) == pytest.approx(1.0, abs=1e-9)
    assert [len(g) for g in out["groups"]] == [4, 3]
    proj = torch.tensor([p for g in out["groups"] for p in g], dtype=torch.float64)
    assert proj.shape == (7, 2)
    points = torch.cat(groups).double()
    torch.testing.assert_close(torch.cdist(proj, proj), torch.cdist(points, points), rtol=0, atol=1e-5)
    torch.testing.assert_close(proj.mean(0), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-6)


def test_pca_path_explained_variance_closed_form():
    """Points ±a e1, ±b e2, ±c e3 are centred with variances ∝ a², b², c² along the axes."""
    a, b, c = 3.0, 2.0, 1.0
    eye = torch.eye(5, dtype=torch.float64)
    pts = torch.stack([s * x * eye[i] for i, x in enumerate((a, b, c)) for s in (1, -1)])
    out = pca_path([pts[:2], pts[2:5], pts[5:]])
    total = a * a + b * b + c * c
    assert out["explained_variance"] == pytest.approx([a * a / total, b * b / total], abs=1e-12)
    assert [len(g) for g in out["groups"]] == [2, 3, 1]
    first = torch.tensor(out["groups"][0], dtype=torch.float64)  # ±a e1 lie on PC1 at ±a
    torch.testing.assert_close(first.abs(), torch.tensor([[a, 0.0], [a, 0.0]], dtype=torch.float64))
    # A straight line is explained by one component.
    line = [torch.arange(6, dtype=torch.float64)[:, None] * torch.ones(1, 4, dtype=torch.float64)]
    assert pca_path(line)["explained_variance"] == pytest.approx([1.0, 0.0], abs=1e-12)


def test_pca_path_single_point_is_two_dimensional():
    out = pca_path([torch.randn(1, 8)])
    assert [len(p) for p in out["groups"][0]] == [2]
    assert not any(math.isnan(v) for v in out["explained_variance"])


# ---- trajectories of a looped GPT-2 against the layers run by hand --------------------------------------

def test_trajectories_match_layers_by_hand():
    model = geometry_gpt2(seed=1)
    h = model.transformer.h
    ids = random_ids(2, 7, vocab=64, seed=3)
    K = 3
    traj = trajectories(model, ids, K)
    assert traj.names == ["loop 1", "loop 2,3", "loop 4"]
    assert len(traj.groups) == len(traj.entries) == 3
    with torch.no_grad():
        x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(7))
        x = h[0](x, AttnContext())
        for g, group in enumerate(GROUPS):
            s, states = x, [x]
            for _ in range(K):
                for i in group:
                    s = h[i](s, AttnContext())
                states.append(s)
            assert traj.groups[g].shape == (K + 1, 14, 32)
            for k in range(K + 1):
                torch.testing.assert_close(traj.groups[g][k], states[k].flatten(0, 1), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(traj.entries[g], x.flatten(0, 1), rtol=1e-6, atol=1e-6)
            x = s
        logits = model.head(h[5](x, AttnContext()))
        torch.testing.assert_close(model(ids, num_steps=K), logits, rtol=1e-5, atol=1e-5)
    # Iterates move: the loop is not a fixed point at init.
    for states in traj.groups:
        assert (states[1:] - states[:-1]).norm(dim=-1).min() > 0
    # Adjacent groups without injection: each group starts where the previous one stopped.
    for g in range(2):
        assert torch.equal(traj.entries[g + 1], traj.groups[g][-1])


def test_measure_rejects_zero_steps():
    model = geometry_gpt2()
    with pytest.raises(ExitbenchError, match="--steps must be ≥ 1"):
        measure(_ck(model), [random_ids(1, 4, vocab=64)], steps=0)


# ---- measure() against step_quantities on the same trajectories -------------------------------------------

class _Ck:
    """The parts of a Checkpoint that measure() reads."""

    def __init__(self, model):
        self.model = model


def _ck(model):
    return _Ck(model)


def _lower_median(values: torch.Tensor) -> float:
    ok = sorted(v for v in values.tolist() if not math.isnan(v))
    return ok[(len(ok) - 1) // 2]


def check_measure_against_direct(model, batches, steps: int, seed: int = 0) -> dict:
    rep = measure(_ck(model), batches, steps, seed=seed)
    n_groups = len(model.loop_groups())
    assert rep["steps"] == steps
    assert rep["tokens"] == sum(b.numel() for b in batches)
    assert [g["name"] for g in rep["groups"]] == [g.name for g in model.loop_groups()]
    assert len(rep["handoffs"]) == n_groups - 1
    gen = torch.Generator().manual_seed(seed)
    trajs = [trajectories(model, b.view(-1, b.shape[-1]), steps, gen) for b in batches]
    for g, group in enumerate(rep["groups"]):
        assert len(group["per_k"]) == steps
        assert [row["k"] for row in group["per_k"]] == list(range(1, steps + 1))
        direct = [step_quantities(t.groups[g]) for t in trajs]
        for q in QUANTITIES:
            values = torch.cat([d[q] for d in direct], dim=1)
            for k, row in enumerate(group["per_k"]):
                if q in ("cosine", "accel", "accel_mag") and k == 0:
                    assert row[q] == {"mean": None, "median": None}
                    continue
                assert row[q]["mean"] == pytest.approx(values[k].mean().item(), rel=1e-9), (g, q, k)
                assert row[q]["median"] == pytest.approx(_lower_median(values[k]), rel=1e-9), (g, q, k)
    for g, handoff in enumerate(rep["handoffs"]):
        assert (handoff["from"], handoff["to"]) == (rep["groups"][g]["name"], rep["groups"][g + 1]["name"])
        first = torch.cat([drift_to_loop(t.groups[g], t.groups[g + 1][1]) for t in trajs])
        assert handoff["first_step"]["mean"] == pytest.approx(first.mean().item(), rel=1e-9)
    return rep


def test_measure_looped_gpt2():
    model = geometry_gpt2(seed=2)
    batches = [random_ids(2, 6, vocab=64, seed=1), random_ids(1, 9, vocab=64, seed=2)]
    rep = check_measure_against_direct(model, batches, steps=4)
    assert len(rep["groups"]) == 3 and len(rep["handoffs"]) == 2
    for handoff in rep["handoffs"]:
        assert handoff["entry"] == {"mean": 0.0, "median": 0.0}
        assert handoff["first_step"]["mean"] > 0
    assert len(rep["pca"]) == 4
    for path in rep["pca"]:
        assert [len(g) for g in path["groups"]] == [5, 5, 5]  # s_0 … s_4 of each group
        assert all(len(p) == 2 for g in path["groups"] for p in g)
        assert 0 < sum(path["explained_variance"]) <= 1 + 1e-9


@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_measure_tiny_raven(init_scale):
    model = make_tiny_raven(init_scale=init_scale)
    batches = [random_ids(2, 5, seed=4), random_ids(1, 7, seed=5)]
    rep = check_measure_against_direct(model, batches, steps=3, seed=7)
    assert rep["handoffs"] == [] and len(rep["groups"]) == 1
    # A random s_0 is noise: the PCA path leaves it out.
    assert [len(g) for g in rep["pca"][0]["groups"]] == [3 if init_scale else 4]
    assert len(rep["pca"]) == 4
    # The same seed gives the same report; with random_init another seed gives other starts.
    assert measure(_ck(model), batches, 3, seed=7)["groups"] == rep["groups"]
    other = measure(_ck(model), batches, 3, seed=8)["groups"]
    assert (other != rep["groups"]) == bool(init_scale)


# ---- the tokens: text files, encoding, the whole report ----------------------------------------------------

def test_text_documents(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("\n\nthe cat sat\non the mat\n\n\n\n  a dog ran  \n\n")
    assert text_documents(f) == ["the cat sat\non the mat", "a dog ran"]
    f.write_text("one line only")
    assert text_documents(f) == ["one line only"]
    f.write_text("\n \n\n")
    with pytest.raises(ExitbenchError, match="holds no text"):
        text_documents(f)
    with pytest.raises(ExitbenchError, match="not a readable file"):
        text_documents(tmp_path / "missing.txt")
    with pytest.raises(ExitbenchError, match="not a readable file"):
        text_documents(tmp_path)


@pytest.fixture
def raven_ck(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


def test_encode_documents(raven_ck):
    docs = ["the cat sat on the mat", "a dog ran", "big red dog"]
    out = encode_documents(raven_ck, docs, max_tokens=100)
    tok = raven_ck.tokenizer
    assert [t.tolist() for t in out] == [[0] + tok.encode(d) for d in docs]
    assert [len(t) for t in out] == [7, 4, 4]
    out = encode_documents(raven_ck, docs, max_tokens=9)  # 7 + the first 2 of the next
    assert [len(t) for t in out] == [7, 2]
    long_doc = " ".join(["the cat"] * 100)  # 200 words, cut at the 128-token context
    assert [len(t) for t in encode_documents(raven_ck, [long_doc], max_tokens=1000)] == [128]
    raven_ck.tokenizer = None
    with pytest.raises(ExitbenchError, match="no tokenizer.json"):
        encode_documents(raven_ck, docs, 10)


def test_geometry_report_on_text(raven_ck, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the cat sat on the mat\n\na dog ran fast\n\nthe big red dog sat")
    rep = geometry_report([raven_ck], text=str(f), steps=3, max_tokens=12)
    assert rep["schema"] == SCHEMA and rep["schema_version"] == 1
    assert rep["source"] == {"text": str(f)}
    assert rep["steps"] == 3
    [entry] = rep["checkpoints"]
    assert entry["path"] == str(raven_ck.path) and entry["architecture"] == "huginn_raven"
    assert entry["tokens"] == 12
    batches = encode_documents(raven_ck, text_documents(f), 12)
    assert [len(b) for b in batches] == [7, 5]
    direct = measure(raven_ck, batches, 3, seed=0)
    assert entry["groups"] == direct["groups"] and entry["handoffs"] == direct["handoffs"] == []
    # Without --steps: the deepest the checkpoint is meant to run (tiny Raven: max_recurrence 8).
    assert geometry_report([raven_ck], text=str(f), max_tokens=4)["steps"] == 8
    # Progress counts every batch of every checkpoint, in order, up to the total.
    calls = []
    geometry_report([raven_ck, raven_ck], text=str(f), steps=2, max_tokens=12,
                    on_progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_geometry_report_bad_input(raven_ck, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("the cat")
    cases = [(dict(text=str(f), steps=0), "--steps must be ≥ 1"),
             (dict(text=str(f), max_tokens=0), "--tokens must be ≥ 1"),
             (dict(text=str(f), task="gsm8k"), "not both"),
             (dict(), "not trained on a synthetic task")]
    for kwargs, words in cases:
        with pytest.raises(ExitbenchError, match=words):
            geometry_report([raven_ck], **kwargs)
    with pytest.raises(ExitbenchError, match="at least one checkpoint"):
        geometry_report([], text=str(f))


# ---- `exitbench geometry` ------------------------------------------------------------------------------------

def training_extra(step: int) -> dict:
    return {"exitbench": {"training": {"steps_done": step}}}


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    """Saved checkpoints (looped GPT-2 with a fitted BPE, a tiny Raven) and a text file, shared read-only."""
    root = tmp_path_factory.mktemp("geometry")
    tok = fit_tokenizer(TEXTS * 2, 300)
    vocab = tok.vocab_size

    def gpt2(path, seed=0, **kw):
        return save_checkpoint(geometry_gpt2(seed=seed, vocab_size=vocab, bos=tok.bos_token_id, **kw), root / path, tok)

    paths = {"a": gpt2("a", seed=0), "b": gpt2("b", seed=1),
             "wide": gpt2("wide", n_embd=48), "regrouped": gpt2("regrouped", loop_groups=[[1], [2], [3, 4]])}
    run = root / "run"
    save_checkpoint(geometry_gpt2(seed=3, vocab_size=vocab, bos=tok.bos_token_id), run, tok,
                    extra_config=training_extra(3))
    for step in (1, 2):
        save_checkpoint(geometry_gpt2(seed=10 + step, vocab_size=vocab, bos=tok.bos_token_id),
                        run / "training" / f"step-{step:06d}", tok, extra_config=training_extra(step))
    paths["run"] = run
    no_groups = gpt2("no-groups")
    config = json.loads((no_groups / "config.json").read_text())
    config["loop_groups"] = []
    (no_groups / "config.json").write_text(json.dumps(config))
    paths["no-groups"] = no_groups
    paths["raven"] = save_checkpoint(make_tiny_raven(), root / "raven", make_tiny_tokenizer())
    text = root / "text.txt"
    text.write_text("\n\n".join(TEXTS))
    paths["text"] = text
    return paths


def geometry(*args: str):
    return runner.invoke(app, ["geometry", *map(str, args)])


def strict_json(path: Path) -> dict:
    def no_constant(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=no_constant)


def check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200, (path, img.shape)
    assert float(img[..., :3].std()) > 0.01, path  # something was drawn


def test_cli_geometry_one_checkpoint(cli_setup, tmp_path):
    out = tmp_path / "out"
    # --steps 1, below the default (the checkpoint's maximum, 2): the depth measured is the one asked for
    res = geometry("--checkpoint", cli_setup["a"], "--text", cli_setup["text"], "--steps", 1, "--out", out)
    assert res.exit_code == 0, (res.output, res.exception)
    assert "loop 2,3" in res.stdout and "drift-to-loop" in res.stdout
    assert res.stderr.startswith("wrote ") and "geometry.json" in res.stderr
    rep = strict_json(out / "geometry.json")
    assert rep["schema"] == "exitbench.geometry" and rep["steps"] == 1
    [entry] = rep["checkpoints"]
    assert entry["architecture"] == "looped_gpt2" and entry["path"] == str(cli_setup["a"])
    assert [g["name"] for g in entry["groups"]] == ["loop 1", "loop 2,3", "loop 4"]
    assert all(len(g["per_k"]) == 1 for g in entry["groups"])
    assert len(entry["handoffs"]) == 2
    assert all(h["entry"]["mean"] == 0.0 and h["first_step"]["mean"] > 0 for h in entry["handoffs"])
    assert entry["tokens"] > 30
    for name in ("steps.png", "handoffs.png", "pca.png"):
        check_png(out / name)


@pytest.mark.slow  # 4 s; the command on one checkpoint (above) and a report over two checkpoints
# (test_geometry_report_on_text) stay fast
def test_cli_geometry_checkpoint_list(cli_setup, tmp_path):
    out = tmp_path / "out"
    res = geometry("--checkpoints", f"{cli_setup['a']},{cli_setup['b']}", "--text", cli_setup["text"],
                   "--steps", 2, "--out", out)
    assert res.exit_code == 0, (res.output, res.exception)
    rep = strict_json(out / "geometry.json")
    assert [e["path"] for e in rep["checkpoints"]] == [str(cli_setup["a"]), str(cli_setup["b"])]
    a, b = rep["checkpoints"]
    assert a["tokens"] == b["tokens"] and a["groups"] != b["groups"]  # the same tokens, other weights
    for name in ("steps.png", "handoffs.png", "pca.png"):
        check_png(out / name)


@pytest.mark.slow  # 4 s; the command on one checkpoint (above) and the :training expansion itself
# (test_training_expansion_skips_a_final_model_that_is_the_last_step) stay fast
def test_cli_geometry_training_expansion(cli_setup, tmp_path):
    out = tmp_path / "out"
    run = cli_setup["run"]
    res = geometry("--checkpoints", f"{run}:training", "--text", cli_setup["text"], "--steps", 2, "--out", out)
    assert res.exit_code == 0, (res.output, res.exception)
    rep = strict_json(out / "geometry.json")
    assert [e["path"] for e in rep["checkpoints"]] == [str(run / "training" / "step-000001"),
                                                       str(run / "training" / "step-000002"), str(run)]
    assert [e["training_step"] for e in rep["checkpoints"]] == [1, 2, 3]
    check_png(out / "handoffs.png")


def test_training_expansion_skips_a_final_model_that_is_the_last_step(tmp_path):
    """`exitbench train` saves its final model both in OUT and as the last step-N: list it once."""
    from exitbench.models.embedded import expand_checkpoints

    run = tmp_path / "run"
    for step, where in [(1, run / "training" / "step-000001"), (2, run / "training" / "step-000002"), (2, run)]:
        where.mkdir(parents=True, exist_ok=True)
        (where / "config.json").write_text(json.dumps({"exitbench": {"training": {"steps_done": step}}}))
    assert expand_checkpoints(f"{run}:training") == [str(run / "training" / "step-000001"),
                                                     str(run / "training" / "step-000002")]
    assert expand_checkpoints(f"{run}:training,{run}") == [str(run / "training" / "step-000001"),
                                                           str(run / "training" / "step-000002"), str(run)]
    # The embedded tiny-raven ships two of its training steps beside the final model.
    names = expand_checkpoints("tiny-raven:training")
    assert [Path(n).name for n in names] == ["step-000250", "step-001000", "tiny-raven"]


BAD_CLI = {
    # name: (arguments given the setup, words the error line must contain)
    "zero-steps": (lambda s: ["-c", s["a"], "--text", s["text"], "--steps", 0], ["--steps", "≥ 1"]),
    "different-width": (lambda s: ["--checkpoints", f"{s['a']},{s['wide']}", "--text", s["text"]],
                        ["--checkpoints", "width 48", "width 32"]),
    "different-groups": (lambda s: ["--checkpoints", f"{s['a']},{s['regrouped']}", "--text", s["text"]],
                         ["--checkpoints", "loop 3,4"]),
    "no-loop-groups": (lambda s: ["-c", s["no-groups"], "--text", s["text"]], ["loop_groups"]),
    "missing-text": (lambda s: ["-c", s["a"], "--text", Path(s["text"]).with_name("nope.txt")],
                     ["--text", "nope.txt", "not a readable file"]),
    "task-and-text": (lambda s: ["-c", s["a"], "--task", "gsm8k", "--text", s["text"]], ["--task", "--text"]),
    "no-tokens-source": (lambda s: ["-c", s["raven"]], ["not trained on a synthetic task", "--text"]),
    "no-training-dir": (lambda s: ["--checkpoints", f"{s['a']}:training", "--text", s["text"]],
                        ["training checkpoints"]),
    "checkpoint-and-checkpoints": (lambda s: ["-c", s["a"], "--checkpoints", s["b"], "--text", s["text"]],
                                   ["--checkpoint or --checkpoints"]),
}


@pytest.mark.parametrize("case", list(BAD_CLI))
def test_cli_geometry_bad_input(cli_setup, tmp_path, case):
    args, words = BAD_CLI[case]
    out = tmp_path / "out"
    res = geometry(*args(cli_setup), "--out", out)
    assert_one_line_error(res, words)
    assert not out.exists()
