"""Fitting the learned exit rule (exitbench.policies.learned) to one checkpoint.

1. Documents that no evaluation reads: a task's training (else validation) split, a text file, or a
   chains-trained checkpoint's held-out programs; any document that begins with an evaluation document of the
   named tasks is dropped (and counted).
2. One recording pass (exitbench.replay's Recorder, teacher-forced, all loop groups to their depth): every
   position's trajectory features at every iteration, and the argmax of the readout there.
3. Labels by the oracle's own criterion on the argmax: iteration k of a token is "settled" when its
   prediction at k, and at every later iteration, equals the prediction at full depth.
4. Logistic regression on standardised features (L-BFGS, a small L2 penalty), or one hidden tanh layer
   (`--kind mlp`), fitted on 80% of the documents; the other 20% give the metrics: log loss and AUC per
   (token, iteration), and per threshold the mean exit iteration and the share of tokens whose exit
   prediction differs from full depth, beside the oracle's. Which features carry the decision: how much the
   held-out log loss grows when a feature's column is shuffled.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExitbenchError
from ..policies import ExitPolicy
from ..policies.learned import FEATURES, SCHEMA, SCHEMA_VERSION, ExitModel, features, load_exit_model, start_memory
from ..runtime.files import atomic_write
from ..runtime.provenance import run_metadata
from ..store import cells

LABEL = ("settled: the readout's argmax at iteration k and at every later iteration equals the argmax at the "
         "loop group's full depth (the oracle's criterion, by the argmax)")
L2 = 1e-3  # per row of standardised features: enough to keep weights finite when two features coincide
VALIDATION_FRACTION = 0.2
MLP_HIDDEN, MLP_EPOCHS = 32, 300


class _FeatureProbe(ExitPolicy):
    """Not a policy: lets the Recorder record the learned rule's whole feature vector as a 'signal'."""

    name = "learned-features"
    source = "fit-exit"
    default_threshold = 1.0

    @property
    def variant(self) -> str:
        return self.name

    def start(self, s0: torch.Tensor, vocab: int):
        return start_memory(s0)

    def signal(self, s, memory, logp):
        return features(s, memory)


# ---- 1. documents ---------------------------------------------------------------------------------------------
def overlapping(docs: Sequence[list[int]], evaluation: Sequence[list[int]]) -> list[bool]:
    """Which documents begin with an evaluation document's tokens (equal ones included)."""
    evals = {tuple(e) for e in evaluation if len(e) > 1}
    lengths = sorted({len(e) for e in evals})
    return [any(tuple(d[:n]) in evals for n in lengths if n <= len(d)) for d in docs]


def drop_evaluation_overlap(docs: list[list[int]], evaluation: dict[str, list[list[int]]]
                            ) -> tuple[list[list[int]], dict[str, Any]]:
    """The documents that share no beginning with any evaluation document, and what was checked."""
    dropped = {}
    keep = [True] * len(docs)
    for name, evals in evaluation.items():
        hits = overlapping(docs, evals)
        dropped[name] = sum(hits)
        keep = [k and not h for k, h in zip(keep, hits)]
    return [d for d, k in zip(docs, keep) if k], {"checked_against": sorted(evaluation), "dropped": dropped}


def evaluation_tokens(ck, tasks: Sequence[str], data_dir: str | None) -> dict[str, list[list[int]]]:
    """Per task, its evaluation documents as this checkpoint's tokens (context alone where it has one: a
    fitting document that starts with an evaluation prompt has seen that question)."""
    from ..harness.documents import task_documents

    out = {}
    for task in tasks:
        docs = task_documents(task, data_dir, contexts=True)
        out[task] = [ck.tokenizer.encode(d, add_bos=True) for d in docs]
    return out


# ---- 2 and 3. the recording and the labels --------------------------------------------------------------------
@dataclass
class Rows:
    """One row per (token, iteration) of every loop group: features, label, and which document it came from."""

    x: np.ndarray         # (rows, F)
    y: np.ndarray         # (rows,) 1 = settled
    doc: np.ndarray       # (rows,)
    token: np.ndarray     # (rows,) token index, unique over the whole data
    k: np.ndarray         # (rows,) iteration, 1-based
    changed: np.ndarray   # (rows,) the argmax at k differs from full depth
    oracle: np.ndarray    # (rows,) the token's oracle exit


