"""The recording pass: every scored position at every iteration, in one teacher-forced pass per sequence.

A sequence's tokens run as a prefill does: all positions together, every loop group to depth K (the deepest
any cell of the sweep needs), initial-state noise keyed by position as in the engine. Along the way each
scored position keeps its state at every iteration; afterwards, for every iteration k, the readout "if the
token exited here" (the group's finish, the rest of the model, the head) is computed for all scored
positions of a sequence at once, and from it and the states:
- every requested policy variant's signal at every iteration (what its exit rule reads),
- each target token's log-probability and the argmax (quality, and the oracle),
- for fixed-depth baselines, the model's output at depth r.

What the recording sees, and so what replay is exact for:
- A scored token reads the unscored prefix at full depth, as the engine's prefill leaves it. Other scored
  tokens are read at the same iteration k (core) and at iteration k (readout), where the engine reads an
  exited token's deepest entry: with one scored token per sequence (a one-token continuation, a multiple
  choice option) replay equals the exact run; with several it is an approximation (`--verify` measures it).
- Loop group g's trajectory is recorded with earlier groups at full depth; an exact run feeds group g the
  output of the earlier groups' own exits.
- Fixed depth r on a one-group model is recomputed exactly (every position at r); on several groups each
  baseline depth gets its own pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ExitbenchError
from ..models import AttnContext, LoopedLM
from ..policies import ExitPolicy, log_probs
from .config import ExitConfig
from .noise import PositionNoise


@dataclass
class Sequence_:
    """One pass: the tokens fed in, the first scored position, and the targets of each member request (the
    options of a multiple-choice question share a pass and differ in their last target)."""

    inputs: list[int]
    first: int
    members: list[list[int]]  # per member: the target of every scored position first … len(inputs) − 1


@dataclass
class Trajectories:
    """What one sequence's scored positions did at iterations 1 … K, per loop group g."""

    positions: list[int]
    signals: list[dict[str, np.ndarray]]   # [g][variant] → (n, K) signal as the rule reads it
    top: list[np.ndarray | None]           # [g] → (n, K) argmax of the readout (None: not read out)
    picked: list[list[np.ndarray | None]]  # [member][g] → (n, K) the target's log-probability (float64)
    quality: list[np.ndarray]              # [member] → (n, K) the same, last group, as the engine reports it
    finite: np.ndarray                     # (n, K) states and readout finite, last group
    fixed_picked: dict[int, list[np.ndarray]] = field(default_factory=dict)  # r → [member] (n,)
    fixed_top: dict[int, np.ndarray] = field(default_factory=dict)           # r → (n,)

    def exits(self, policies: Sequence[ExitPolicy], member: int = 0, by_target: bool = True) -> np.ndarray:
        """Exit step per scored token and loop group, (n, G), one policy per group, each by its own rule's
        array form (`ExitPolicy.recorded_exits`)."""
        n = len(self.positions)
        return np.stack([p.recorded_exits(n, self.signals[g].get(variant_key(p)), self.top[g],
                                          self.picked[member][g], by_target)
                         for g, p in enumerate(policies)], 1)


def check_recordable(knobs: dict[str, Any], command: str) -> None:
    """A recording runs tokens the default way (prompt at full depth and, on a prefix-LM, as its block, each token
    from its own initial state, one KV slot per iteration): refuse a replay of any engine knob set otherwise."""
    engine = {k: v for k, v in knobs.items() if k in ExitConfig.names(role="engine")}
    changed = ExitConfig(**engine).changed("engine")
    if changed:
        flag = "--" + changed[0].replace("_", "-") + (f" {knobs[changed[0]]}" if changed[0] == "prefill" else "")
        raise ExitbenchError(f"{command}: --replay records prompts at full depth as the model reads them, every "
                             f"token from its own initial state and one KV slot per iteration; it cannot replay {flag} "
                             "(run those cells without --replay)")


def variant_key(policy: ExitPolicy) -> str:
    """Policies that share a signal (they differ in threshold, patience, min/max steps) share a recording."""
    return policy.variant


@dataclass
class _Chunk:
    """A batch of sequences as one pass runs them: the padded ids (B, L), the first position any row scores
    (`lo`: the chunk [lo, L) is what is kept), and every row's scored positions, flattened: their row, their
    column within the chunk, and which chunk positions are scored ((B, L − lo, 1))."""

    ids: torch.Tensor
    lo: int
    rows: torch.Tensor
    cols: torch.Tensor
    scored: torch.Tensor
    lo_of: torch.Tensor  # (B,) each row's first scored position

    @classmethod
    def of(cls, seqs: list[Sequence_], device) -> _Chunk:
        L = max(len(s.inputs) for s in seqs)
        lo = min(s.first for s in seqs)
        ids = torch.tensor([s.inputs + [0] * (L - len(s.inputs)) for s in seqs], device=device)
        rows = torch.tensor([b for b, s in enumerate(seqs) for _ in range(s.first, len(s.inputs))], device=device)
        cols = torch.tensor([p - lo for s in seqs for p in range(s.first, len(s.inputs))], device=device)
        scored = (torch.arange(lo, L, device=device).unsqueeze(0)
                  >= torch.tensor([s.first for s in seqs], device=device).unsqueeze(1)).unsqueeze(-1)
        return cls(ids, lo, rows, cols, scored, torch.tensor([s.first for s in seqs], device=device))


