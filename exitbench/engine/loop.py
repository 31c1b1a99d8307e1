"""One loop group's iterations for a changing set of tokens: the per-token loop.

`TokenLoop` owns the tokens in flight through one loop group: their states, the policy's memory, their hit
streaks, signals and timings. Tokens join with `add`, at any iteration of the others, into the places that
tokens left (so a step's tensors keep their shape while rows hand over to their next tokens); `step` runs
one iteration for all of them and returns those that leave, and `_leave` is the one place they go. Rows of a
batch are independent, so the tokens in flight may sit at different positions and iterations: each attends
to its own row's keys at its own slot, and when all rows sit at one position and iteration the step is an
ordinary cached chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import AttnContext, KVCache, LoopedLM, LoopGroup
from ..policies import ExitPolicy
from .timing import PhaseClock


@dataclass
class Token:
    """One token's journey through the loop groups: where it is, what it must predict, what it did."""

    uid: int
    row: int
    position: int
    target: int | None = None  # the next token, when teacher-forced (the oracle scores against it)
    consumed: bool = True  # False for prompt tokens run with exits (prefill="exit"): nobody reads their output
    request: int = 0  # which of the run's requests the token belongs to
    exit_steps: list[int] = field(default_factory=list)
    signals: list[list[float]] = field(default_factory=list)
    nonfinite: bool = False


@dataclass
class Leaving:
    """Tokens that exited a loop group in one step: their final states and, when the exit probe decoded
    through the rest of the model, its logits."""

    tokens: list[Token]
    states: torch.Tensor            # (m, 1, d)
    logits: torch.Tensor | None     # (m, V)