def fit_depths(model, knobs: dict[str, Any]) -> list[int]:
    """Each loop group's depth for the fit, whose labels are taken against it (`max_steps`, default each group's
    own), from the exit knobs the command was given; knobs that change how tokens run are refused, since the
    recording runs them the default way (the rule's threshold, patience and steps apply where it is used)."""
    from ..engine import ExitConfig

    changed = ExitConfig(**{k: v for k, v in knobs.items() if k in ExitConfig.names(role="engine")}).changed("engine")
    if changed:
        raise ExitbenchError(f"fit-exit records every token the default way (prompt at full depth, its own initial "
                             f"state, every KV slot, physical exits), so it cannot fit under {changed[0]}="
                             f"{knobs[changed[0]]!r}; drop it")
    depths = []
    for g in model.loop_groups():
        depth = knobs.get("max_steps") or g.default_steps
        if depth > g.max_steps:
            raise ExitbenchError(f"--max-steps {depth} exceeds the {g.name} group's maximum of {g.max_steps} "
                                 f"iterations; give at most {g.max_steps}")
        depths.append(depth)
    return depths


def record_rows(model, docs: Sequence[list[int]], seed: int, batch_size: int,
                on_batch: Callable[[], None] | None = None, steps: Sequence[int] | None = None) -> Rows:
    """Every predicted position of `docs`, teacher-forced, at every iteration of every loop group to its depth
    (`steps`, default each group's own; a group's trajectory with the others at full depth, as the replay
    recorder takes it); tokens with a non-finite state or readout are left out."""
    from ..engine.recorder import Recorder, Sequence_

    groups = model.loop_groups()
    steps = list(steps or [g.default_steps for g in groups])
    probe = _FeatureProbe()
    recorder = Recorder(model, max(steps), [probe], [], seed, steps, oracle=True)
    parts: dict[str, list[np.ndarray]] = {n: [] for n in ("x", "y", "doc", "token", "k", "changed", "oracle")}
    tokens = 0
    for start in range(0, len(docs), batch_size):
        chunk = docs[start:start + batch_size]
        trajs = recorder.record([Sequence_(list(d[:-1]), 0, [list(d[1:])]) for d in chunk])
        for i, t in enumerate(trajs):
            for g, K in enumerate(steps):
                x = t.signals[g][probe.variant][:, :K]           # (n, K, F)
                top = t.top[g][:, :K]                             # (n, K)
                n = top.shape[0]
                agrees = top == top[:, -1:]
                settled = np.flip(np.cumprod(np.flip(agrees, 1), 1), 1).astype(bool)
                oracle = K - settled.sum(1) + 1
                ok = np.isfinite(x).all((1, 2)) & t.finite.all(1)
                ks = np.broadcast_to(np.arange(1, K + 1), (n, K))
                for name, value in (("x", x), ("y", settled), ("changed", ~agrees), ("k", ks),
                                    ("oracle", np.broadcast_to(oracle[:, None], (n, K))),
                                    ("token", np.broadcast_to(tokens + np.arange(n)[:, None], (n, K))),
                                    ("doc", np.full((n, K), start + i))):
                    parts[name].append(value[ok].reshape(-1, *value.shape[2:]))
                tokens += n
        if on_batch is not None:
            on_batch()
    cat = {name: np.concatenate(v) for name, v in parts.items()}
    return Rows(x=cat["x"], y=cat["y"].astype(np.float64), doc=cat["doc"], token=cat["token"], k=cat["k"],
                changed=cat["changed"], oracle=cat["oracle"])


# ---- 4. the fit -----------------------------------------------------------------------------------------------
def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    mean, scale = x.mean(0), x.std(0)
    scale = np.where(scale > 1e-12, scale, 1.0)
    return mean, scale, torch.from_numpy((x - mean) / scale)


def fit_logistic(x: np.ndarray, y: np.ndarray, names: Sequence[str], l2: float = L2) -> dict[str, Any]:
    """A logistic regression of y on standardised x, by L-BFGS in float64: the exit-model parameters."""
    mean, scale, xs = _standardise(x)
    yt = torch.from_numpy(y)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = F.binary_cross_entropy_with_logits(xs @ w[:-1] + w[-1], yt) + l2 * (w[:-1] ** 2).sum()
        value.backward()
        return value

    opt.step(loss)
    w = w.detach().numpy()
    return {"kind": "logistic", "features": list(names), "mean": mean.tolist(), "scale": scale.tolist(),
            "weights": w[:-1].tolist(), "bias": float(w[-1]), "l2": l2}


