"""A learned decoding-free exit: a small model (logistic regression, or a one-layer MLP) on features of the
latent trajectory.

`exitbench fit-exit` (exitbench.studies.fit_exit) fits the model on a recording of held-out documents; this module
is the rule that runs it. Its signal is the predicted risk that the token's prediction is not yet final
(1 − P(settled)), and a token exits once the risk falls below τ. The features are the ones the hand-made
rules each read alone, on log scales (step norms span decades over a trajectory), plus the iteration and the
same quantities one step back:

    log_k            log k: the depth prior (most tokens settle within a few iterations, few settle late)
    log_step         log ‖Δ_k‖                         (first_order)
    log_rel_step     log ‖Δ_k‖ / ‖s_k‖                 (first_order, relative)
    log_second       log ‖Δ_k − Δ_{k−1}‖               (second_order)
    log_magnitude    log |‖Δ_k‖ − ‖Δ_{k−1}‖|           (second_order_magnitude)
    cos              cos(Δ_k, Δ_{k−1})                 (is the step still turning?)
    log_contraction  log ‖Δ_k‖ / max_j≤k ‖Δ_j‖         (how far the step has shrunk from its largest)
    prev_*           the six above at k − 1            (a trend, which patience approximates for the others)

Norms and dot products come from one Gram matrix of (s_k, Δ_k, Δ_{k−1}) in float64 (the steps themselves are
differences in the state's dtype, as the other latent rules take them). Δ_0 is taken as 0 (so at k = 1 the second-order terms equal the step and
cos is 0) and the lagged features at k = 1 are 0; `log_k` tells the model that it is looking at the first
iteration. One batched product reads the (n, d) states, the rest is arithmetic on (n,) numbers
(bench/RESULTS.md measures the probe at n_embd 1024).
"""
from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ..errors import ExitbenchError
from ..runtime.validation import parse
from .base import ExitPolicy, Memory, register

SCHEMA, SCHEMA_VERSION = "exitbench.exit_model", 1
CURRENT = ("log_step", "log_rel_step", "log_second", "log_magnitude", "log_contraction", "cos")
FEATURES = ("log_k",) + CURRENT + tuple(f"prev_{name}" for name in CURRENT)
# Norms below this are zero for the logs: float32 states round at ~1e-7 of ‖s‖, far above it, so only an
# exactly repeated state reaches the floor.
FLOOR = 1e-12


def _gram_map() -> torch.Tensor:
    """(9, 5): the Gram matrix of (s_k, Δ_k, Δ_{k−1}), flattened, to ‖s_k‖², ‖Δ_k‖², ‖Δ_{k−1}‖²,
    ‖Δ_k − Δ_{k−1}‖² and Δ_k · Δ_{k−1}: every norm and dot product the features need is a linear function of
    its entries, so one batched matrix product gives them all."""
    columns = [{(0, 0): 1}, {(1, 1): 1}, {(2, 2): 1}, {(1, 1): 1, (1, 2): -2, (2, 2): 1}, {(1, 2): 1}]
    out = torch.zeros(9, len(columns), dtype=torch.float64)
    for c, terms in enumerate(columns):
        for (i, j), weight in terms.items():  # split evenly between (i, j) and (j, i) of the symmetric Gram
            out[3 * i + j, c] += weight / 2
            out[3 * j + i, c] += weight / 2
    return out