@dataclass
class _Readings:
    """What a recording pass reads at each iteration, for all scored positions of the batch at once; one
    entry per iteration k in each list."""

    signals: list[dict[str, list[torch.Tensor]]]  # [g][variant]
    top: list[list[torch.Tensor]]                 # [g]
    picked: list[list[list[torch.Tensor]]]        # [member][g]
    quality: list[list[torch.Tensor]]             # [member]
    finite: list[torch.Tensor]

    @classmethod
    def empty(cls, G: int, variants: dict[str, ExitPolicy], members: int) -> _Readings:
        return cls(signals=[{key: [] for key in variants} for _ in range(G)], top=[[] for _ in range(G)],
                   picked=[[[] for _ in range(G)] for _ in range(members)], quality=[[] for _ in range(members)],
                   finite=[])

    def per_sequence(self, seqs: list[Sequence_], fixed_picked: dict[int, list[torch.Tensor]],
                     fixed_top: dict[int, torch.Tensor]) -> list[Trajectories]:
        """The readings on the host, (n, K) arrays, cut into each sequence's Trajectories."""
        G = len(self.top)
        bounds = np.cumsum([0] + [len(s.inputs) - s.first for s in seqs])
        host = lambda xs: torch.stack(xs, 1).cpu().numpy() if xs else None  # noqa: E731
        sig = [{key: host(v) for key, v in self.signals[g].items() if v} for g in range(G)]
        tops = [host(self.top[g]) for g in range(G)]
        picks = [[host(self.picked[m][g]) for g in range(G)] for m in range(len(self.picked))]
        qual = [host(q) for q in self.quality]
        fin = host(self.finite)
        fp = {r: [v.cpu().numpy() for v in vs] for r, vs in fixed_picked.items()}
        ft = {r: v.cpu().numpy() for r, v in fixed_top.items()}
        out = []
        for b, s in enumerate(seqs):
            a, z = bounds[b], bounds[b + 1]
            members = range(len(s.members))
            out.append(Trajectories(
                positions=list(range(s.first, len(s.inputs))),
                signals=[{key: v[a:z] for key, v in sig[g].items()} for g in range(G)],
                top=[None if tops[g] is None else tops[g][a:z] for g in range(G)],
                picked=[[None if picks[m][g] is None else picks[m][g][a:z] for g in range(G)] for m in members],
                quality=[qual[m][a:z] for m in members],
                finite=fin[a:z],
                fixed_picked={r: [v[m][a:z] for m in members] for r, v in fp.items()},
                fixed_top={r: v[a:z] for r, v in ft.items()}))
        return out