def fit_mlp(x: np.ndarray, y: np.ndarray, names: Sequence[str], hidden: int = MLP_HIDDEN, seed: int = 0,
            epochs: int = MLP_EPOCHS) -> dict[str, Any]:
    """One hidden tanh layer, full-batch Adam on the log loss (the data is small: every row every step)."""
    mean, scale, xs = _standardise(x)
    xs, yt = xs.float(), torch.from_numpy(y).float()
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(hidden, x.shape[1], generator=gen) / x.shape[1] ** 0.5).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = (torch.randn(hidden, generator=gen) / hidden ** 0.5).requires_grad_()
    b2 = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=1e-2)
    for _ in range(epochs):
        opt.zero_grad()
        z = torch.tanh(xs @ w1.T + b1) @ w2 + b2
        F.binary_cross_entropy_with_logits(z, yt).backward()
        opt.step()
    as_list = lambda t: t.detach().double().tolist()  # noqa: E731
    return {"kind": "mlp", "features": list(names), "mean": mean.tolist(), "scale": scale.tolist(),
            "hidden_weights": as_list(w1), "hidden_bias": as_list(b1), "weights": as_list(w2),
            "bias": float(b2.detach()), "epochs": epochs}


def risk_of(params: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """The fitted model's risk for feature rows x (every column of FEATURES), by the policy's own code."""
    return ExitModel(params, "", "").risk(torch.from_numpy(x)).numpy()


def log_loss(y: np.ndarray, risk: np.ndarray) -> float:
    p = np.clip(1.0 - risk, 1e-12, 1 - 1e-12)
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def auc(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve of `score` for y = 1 (Mann–Whitney, ties counted half)."""
    _, tie, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[tie]  # 1-based ranks, averaged over each tie
    pos = y == 1
    n1, n0 = pos.sum(), (~pos).sum()
    if n1 == 0 or n0 == 0:
        return float("nan")
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def exits_by_threshold(rows: Rows, risk: np.ndarray, thresholds: Sequence[float]) -> list[dict[str, Any]]:
    """Per threshold, with patience 1: mean exit iteration, and the share of tokens whose prediction at the
    exit differs from full depth (the calibration loss, pooled over tokens)."""
    order = np.lexsort((rows.k, rows.token))
    token, k, changed, r = rows.token[order], rows.k[order], rows.changed[order], risk[order]
    starts = np.flatnonzero(np.r_[True, token[1:] != token[:-1]])
    ends = np.r_[starts[1:], len(token)]
    row = np.arange(len(token))
    last = np.repeat(ends - 1, ends - starts)  # each row's token's last iteration: the exit when none hits
    out = []
    for tau in thresholds:
        exit_idx = np.minimum.reduceat(np.where(r < tau, row, last), starts)
        out.append({"threshold": tau, "mean_iterations": float(k[exit_idx].mean()),
                    "disagreement": float(changed[exit_idx].mean())})
    return out


def permutation_importance(params: dict[str, Any], valid: Rows, base_loss: float, seed: int) -> dict[str, float]:
    """Held-out log loss gained when one feature's column is shuffled across rows: what the model draws from it
    (features that duplicate each other share the credit, so a small value means "replaceable", not "useless")."""
    rng = np.random.default_rng(seed)
    out = {}
    for j, name in enumerate(FEATURES):
        x = valid.x.copy()
        x[:, j] = x[rng.permutation(len(x)), j]
        out[name] = log_loss(valid.y, risk_of(params, x)) - base_loss
    return out


def split_documents(n_docs: int, seed: int) -> tuple[set[int], set[int]]:
    order = list(range(n_docs))
    random.Random(f"fit-exit-{seed}").shuffle(order)
    n_valid = max(1, int(round(VALIDATION_FRACTION * n_docs)))
    return set(order[n_valid:]), set(order[:n_valid])


def subset(rows: Rows, docs: set[int]) -> Rows:
    mask = np.isin(rows.doc, list(docs))
    return Rows(**{name: getattr(rows, name)[mask] for name in Rows.__dataclass_fields__})


def fit(model, docs: Sequence[list[int]], *, kind: str = "logistic", seed: int = 0, batch_size: int = 16,
        thresholds: Sequence[float] = (), on_batch: Callable[[], None] | None = None,
        steps: Sequence[int] | None = None) -> dict[str, Any]:
    """Record, label, fit and measure: the exit-model file's content, less where the documents came from."""
    if kind not in FITTERS:
        raise ExitbenchError(f"--kind must be one of {', '.join(FITTERS)}, got {kind!r}")
    if len(docs) < 2:
        raise ExitbenchError(f"fit-exit needs at least 2 documents (one to fit on, one to check), got {len(docs)}")
    steps = list(steps or [g.default_steps for g in model.loop_groups()])
    rows = record_rows(model, docs, seed, batch_size, on_batch, steps)
    train_docs, valid_docs = split_documents(len(docs), seed)
    train, valid = subset(rows, train_docs), subset(rows, valid_docs)
    if len(np.unique(train.y)) < 2:
        raise ExitbenchError("fit-exit: every fitting token is settled at every iteration (or none is), so there "
                             "is nothing to learn; use more documents or a deeper --max-steps")
    params = FITTERS[kind](train.x, train.y, FEATURES)
    risk = risk_of(params, valid.x)
    loss = log_loss(valid.y, risk)
    oracle = valid.oracle[np.r_[True, valid.token[1:] != valid.token[:-1]]]
    return {
        **params, "label": LABEL,
        "data": {"documents": len(docs), "tokens": int(len(np.unique(rows.token))), "rows": int(len(rows.y)),
                 "settled_share": float(rows.y.mean()), "fit_documents": len(train_docs),
                 "validation_documents": len(valid_docs),
                 "max_steps": steps},
        "metrics": {
            "validation": {"log_loss": loss, "auc": auc(valid.y, 1.0 - risk),
                           "accuracy": float(((risk < 0.5) == (valid.y == 1)).mean()),
                           "oracle_mean_iterations": float(oracle.mean()),
                           "by_threshold": exits_by_threshold(valid, risk, thresholds)},
            "fit": {"log_loss": log_loss(train.y, risk_of(params, train.x))},
            "permutation_log_loss_increase": permutation_importance(params, valid, loss, seed),
        },
    }


FITTERS = {"logistic": fit_logistic, "mlp": fit_mlp}


def check_fit_options(limit: int, batch_size: int, seed: int) -> None:
    """fit-exit's counts, refused before a checkpoint loads."""
    from ..runtime.validation import at_least

    if limit < 2:
        raise ExitbenchError(f"--limit must be ≥ 2 (one document to fit on, one to check), got {limit}")
    at_least("--batch-size", batch_size)
    if seed < 0:
        # numpy's generators take no negative seed; refused here rather than after the recording pass
        raise ExitbenchError(f"--seed must be a whole number ≥ 0, got {seed}")


def fitting_documents(ck, task: str | None, text: str | None, data_dir: str | None, max_tokens: int, limit: int,
                      seed: int, disjoint_from: str | None) -> tuple[list[list[int]], dict[str, Any], dict[str, Any]]:
    """The documents to fit on (a task's fitting split, a text file, or held-out programs), less those that
    begin with an evaluation document of the tasks in `disjoint_from` (default: the task itself, or chains for
    held-out programs); with where they came from and what was dropped."""
    from ..harness.documents import synthetic_training, token_lists

    if disjoint_from is None:
        checked = [task] if task else (["chains"] if not text and synthetic_training(ck) else [])
    else:
        checked = [t.strip() for t in disjoint_from.split(",") if t.strip()]
    docs, source = token_lists(ck, task=task, text=text, data_dir=data_dir, max_tokens=max_tokens,
                               programs=limit, seed=f"fit-exit-{seed}", purpose="fit on", split="fitting")
    docs, disjoint = drop_evaluation_overlap(docs[:limit], evaluation_tokens(ck, checked, data_dir))
    return docs, source, disjoint


def fit_learned(model, docs: Sequence[list[int]], *, kind: str, seed: int, batch_size: int,
                on_progress: Callable[[int, int], None] | None = None, steps: Sequence[int] | None = None
                ) -> dict[str, Any]:
    """`fit` at the learned rule's own threshold grid, saying (batches recorded, batches) as it records."""
    from ..policies import REGISTRY

    batches = -(-len(docs) // batch_size)
    done = iter(range(1, batches + 1))
    return fit(model, docs, kind=kind, seed=seed, batch_size=batch_size, thresholds=REGISTRY["learned"].default_grid,
               on_batch=(lambda: on_progress(next(done), batches)) if on_progress else None, steps=steps)


def documents_digest(docs: Sequence[list[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, d)) for d in docs]).encode()).hexdigest()


def write_exit_model(content: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Strict JSON, as cells are: an undefined metric (AUC with one class only) is written as null.
    raw = cells.strict({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **content})
    atomic_write(path, lambda fh: json.dump(raw, fh, indent=2, allow_nan=False))
    load_exit_model(path)  # what was written must read back as a valid exit model
    return path


def provenance(ck, source: dict[str, Any], docs: Sequence[list[int]], disjoint: dict[str, Any], seed: int
               ) -> dict[str, Any]:
    from ..models.embedded import recorded_path
    from ..store.identity import checkpoint_identity

    return {"checkpoint": {"path": recorded_path(ck.path), "fingerprint": checkpoint_identity(ck.path).short},
            "source": {**source, "sha256": documents_digest(docs), "disjoint_from_evaluation": disjoint},
            "run": run_metadata(seed=seed)}