GRAM = _gram_map()
# Logs of (k, step, size, second, |step − step_prev|, largest step) → log_k and CURRENT's five logs, in order.
LOGS = torch.tensor([[1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 1], [0, 0, -1, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                     [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, -1]], dtype=torch.float64)


def features(s: torch.Tensor, memory: Memory) -> torch.Tensor:
    """Every feature of FEATURES for tokens at new states s (n, d), float64 (n, F); updates `memory`.

    About 25 small tensor ops whatever d is (one batched Gram product reads the states): on a lone token each
    op is mostly dispatch, so their count is what the probe costs, and it is kept low on purpose."""
    n = s.shape[0]
    delta = s - memory["prev"]
    x = torch.stack([s, delta, memory["delta"]], 1).double()
    gram, logs_map = _maps(s.device)
    q = torch.bmm(x, x.transpose(1, 2)).view(n, 9) @ gram
    size, step, step_prev, second, _ = q.clamp_min(0).sqrt().unbind(1)
    k = memory["k"] + 1
    largest = torch.maximum(memory["largest"], step)
    # 0 where a step is 0 (Δ_0 at k = 1): its Gram entries, and so the dot product, are exactly 0.
    cos = (q[:, 4] / (step * step_prev).clamp_min(torch.finfo(torch.float64).tiny)).clamp(-1.0, 1.0)
    logs = torch.stack([k, step, size, second, (step - step_prev).abs(), largest], 1).clamp_min(FLOOR).log()
    # A non-finite state gives NaN features and so a NaN risk, which never passes a threshold (as elsewhere).
    f = torch.cat([logs @ logs_map, cos.unsqueeze(1), memory["lag"]], 1)
    memory.update(prev=s, delta=delta, largest=largest, k=k, lag=f[:, 1:1 + len(CURRENT)])
    return f


@lru_cache(maxsize=None)
def _maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """GRAM and LOGS on `device`, copied there once rather than at every iteration."""
    return GRAM.to(device), LOGS.to(device)


def start_memory(s0: torch.Tensor) -> Memory:
    """Δ_0 = 0; the lagged features start at 0."""
    n = s0.shape[0]
    zeros = torch.zeros(n, dtype=torch.float64, device=s0.device)
    return {"prev": s0, "delta": torch.zeros_like(s0), "largest": zeros, "k": zeros,
            "lag": torch.zeros(n, len(CURRENT), dtype=torch.float64, device=s0.device)}


# ---- the exit-model file -------------------------------------------------------------------------------------
class ExitModel:
    """A fitted exit model: z(f) is the log-odds that a token with features f has settled.

    kind "logistic": z = w · (f − mean) / scale + bias. kind "mlp": one hidden tanh layer,
    z = w · tanh(W (f − mean) / scale + b) + bias. The standardisation is folded into the first layer's weights,
    so a probe costs one (n, F) matrix product (two for the MLP)."""

    def __init__(self, raw: dict[str, Any], path: str, digest: str):
        self.raw, self.path, self.digest, self.kind = raw, path, digest, raw["kind"]
        index = {f: i for i, f in enumerate(raw["features"])}
        mean = torch.tensor(raw["mean"], dtype=torch.float64)
        scale = torch.tensor(raw["scale"], dtype=torch.float64)
        # Columns of FEATURES the file does not use get zero weight: the probe computes the full set anyway.
        first = torch.tensor(raw["hidden_weights"] if self.kind == "mlp" else [raw["weights"]], dtype=torch.float64)
        first_bias = torch.tensor(raw["hidden_bias"] if self.kind == "mlp" else [raw["bias"]], dtype=torch.float64)
        folded = first / scale
        # Signs folded in too: the risk is sigmoid(−z), so the last layer is stored negated.
        last = 1.0 if self.kind == "mlp" else -1.0
        self.first = torch.zeros(len(FEATURES), first.shape[0], dtype=torch.float64)
        for name, i in index.items():
            self.first[FEATURES.index(name)] = last * folded[:, i]
        self.first_bias = last * (first_bias - folded @ mean)
        if self.kind == "mlp":
            self.out = -torch.tensor(raw["weights"], dtype=torch.float64)
            self.out_bias = -torch.tensor(float(raw["bias"]), dtype=torch.float64)
        self.checkpoint = raw.get("checkpoint", {})

    def risk(self, f: torch.Tensor) -> torch.Tensor:
        """1 − P(settled) for feature rows f (n, F)."""
        if self.first.device != f.device:
            self.first, self.first_bias = self.first.to(f.device), self.first_bias.to(f.device)
            if self.kind == "mlp":
                self.out, self.out_bias = self.out.to(f.device), self.out_bias.to(f.device)
        z = torch.addmm(self.first_bias, f, self.first)
        if self.kind == "mlp":
            return torch.sigmoid(torch.addmv(self.out_bias, torch.tanh(z), self.out))
        return torch.sigmoid(z.squeeze(1))


def load_exit_model(path: str | Path) -> ExitModel:
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ExitbenchError(f"--exit-model {path}: cannot read it ({exc.strerror or exc}); "
                             "write one with `exitbench fit-exit`") from None
    return _parse(str(path), data)


@lru_cache(maxsize=16)
def _parse(path: str, data: bytes) -> ExitModel:
    digest = hashlib.sha256(data).hexdigest()
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExitbenchError(f"--exit-model {path} is not JSON ({exc}); write one with `exitbench fit-exit`") \
            from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise ExitbenchError(f"--exit-model {path} is not an exit model (schema {SCHEMA!r}); "
                             "write one with `exitbench fit-exit`")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ExitbenchError(f"--exit-model {path} has schema version {raw.get('schema_version')!r}; this "
                             f"exitbench reads version {SCHEMA_VERSION}: refit it with `exitbench fit-exit`")
    parse(ExitModelFile, raw, f"--exit-model {path}")  # types first: the checks below rely on them
    names = raw.get("features")
    unknown = [f for f in names or [] if f not in FEATURES]
    if not names or unknown:
        raise ExitbenchError(f"--exit-model {path}: unknown feature {unknown[0] if unknown else None!r}; "
                             f"features are {', '.join(FEATURES)}")
    kind = raw.get("kind")
    if kind not in ("logistic", "mlp"):
        raise ExitbenchError(f"--exit-model {path}: kind must be 'logistic' or 'mlp', got {kind!r}")
    hidden = len(raw.get("hidden_bias") or []) if kind == "mlp" else 0
    shapes = {"mean": [len(names)], "scale": [len(names)], "weights": [hidden or len(names)]}
    if kind == "mlp":
        shapes.update(hidden_bias=[hidden], hidden_weights=[hidden, len(names)])
    for field, shape in shapes.items():
        if not _numbers(raw.get(field), shape) or not hidden and kind == "mlp":
            raise ExitbenchError(f"--exit-model {path}: {field!r} must be finite numbers of shape "
                                 f"{'×'.join(map(str, shape))}")
    if any(v <= 0 for v in raw["scale"]):
        raise ExitbenchError(f"--exit-model {path}: every 'scale' must be > 0")
    bias = raw.get("bias")
    if not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ExitbenchError(f"--exit-model {path}: 'bias' must be a finite number, got {bias!r}")
    return ExitModel(raw, path, digest)


class _FittedOn(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    fingerprint: str | None = None
    path: str | None = None


class ExitModelFile(BaseModel):
    """The types of an exit model's fields; their shapes depend on each other and are checked in `_parse`,
    which also says what a missing field or a non-finite number should be."""
    model_config = ConfigDict(strict=True, extra="allow")
    features: list[str] | None = None
    kind: str | None = None
    mean: list[float] | None = None
    scale: list[float] | None = None
    weights: list[float] | None = None
    bias: Any = None
    hidden_bias: list[float] | None = None
    hidden_weights: list[list[float]] | None = None
    checkpoint: _FittedOn = _FittedOn()


def _numbers(value: Any, shape: list[int]) -> bool:
    """Whether `value` is nested lists of finite numbers of exactly this shape."""
    if not isinstance(value, list) or len(value) != shape[0]:
        return False
    if len(shape) > 1:
        return all(_numbers(v, shape[1:]) for v in value)
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)


@register
class Learned(ExitPolicy):
    """Predicted risk that the prediction is not yet final < τ: a small model of trajectory features, fitted per
    checkpoint by `exitbench fit-exit` on held-out documents (label: the oracle's criterion)."""

    name = "learned"
    source = "exitbench fit-exit: logistic regression or a one-layer MLP on decoding-free trajectory features"
    needs_exit_model = True
    default_threshold = 0.1
    default_grid = (0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03, 0.02, 0.01, 0.005, 0.002, 0.001)

    def __init__(self, **knobs: Any):
        super().__init__(**knobs)
        # An ExitConfig hands over the model it read once, so that a cell is keyed and computed from the same
        # bytes even if the file is replaced in between; a path is read here.
        if isinstance(self.exit_model, ExitModel):
            self.model, self.exit_model = self.exit_model, self.exit_model.path
        else:
            self.model = load_exit_model(self.exit_model)

    @property
    def variant(self) -> str:
        return f"{self.name}-{self.model.digest[:16]}"

    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        return start_memory(s0)

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        return self.model.risk(features(s, memory))


def check_fitted_for(ck: Any, exit_model: "ExitModel | str | Path | None") -> None:
    """An exit model reads the feature scales of the checkpoint it was fitted on: refuse another one. The
    commands hand it the exit model their config already read (`ExitConfig.fitted_exit_model`), so a run
    reads the file once; a path is read here."""
    if not exit_model:
        return
    if not isinstance(exit_model, ExitModel):
        exit_model = load_exit_model(exit_model)
    from ..store.identity import checkpoint_identity

    fitted = exit_model.checkpoint
    here = checkpoint_identity(ck.path).short
    if fitted.get("fingerprint") != here:
        raise ExitbenchError(f"--exit-model {exit_model.path} was fitted on checkpoint {fitted.get('fingerprint')} "
                             f"({fitted.get('path')}), not on {ck.path} ({here}); "
                             f"fit one for it with `exitbench fit-exit -c {ck.path}`")
