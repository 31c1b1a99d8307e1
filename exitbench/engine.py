"""The adaptive recurrence: every scored or generated token runs its own loop and exits on its own.

How a batch moves (shared/DESIGN.md, "engine"):
- The prefix whose outputs nobody scores is prefilled at full depth, all positions at once (or, with
  `prefill="exit"`, token by token with exits like everything else).
- From the first position whose output is scored or sampled on, the batch advances in lockstep, one position
  at a time. At each position every row whose sequence is there runs the loop; after each iteration the
  policy looks at the still-active tokens, and those that exit leave the active set, so compute falls with
  mean iterations.
- A token that exits at iteration e has its KV entries at e copied into the slots above e: a later token
  reading iteration i > e of that layer sees the exited token's deepest entry (Huginn's `latest`).
- Rows never see each other, and each position's initial state noise depends only on (seed, position), so
  a batched run gives the answers of batch-size-1 runs: batching is a speed choice, never a change of answer.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml

from .errors import ExitbenchError
from .flops import FlopModel
from .models import AttnContext, KVCache, LoopedLM, LoopGroup, Stage
from .models.looped import unit_trunc_normal
from .policies import ExitPolicy, make_policy

PHASES = ("prefill", "prelude", "core", "probe", "coda")


@dataclass
class ExitConfig:
    """Everything that decides how tokens exit; the run command and the lm-eval adapter build one of these."""

    policy: str = "fixed"
    threshold: float | None = None
    min_steps: int = 1
    max_steps: int | None = None
    patience: int | None = None
    relative: bool = False
    prefill: str = "full"
    warm_start: bool = False
    record_signals: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.prefill not in ("full", "exit"):
            raise ExitbenchError(f"prefill must be 'full' or 'exit', got {self.prefill!r}")
        self.build_policy()  # validate the knobs now, not at the first token

    def build_policy(self) -> ExitPolicy:
        knobs = {"threshold": self.threshold, "min_steps": self.min_steps, "max_steps": self.max_steps,
                 "patience": self.patience, "relative": self.relative}
        return make_policy(self.policy, **knobs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ExitConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ExitbenchError(f"unknown exit config key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**raw)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ExitConfig":
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ExitbenchError(f"cannot read exit config {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ExitbenchError(f"cannot read exit config {path}: not valid YAML{where}: {problem}") from None
        if not isinstance(raw, dict):
            raise ExitbenchError(f"exit config {path} must be a mapping of knobs")
        return cls.from_dict(raw)


@dataclass
class TokenRecord:
    """One scored or generated token: its exit step per loop group, cost, and optionally the signals."""

    position: int
    exit_steps: list[int]
    time_s: dict[str, float]
    flops: dict[str, float]
    signals: list[list[float]] | None = None
    nonfinite: bool = False  # a NaN or infinity in the token's exit states or logits


@dataclass
class SequenceResult:
    tokens: list[int]
    logprobs: list[float]
    greedy: list[bool]
    records: list[TokenRecord] = field(default_factory=list)
    stopped_by: str | None = None
    # Full next-token log-probabilities per scored position, when asked for (shared-context scoring).
    distributions: list[torch.Tensor] | None = None

    @property
    def iterations(self) -> list[int]:
        return [sum(r.exit_steps) for r in self.records]


class PositionNoise:
    """Unit truncated-normal initial-state noise keyed by (seed, position), identical for every row.

    Drawn in fixed blocks, each from its own generator: torch's samplers are not prefix-stable (the first
    rows of a draw of 8 differ from a draw of 16), so growing one table would change earlier positions.
    """

    BLOCK = 64

    def __init__(self, seed: int, dim: int):
        self.seed, self.dim = seed, dim
        self.table = torch.empty(0, dim)

    def rows(self, start: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        end = start + length
        if end > self.table.shape[0]:
            blocks = [self.table]
            for b in range(self.table.shape[0] // self.BLOCK, -(-end // self.BLOCK)):
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
                blocks.append(unit_trunc_normal((self.BLOCK, self.dim), gen))
            self.table = torch.cat(blocks)
        return self.table[start:end].to(dtype=dtype, device=device)


class ExitEngine:
    def __init__(self, model: LoopedLM, config: ExitConfig | None = None):
        self.model = model.eval()
        self.config = config or ExitConfig()
        self.stages = model.stages()
        self.groups = [s for s in self.stages if isinstance(s, LoopGroup)]
        if not self.groups:
            raise ExitbenchError(f"{model.architecture} model has no loop group: nothing to exit from")
        self.policies = [self.config.build_policy().bind(g.default_steps) for g in self.groups]
        for g, p in zip(self.groups, self.policies):
            if p.max_steps > g.max_steps:
                raise ExitbenchError(f"{p.name}: max_steps={p.max_steps} exceeds the {g.name} group's maximum of "
                                     f"{g.max_steps} iterations (the checkpoint's configured maximum)")
        # A probe reads out the later groups at their default depth, capped where this run's policy caps them
        # (the cache has no slot past a group's max_steps).
        self._readout_steps = [min(g.default_steps, p.max_steps) for g, p in zip(self.groups, self.policies)]
        # The probe of the last loop group is the final readout: reuse it instead of running the coda twice.
        self._probe_is_final = [i == len(self.groups) - 1 for i in range(len(self.groups))]
        self.noise = PositionNoise(self.config.seed, self._state_dim())
        self.flops = FlopModel(model, self._readout_steps)
        self.stats: dict[str, float] = dict.fromkeys((*PHASES, "wall", "tokens"), 0.0)
        self._targets: torch.Tensor | None = None
        self._sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def _state_dim(self) -> int:
        return self.model.embed(torch.zeros(1, 1, dtype=torch.long, device=self.model.device)).shape[-1]

    # ---- public entry points ---------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, requests: Sequence[tuple[Sequence[int], int]], keep_distributions: bool = False
              ) -> list[SequenceResult]:
        """Teacher-forced log-probabilities of tokens[n_context:] for each (tokens, n_context) request.

        The outputs at positions n_context−1 … len−2 predict the scored tokens, so those positions run with
        exits; positions before them are the prefill.
        """
        for tokens, n_ctx in requests:
            if not 1 <= n_ctx < len(tokens):
                raise ExitbenchError(f"a scoring request needs 1 ≤ n_context < len(tokens), got {n_ctx}, {len(tokens)}")
        seqs = [list(t) for t, _ in requests]
        starts = [n - 1 for _, n in requests]
        ends = [len(t) - 2 for t in seqs]
        results = [SequenceResult([], [], [], distributions=[] if keep_distributions else None) for _ in seqs]

        def consume(row: int, pos: int, logp: torch.Tensor) -> int:
            target = seqs[row][pos + 1]
            if keep_distributions:
                results[row].distributions.append(logp.cpu())
            results[row].tokens.append(target)
            results[row].logprobs.append(logp[target].item())
            results[row].greedy.append(int(logp.argmax()) == target)
            return target

        self._run(seqs, starts, ends, consume, results, teacher_forced=True)
        return results

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None) -> list[SequenceResult]:
        """Greedy continuation of each prompt, each new token with its own exit; stops at a stop id, when
        `stop(row, generated)` says so, or after max_new_tokens."""
        if max_new_tokens < 1:
            raise ExitbenchError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        seqs = [list(p) for p in prompts]
        if any(len(s) == 0 for s in seqs):
            raise ExitbenchError("generation needs a non-empty prompt (at least a BOS token)")
        starts = [len(s) - 1 for s in seqs]
        ends = [len(s) - 2 + max_new_tokens for s in seqs]
        results = [SequenceResult([], [], []) for _ in seqs]
        stop_set = set(stop_ids)

        def consume(row: int, pos: int, logp: torch.Tensor) -> int | None:
            token = int(logp.argmax())
            res = results[row]
            res.tokens.append(token)
            res.logprobs.append(logp[token].item())
            res.greedy.append(True)
            seqs[row].append(token)
            if token in stop_set:
                res.stopped_by = "stop_id"
                return None
            if stop is not None and stop(row, res.tokens):
                res.stopped_by = "stop"
                return None
            return token

        self._run(seqs, starts, ends, consume, results, teacher_forced=False)
        for res in results:
            res.stopped_by = res.stopped_by or "max_new_tokens"
        return results

    # ---- the lockstep loop ---------------------------------------------------------------------------
    def _run(self, seqs: list[list[int]], starts: list[int], ends: list[int],
             consume: Callable[[int, int, torch.Tensor], int | None], results: list[SequenceResult],
             teacher_forced: bool) -> None:
        """Positions starts[b] … ends[b] of row b produce consumed outputs; `consume` returns None to stop."""
        model, device = self.model, self.model.device
        B = len(seqs)
        capacity = max(ends) + 1
        if capacity > model.config.block_size:
            raise ExitbenchError(f"a sequence needs {capacity} positions but the model's context is "
                                 f"{model.config.block_size}")
        wall0 = time.perf_counter()
        cache = model.new_cache(B, capacity, [p.max_steps for p in self.policies])
        prefix = list(starts) if self.config.prefill == "full" else [0] * B
        self._prefill(cache, seqs, prefix)
        alive = [True] * B
        for pos in range(min(prefix), max(ends) + 1):
            rows = [b for b in range(B) if alive[b] and prefix[b] <= pos <= ends[b]]
            if not rows:
                continue
            token_ids = torch.tensor([seqs[b][pos] for b in rows], device=device)
            self._targets = None
            if teacher_forced:
                self._targets = torch.tensor([seqs[b][pos + 1] for b in rows])
            logp, records = self._position(cache, pos, rows, B, token_ids)
            for j, b in enumerate(rows):
                if pos < starts[b]:
                    continue  # a prompt token run with exits (prefill="exit"): nobody scores its output
                results[b].records.append(records[j])
                if consume(b, pos, logp[j]) is None or pos >= ends[b]:
                    alive[b] = False
        self.stats["wall"] += time.perf_counter() - wall0
        self.stats["tokens"] += sum(len(r.records) for r in results)

    def _prefill(self, cache: KVCache, seqs: list[list[int]], lengths: list[int]) -> None:
        """Positions [0, length_b) of every row at full depth, in one pass over the right-padded batch.

        Padding past a row's prefix computes junk entries that the lockstep loop overwrites, at every slot,
        before any token of that row reads them.
        """
        B = len(seqs)
        self.warm = [None] * len(self.groups)
        self.warm_valid = torch.tensor([n > 0 for n in lengths])
        L = max(lengths)
        if L == 0:
            return
        t0 = time.perf_counter()
        ids = torch.tensor([s[:L] + [0] * (L - len(s[:L])) for s in seqs], device=self.model.device)
        ctx = AttnContext(start=0, cache=cache)
        x = self.model.embed(ids, 0)
        g = 0
        for stage in self.stages:
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
                continue
            s = stage.init(x, self._noise(stage, 0, L, x))
            for i in range(self.policies[g].max_steps):
                s = stage.step(s, x, ctx.at_slot(i))
            last = torch.tensor([max(n - 1, 0) for n in lengths], device=x.device)
            self.warm[g] = s[torch.arange(B), last]
            x = stage.finish(s)
            g += 1
        self._sync()
        self.stats["prefill"] += time.perf_counter() - t0

    def _noise(self, group: LoopGroup, start: int, length: int, x: torch.Tensor) -> torch.Tensor | None:
        if not group.random_init:
            return None
        return self.noise.rows(start, length, x.dtype, x.device).unsqueeze(0).expand(x.shape[0], -1, -1)

    def _position(self, cache: KVCache, pos: int, rows: list[int], B: int, token_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, list[TokenRecord]]:
        """Run one position for `rows`; return log-probs (n, V) and a record per row."""
        n = len(rows)
        rows_t = None if rows == list(range(B)) else torch.tensor(rows, device=self.model.device)
        ctx = AttnContext(start=pos, cache=cache, rows=rows_t)
        times = dict.fromkeys(PHASES[1:], 0.0)
        clock = time.perf_counter
        x = self.model.embed(token_ids.view(n, 1), pos)
        exits, signals, logits = [], [], None
        finite = torch.ones(n, dtype=torch.bool, device=x.device)
        phase = "prelude"
        g = 0
        for stage in self.stages:
            if isinstance(stage, Stage):
                t0 = clock()
                x = stage.run(x, ctx)
                self._sync()
                times[phase] += clock() - t0
                continue
            x, steps, sig, logits, t_core, t_probe = self._loop(g, stage, x, ctx)
            finite &= torch.isfinite(x).flatten(1).all(-1)
            times["core"] += t_core
            times["probe"] += t_probe
            exits.append(steps)
            signals.append(sig)
            phase = "coda"
            g += 1
            if logits is not None and self._probe_is_final[g - 1]:
                break  # the exit probe already ran the rest of the model on the final state
        if logits is None:
            t0 = clock()
            logits = self.model.head(x)[:, 0]
            self._sync()
            times["coda"] += clock() - t0
        logp = torch.log_softmax(logits.float(), dim=-1)
        nonfinite = (~(finite.cpu() & torch.isfinite(logits.float()).all(-1).cpu())).tolist()
        for phase, seconds in times.items():
            self.stats[phase] += seconds
        per_row = {k: v / n for k, v in times.items()}  # a position's time, shared by the rows that ran it
        records = []
        for j in range(n):
            steps = [int(e[j]) for e in exits]
            sigs = [s[j] for s in signals] if self.config.record_signals else None
            records.append(TokenRecord(pos, steps, dict(per_row), self.flops.token(pos + 1, steps, self._probes(steps)),
                                       sigs, nonfinite[j]))
        return logp, records

    def _probes(self, steps: list[int]) -> list[int]:
        return [s if p.needs_logits else 0 for s, p in zip(steps, self.policies)]

    def _loop(self, g: int, group: LoopGroup, x: torch.Tensor, ctx: AttnContext):
        """Iterate `group` for the tokens in x (n, 1, d) until each exits. Returns the group's output, exit
        steps (n,), recorded signals, the exit logits when the probe produced them, and core/probe time."""
        policy, cache = self.policies[g], ctx.cache
        clock, sync = time.perf_counter, self._sync
        n = x.shape[0]
        K = policy.max_steps
        s = group.init(x, self._noise(group, ctx.start, 1, x))
        if self.config.warm_start and self.warm[g] is not None:
            sel = ctx.rows if ctx.rows is not None else slice(None)
            s = torch.where(self.warm_valid[sel].view(-1, 1, 1).to(s.device), self.warm[g][sel].unsqueeze(1), s)
        # CPU float32 tokens run a latent rule on their states' addresses: the same formula at a fraction of
        # the dispatch cost (policies/host.py). Everything else works on tensors.
        host = policy.has_host_probe and s.device.type == "cpu" and s.dtype == torch.float32
        probe = policy.host_probe(s) if host else None
        memory = {} if host else policy.start(s[:, 0])
        exit_steps = torch.full((n,), K, dtype=torch.long)
        final = torch.empty_like(s)
        need_logits = policy.needs_logits
        final_logits = torch.empty(n, self.model.output_size) if need_logits else None
        record = self.config.record_signals
        sig_log = torch.full((n, K), float("nan")) if record else None
        trajectory = [] if policy.retrospective else None
        all_rows = ctx.rows if ctx.rows is not None else torch.arange(n, device=x.device)
        active = None  # indices into 0..n-1 of tokens still looping; None means all of them
        s_a, x_a, ctx_a = s, x, ctx
        t_core = t_probe = 0.0
        for i in range(K):
            k = i + 1
            t0 = clock()
            s_a = group.step(s_a, x_a, ctx_a.at_slot(i))
            sync()
            t1 = clock()
            t_core += t1 - t0
            logits = self.model.readout(g, s_a, ctx_a, self._readout_steps)[:, 0] if need_logits else None
            if policy.retrospective:
                trajectory.append((s_a, torch.log_softmax(logits.double(), -1), logits))
                t_probe += clock() - t1
                continue
            done = None  # per-token exits, when only some of several active tokens may leave
            if policy.signal_free:
                leaving = k >= K
                if record:
                    sig_log[slice(None) if active is None else active, i] = float(k)
            elif probe is not None:
                leave, sig = probe.step(k, s_a)
                leaving = leave is not None
                if leaving and not all(leave):
                    done = torch.tensor(leave)
                if record:
                    sig_log[slice(None) if active is None else active, i] = torch.tensor(sig, dtype=torch.float32)
            else:
                # float64: KL and entropy differences near their thresholds (1e-5 and below) sit at float32's
                # rounding noise, which varies with batch shape; in float64 batching cannot flip an exit.
                logp = torch.log_softmax(logits.double(), -1) if need_logits else None
                sig = policy.signal(k, s_a[:, 0], memory, logp)
                done = policy.decide(k, sig, memory)
                leaving = bool(done.any())
                if record:
                    sig_log[slice(None) if active is None else active, i] = sig.float().cpu()
            t_probe += clock() - t1
            if not leaving:
                continue
            if done is None or bool(done.all()):  # every active token leaves now
                tok = torch.arange(n) if active is None else active
                exit_steps[tok] = k
                final[tok] = s_a
                if need_logits:
                    final_logits[tok] = logits.float()
                if k < K:
                    cache.carry_forward(group.attn_layers, ctx.rows if active is None else all_rows[tok], ctx.start, i)
                break
            done_idx = done.nonzero().flatten()
            tok = done_idx if active is None else active[done_idx]
            exit_steps[tok] = k
            final[tok] = s_a[done_idx]
            if need_logits:
                final_logits[tok] = logits[done_idx].float()
            cache.carry_forward(group.attn_layers, all_rows[tok], ctx.start, i)
            kept = (~done).nonzero().flatten()
            active = kept if active is None else active[kept]
            s_a, x_a = s_a[kept], x_a[kept]
            memory = {name: v[kept] for name, v in memory.items()}
            if probe is not None:
                probe.keep(kept)
            ctx_a = AttnContext(ctx.start, cache, all_rows[active], 0)
        if policy.retrospective:
            final, final_logits, exit_steps = self._settle_oracle(g, group, policy, trajectory, ctx, all_rows)
        self.warm[g] = self._store_warm(g, final, ctx)
        signals = [sig_log[j].tolist() for j in range(n)] if record else [None] * n
        return group.finish(final), exit_steps, signals, final_logits if need_logits else None, t_core, t_probe

    def _store_warm(self, g: int, final: torch.Tensor, ctx: AttnContext) -> torch.Tensor | None:
        """Remember each row's final state, the next token's start under warm_start (Huginn §6.3)."""
        if not self.config.warm_start:
            return None
        sel = ctx.rows if ctx.rows is not None else slice(None)
        warm = self.warm[g]
        if warm is None:
            warm = torch.zeros(self.warm_valid.shape[0], final.shape[-1], dtype=final.dtype, device=final.device)
        warm = warm.clone()
        warm[sel] = final[:, 0]
        self.warm_valid = self.warm_valid.clone()
        self.warm_valid[sel.cpu() if isinstance(sel, torch.Tensor) else sel] = True
        return warm

    def _settle_oracle(self, g, group, policy, trajectory, ctx, all_rows):
        """Pick the oracle's exit from the full trajectory, then make the cache look as if it exited there."""
        logps = torch.stack([lp for _, lp, _ in trajectory])
        exit_steps = policy.retrospective_exit(logps, self._targets)
        n = exit_steps.shape[0]
        idx = torch.arange(n)
        states = torch.stack([s for s, _, _ in trajectory])
        final = states[exit_steps - 1, idx]
        final_logits = torch.stack([lg for _, _, lg in trajectory])[exit_steps - 1, idx].float()
        for k in exit_steps.unique().tolist():
            sel = (exit_steps == k).nonzero().flatten()
            if k < policy.max_steps:
                ctx.cache.carry_forward(group.attn_layers, all_rows[sel], ctx.start, k - 1)
            # The coda's KV must come from the exit state too: rerun the readout for these tokens.
            sub = AttnContext(ctx.start, ctx.cache, all_rows[sel], 0)
            self.model.readout(g, final[sel], sub, self._readout_steps)
        return final, final_logits, exit_steps