class Recorder:
    def __init__(self, model: LoopedLM, depth: int, variants: Sequence[ExitPolicy], baselines: Sequence[int],
                 seed: int, readout_steps: list[int], oracle: bool):
        self.model, self.K = model, depth
        self.groups = model.loop_groups()
        stages = model.stages()
        self.bounds = [next(i for i, st in enumerate(stages) if st is g) for g in self.groups]
        self.variants = {variant_key(p): p for p in variants if not (p.signal_free or p.retrospective)}
        self.baselines = sorted({r for r in baselines if r != depth})
        self.readout_steps = readout_steps
        dim = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device)).shape[-1]
        self.noise = PositionNoise(seed, dim)
        decoding = any(p.needs_logits for p in self.variants.values()) or oracle
        # The last group is always read out (quality); earlier ones only for rules that decode.
        self.read_group = [decoding or g == len(self.groups) - 1 for g in range(len(self.groups))]
        self.seconds = {"walk": 0.0, "readout": 0.0, "signals": 0.0}

    @torch.no_grad()
    def record(self, seqs: list[Sequence_]) -> list[Trajectories]:
        """Record a batch of sequences (one row each)."""
        chunk = _Chunk.of(seqs, self.model.device)
        cache, kept, whole = self._walk(chunk)
        targets = [torch.tensor([t for s in seqs for t in (s.members[m] if m < len(s.members) else s.members[0])],
                                device=self.model.device) for m in range(max(len(s.members) for s in seqs))]
        readings = _Readings.empty(len(self.groups), self.variants, len(targets))
        for g in range(len(self.groups)):
            self._read_group(g, kept[g], chunk, cache, targets, readings)
        fixed_picked, fixed_top = self._baselines(seqs, chunk.ids, whole, chunk.rows, chunk.cols + chunk.lo, targets)
        return readings.per_sequence(seqs, fixed_picked, fixed_top)

    def _walk(self, chunk: _Chunk) -> tuple[Any, list[list[torch.Tensor]], dict[int, torch.Tensor]]:
        """Every position through every loop group to depth K: the cache, each group's states at iterations
        0 … K over the chunk [lo, L) ([g][k] → (B, L − lo, d)), and on one group each baseline depth's state at
        every position (r → s_r)."""
        model, K, G = self.model, self.K, len(self.groups)
        B, L = chunk.ids.shape
        t0 = time.perf_counter()
        cache = model.new_cache(B, L, [K] * G)
        kept: list[list[torch.Tensor]] = [[] for _ in range(G)]
        whole: dict[int, torch.Tensor] = {}

        def on_state(g: int, k: int, s: torch.Tensor) -> None:
            kept[g].append(s[:, chunk.lo:])
            if G == 1 and k in self.baselines:
                whole[k] = s

        noise = self._noise(B, L)
        # A prefix-LM reads each pass's context (up to its first scored position) as one bidirectional block.
        prefix = chunk.lo_of + 1 if model.prefix_lm else None
        model.walk(model.embed(chunk.ids, 0), AttnContext(start=0, cache=cache, prefix=prefix), [K] * G, noise=noise,
                   on_state=on_state)
        self.seconds["walk"] += time.perf_counter() - t0
        return cache, kept, whole

    def _read_group(self, g: int, states: list[torch.Tensor], chunk: _Chunk, cache, targets: list[torch.Tensor],
                    readings: _Readings) -> None:
        """Loop group g at every iteration k: the readout where it is read, and every variant's signal."""
        t0 = time.perf_counter()
        memory = {key: p.start(states[0][chunk.rows, chunk.cols], self.model.output_size)
                  for key, p in self.variants.items()}
        self.seconds["signals"] += time.perf_counter() - t0
        for k in range(1, self.K + 1):
            s_k = states[k][chunk.rows, chunk.cols]
            logp64 = None
            if self.read_group[g]:
                logp64 = self._readout(g, states[k], states[self.K], s_k, chunk, cache, targets, readings)
            t0 = time.perf_counter()
            for key, policy in self.variants.items():
                if policy.needs_logits and logp64 is None:
                    continue
                value = policy.defined_tensor(k, policy.signal(s_k, memory[key], logp64).double())
                readings.signals[g][key].append(value)
            self.seconds["signals"] += time.perf_counter() - t0

    def _readout(self, g: int, state: torch.Tensor, deepest: torch.Tensor, s_k: torch.Tensor, chunk: _Chunk,
                 cache, targets: list[torch.Tensor], readings: _Readings) -> torch.Tensor:
        """The scored positions exit group g at `state`'s iteration: the rest of the model and the head read
        them, and the readings keep the argmax, each member's target log-probability and (last group)
        quality and finiteness. Returns the float64 log-probabilities the rules read."""
        model, last = self.model, g == len(self.groups) - 1
        t0 = time.perf_counter()
        # Prefix positions of the chunk keep their full-depth state; scored ones exit at k.
        mixed = torch.where(chunk.scored, state, deepest)
        x = model.walk(self.groups[g].finish(mixed), AttnContext(start=chunk.lo, cache=cache),
                       self.readout_steps, start=self.bounds[g] + 1)
        logits = model.head(x[chunk.rows, chunk.cols])
        # As the engine: float32 log-probabilities for quality, float64 for the rules and the oracle.
        logp32 = torch.log_softmax(logits.float(), -1)
        logp64 = log_probs(logits)
        readings.top[g].append(logp32.argmax(-1))
        for m, tgt in enumerate(targets):
            readings.picked[m][g].append(logp64.gather(1, tgt.unsqueeze(1)).squeeze(1))
            if last:
                readings.quality[m].append(logp32.gather(1, tgt.unsqueeze(1)).squeeze(1))
        if last:
            readings.finite.append(torch.isfinite(s_k).all(-1) & torch.isfinite(logits).all(-1))
        self.seconds["readout"] += time.perf_counter() - t0
        return logp64

    def _noise(self, B: int, L: int):
        """Initial-state noise for B rows of L positions, keyed by position as the engine keys it."""
        def draw(group, x):
            return self.noise.rows(0, L, x.dtype, x.device).expand(B, -1, -1) if group.random_init else None
        return draw

    def _baselines(self, seqs, ids, whole, rows, positions, targets):
        """Each baseline depth's output at the scored positions: every position of the sequence at depth r."""
        model, G = self.model, len(self.groups)
        B, L = ids.shape
        picked: dict[int, list[torch.Tensor]] = {}
        top: dict[int, torch.Tensor] = {}
        for r in self.baselines:
            if G == 1:
                x = model.walk(self.groups[0].finish(whole[r]), AttnContext(), start=self.bounds[0] + 1)
            else:
                x = model.walk(model.embed(ids, 0), AttnContext(), [r] * G, noise=self._noise(B, L))
            logp = torch.log_softmax(model.head(x[rows, positions]).float(), -1)
            top[r] = logp.argmax(-1)
            picked[r] = [logp.gather(1, tgt.unsqueeze(1)).squeeze(1) for tgt in targets]
        return picked, top