class TokenLoop:
    def __init__(self, model: LoopedLM, index: int, group: LoopGroup, policy: ExitPolicy, clock: PhaseClock, *,
                 readout_steps: list[int], probe_is_final: bool, record_signals: bool, batch: int,
                 window: int | None = None):
        self.model, self.index, self.group, self.policy, self.clock = model, index, group, policy, clock
        self.readout_steps, self.probe_is_final, self.record = readout_steps, probe_is_final, record_signals
        self.batch = batch
        self.K = policy.max_steps
        self.window = window
        # The oracle runs every token to K and settles on an earlier exit afterwards; under a KV window of
        # fewer than K iterations the iterations past the exit have overwritten its entries by then, so it
        # keeps each iteration's entries to put the exit's back.
        self.keeps_entries = policy.retrospective and bool(window) and window < self.K and bool(group.attn_layers)
        self.vocab = model.output_size
        self.decodes = policy.needs_logits
        # Per place in the table: its token (None: free), iterations so far, hit streak, signals, first step.
        self.tokens: list[Token | None] = []
        self.k: list[int] = []
        self.streak: list[int] = []
        self.trace: list[list[float]] = []
        self.joined: list[int] = []
        self.count = 0  # tokens in flight (places not free)
        self.s = self.x = None  # states and group inputs (n, 1, d)
        self.memory: dict[str, torch.Tensor] = {}
        self.oracle: dict[str, torch.Tensor] = {}  # the retrospective policy's record of every iteration
        self._where: tuple[int | None, AttnContext | None] | None = None  # lockstep position, token context

    def __len__(self) -> int:
        return self.count

    # ---- joining ----------------------------------------------------------------------------------------------
    def add(self, tokens: list[Token], x: torch.Tensor, s0: torch.Tensor) -> None:
        """Tokens start their loops at states s0 with group inputs x (both (m, 1, d)), in free places first."""
        memory = self.policy.start(s0[:, 0], self.vocab)
        oracle = self._oracle_buffers(tokens, s0) if self.policy.retrospective else {}
        free = [j for j, t in enumerate(self.tokens) if t is None][: len(tokens)]
        step = self.clock.steps_so_far(self.index)
        if len(free) == len(self.tokens):  # every place is free: start the table afresh, no scatter
            self.tokens, self.k, self.streak, self.trace, self.joined, self.count = [], [], [], [], [], 0
            self.s = self.x = None
            self.memory, self.oracle = {}, {}
            free = []
        if free:
            at = torch.tensor(free, device=s0.device)
            m = len(free)
            self.s[at], self.x[at] = s0[:m], x[:m]
            for name, value in memory.items():
                self.memory[name][at] = value[:m]
            for name, value in oracle.items():
                self.oracle[name][at] = value[:m]
            for j, token in zip(free, tokens):
                self.tokens[j], self.k[j], self.streak[j], self.trace[j], self.joined[j] = token, 0, 0, [], step
        rest = len(free)
        if rest < len(tokens):
            grow = lambda old, new: new[rest:] if old is None else torch.cat([old, new[rest:]])  # noqa: E731
            self.s, self.x = grow(self.s, s0), grow(self.x, x)
            self.memory = {name: grow(self.memory.get(name), value) for name, value in memory.items()}
            self.oracle = {name: grow(self.oracle.get(name), value) for name, value in oracle.items()}
            added = tokens[rest:]
            self.tokens += added
            self.k += [0] * len(added)
            self.streak += [0] * len(added)
            self.trace += [[] for _ in added]
            self.joined += [step] * len(added)
        self.count += len(tokens)
        self._where = None

    # ---- one iteration ----------------------------------------------------------------------------------------
    def step(self, cache: KVCache) -> Leaving | None:
        """One iteration for every token in flight; the tokens that exit after it leave."""
        if self.count < len(self.tokens):
            self._compact()
        n = len(self.tokens)
        ctx = self._context(cache)
        started = self.clock.start()
        self.s = self.group.step(self.s, self.x, ctx)
        self.clock.step(started, "core", self.index, n)
        self.k = [k + 1 for k in self.k]
        started = self.clock.start()
        if self.keeps_entries:
            self._oracle_keep_entries(cache)
        logits, leave = self._probe(ctx)
        self.clock.step(started, "probe", self.index, n)
        if not any(leave):
            return None
        return self._leave(leave, logits, cache)

    def _probe(self, ctx: AttnContext) -> tuple[torch.Tensor | None, list[bool]]:
        """Signals and the exit decision: which tokens leave after this iteration."""
        policy = self.policy
        if policy.signal_free:
            if self.record:
                for trace, k in zip(self.trace, self.k):
                    trace.append(float(k))
            return None, [k >= self.K for k in self.k]
        logits = self.model.readout(self.index, self.s, ctx, self.readout_steps)[:, 0] if self.decodes else None
        if policy.retrospective:
            self._oracle_record(logits)
            return logits, [k >= self.K for k in self.k]
        # float64: KL and entropy differences near their thresholds (1e-5 and below) sit at float32's rounding
        # noise, which varies with batch shape; in float64 batching cannot flip an exit.
        logp = torch.log_softmax(logits.double(), -1) if self.decodes else None
        values = policy.signal(self.s[:, 0], self.memory, logp).tolist()  # the iteration's one host read
        if policy.defined_from > 1:
            values = [policy.defined(k, v) for k, v in zip(self.k, values)]
        if self.record:
            for trace, v in zip(self.trace, values):
                trace.append(v)
        return logits, policy.decide(self.k, values, self.streak)

    # ---- where tokens leave -----------------------------------------------------------------------------------
    def _leave(self, leave: list[bool], logits: torch.Tensor | None, cache: KVCache) -> Leaving:
        """The tokens marked in `leave` go: their places are freed for the next tokens of their rows."""
        gone = [j for j, out in enumerate(leave) if out]
        tokens = [self.tokens[j] for j in gone]
        steps = [self.k[j] for j in gone]
        states = self.s[gone]
        exit_logits = logits[gone] if logits is not None and self.probe_is_final else None
        if self.policy.retrospective:
            steps, states, exit_logits = self._oracle_settle(gone, cache)
        end = self.clock.steps_so_far(self.index)
        for token, k, j in zip(tokens, steps, gone):
            token.exit_steps.append(k)
            if self.record:
                token.signals.append(self.trace[j] + [float("nan")] * (self.K - len(self.trace[j])))
            self.clock.charge(token.uid, self.index, self.joined[j], end)
            self.tokens[j] = None
        self.count -= len(gone)
        early = [(t, k) for t, k in zip(tokens, steps) if k < self.K]
        if early and self.group.attn_layers:  # later tokens read an early exit's deepest entry (`latest`)
            cache.carry_forward(self.group.attn_layers, [t.row for t, _ in early], [t.position for t, _ in early],
                                [k - 1 for _, k in early])
        self._where = None
        return Leaving(tokens, states, exit_logits)

    def _compact(self) -> None:
        """Drop the free places (a row with no next token left them) so steps run on tokens only."""
        keep = [j for j, t in enumerate(self.tokens) if t is not None]
        at = torch.tensor(keep, dtype=torch.long, device=self.s.device)
        self.s, self.x = self.s[at], self.x[at]
        self.memory = {name: value[at] for name, value in self.memory.items()}
        self.oracle = {name: value[at] for name, value in self.oracle.items()}
        for name in ("tokens", "k", "streak", "trace", "joined"):
            setattr(self, name, [getattr(self, name)[j] for j in keep])
        self._where = None

    # ---- attention context ------------------------------------------------------------------------------------
    def _context(self, cache: KVCache) -> AttnContext:
        """Where the tokens in flight read and write this iteration: their rows, positions and slots."""
        if self._where is None:  # membership changed: where the tokens sit, worked out once
            rows = [t.row for t in self.tokens]
            positions = [t.position for t in self.tokens]
            lockstep = rows == list(range(self.batch)) and min(positions) == max(positions)
            self._where = (positions[0] if lockstep else None, None)
        position, tokens = self._where
        same_slot = min(self.k) == max(self.k)
        if position is not None and same_slot:
            return AttnContext(start=position, cache=cache, slot=self.k[0])  # every row in lockstep: a chunk
        if tokens is None:  # (also in lockstep, when iterations differ)
            tokens = AttnContext.tokens(cache, [t.row for t in self.tokens], [t.position for t in self.tokens],
                                        slot=None)
            self._where = (position, tokens)
        return tokens.at_slot(self.k[0] if same_slot else torch.tensor(self.k, device=cache.device))

    # ---- the oracle: every token runs to max_steps, then settles on the earliest agreeing iteration -----------
    def _oracle_buffers(self, tokens: list[Token], s0: torch.Tensor) -> dict[str, torch.Tensor]:
        """Room for every iteration of new tokens: states, argmax, and the target's log-probability."""
        m, device = len(tokens), s0.device
        buffers = {"states": torch.zeros(m, self.K, s0.shape[-1], dtype=s0.dtype, device=device),
                   "top": torch.zeros(m, self.K, dtype=torch.long, device=device),
                   "picked": torch.zeros(m, self.K, dtype=torch.float64, device=device),
                   "target": torch.tensor([-1 if t.target is None else t.target for t in tokens], device=device)}
        if self.keeps_entries:  # (token, iteration, layer, key or value, head, dim)
            heads, head_dim = self.model.cache_geometry()
            buffers["kv"] = torch.zeros(m, self.K, len(self.group.attn_layers), 2, heads, head_dim,
                                        dtype=self.model.dtype, device=device)
        return buffers

    def _oracle_keep_entries(self, cache: KVCache) -> None:
        """Each token's KV entries of the iteration it just ran."""
        at = [k - 1 for k in self.k]
        entries = cache.entries(self.group.attn_layers, [t.row for t in self.tokens],
                                [t.position for t in self.tokens], at)
        device = entries.device
        self.oracle["kv"][torch.arange(len(at), device=device), torch.tensor(at, device=device)] = entries

    def _oracle_restore_entries(self, gone: list[int], steps: list[int], kept: torch.Tensor, cache: KVCache) -> None:
        """Put back the entries of each settled token's last `window` iterations up to its exit (the window's
        slots as a token that stopped there left them; `_leave` carries the exit's entry above it)."""
        rows, positions, iterations, picks = [], [], [], []
        for i, (j, e) in enumerate(zip(gone, steps)):
            if e == self.K:
                continue
            token = self.tokens[j]
            for it in range(max(0, e - self.window), e):
                rows.append(token.row)
                positions.append(token.position)
                iterations.append(it)
                picks.append(i * self.K + it)
        if rows:
            flat = kept.view(-1, *kept.shape[2:])
            cache.put_entries(self.group.attn_layers, rows, positions, iterations,
                              flat[torch.tensor(picks, device=kept.device)])

    def _oracle_record(self, logits: torch.Tensor) -> None:
        rows = torch.arange(len(self.tokens), device=logits.device)
        at = torch.tensor(self.k, device=logits.device) - 1  # each token's own iteration
        logp = torch.log_softmax(logits.double(), -1)
        self.oracle["states"][rows, at] = self.s[:, 0]
        self.oracle["top"][rows, at] = logp.argmax(-1)
        self.oracle["picked"][rows, at] = logp.gather(1, self.oracle["target"].clamp(min=0).unsqueeze(1)).squeeze(1)

    def _oracle_settle(self, gone: list[int], cache: KVCache) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """Exit steps from the recorded trajectories; the states there; and, for the last loop group, the
        readout rerun from the exit state, so the coda's KV entries are those of a token that stopped there."""
        record = {name: value[gone] for name, value in self.oracle.items()}
        steps = self.policy.exit_steps(record["top"], record["picked"], record["target"] >= 0)
        states = record["states"][torch.arange(len(gone)), steps - 1].unsqueeze(1)
        if self.keeps_entries:
            self._oracle_restore_entries(gone, steps.tolist(), record["kv"], cache)
        logits = None
        if self.probe_is_final:
            tokens = [self.tokens[j] for j in gone]
            ctx = AttnContext.tokens(cache, [t.row for t in tokens], [t.position for t in tokens])
            logits = self.model.readout(self.index, states, ctx, self.readout_steps)[:, 0]
        return steps.tolist(), states, logits
