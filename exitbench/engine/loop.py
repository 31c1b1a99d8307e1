"""One loop group's iterations for a changing set of tokens: the per-token loop.

`TokenLoop` owns the tokens in flight through one loop group: their states, the policy's memory, their hit
streaks, signals and timings. Tokens join with `add`, at any iteration of the others, into the places that
tokens left (so a step's tensors keep their shape while rows hand over to their next tokens); `step` runs
one iteration for all of them and returns those that leave, and `_leave` is the one place they go. Rows of a
batch are independent, so the tokens in flight may sit at different positions and iterations: each attends
to its own row's keys at its own iteration, and when all rows sit at one position and iteration the step is an
ordinary cached chunk.

With `places` set (continuous depth batching, docs/engine.md) the table has that many places for good: a token
that leaves frees its place and nothing moves; a free place runs in the step like the others, writing its keys
where no token reads them (a spare slot past max_steps, or the cache's last position: the run keeps one of them
for it), its result unused, until the next token takes it. So tokens leaving and joining cost no regrouping of
the states, the policy's memory or the attention index of the places that stay, and a step's shapes never change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models import AttnContext, KVCache, LoopedLM, LoopGroup
from ..policies import ExitPolicy
from ..policies.gate import exit_mass
from ..timing.clocks import PhaseClock
from .hindsight import Hindsight
from .places import PlaceContext
from .probe_cache import ProbeCache
from .records import Token


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
                 window: int | None = None, select: bool = False, weighted: bool = False, freeze: bool = False,
                 probe_cache: ProbeCache | None = None, readout_attends: bool = True, defer_carry: bool = False,
                 places: int | None = None, late: bool = False, trash_slot: int | None = None):
        self.model, self.index, self.group, self.policy, self.clock = model, index, group, policy, clock
        # Fixed places (continuous depth batching): one token per place, the places never compacted. Only for a
        # rule that decides each token on its own as it runs (not under select, freeze or weighted, whose tokens
        # all run to max_steps, nor the oracle), which is where tokens leave at different steps.
        self.places = places
        self._place_context: PlaceContext | None = None
        # Where a free place writes: the loop layers' spare slot (`trash_slot`, past max_steps: a free place sits
        # at that iteration, and leaving costs no write to the place context), where only loop layers see the
        # places' context; else the cache's spare position (places.py), for every layer a place reaches.
        self.trash_slot = trash_slot
        # Horizon late (ExitConfig.horizon): exits decided on the signals of the iteration before.
        self.late = late
        self._late_host: torch.Tensor | None = None
        self._late_event = None
        # An early exit's deepest entry is carried to the later slots for the later tokens of its row. When a
        # row has no later token in flight until the caller says so (generation: a row's next token waits for
        # this one's output), the carries wait too and go as one (`carry`), not one per step with exits.
        self.defer_carry = defer_carry
        self.carries: list[tuple[int, int, int]] = []  # (row, position, last slot) not yet carried
        # Scoring, a readout that attends to other tokens reads them in the probe's own world (probe_cache.py);
        # one that attends to none (norm and head, an empty coda) needs no context, which costs a token-mode
        # index per step to build.
        self.probe_cache = probe_cache
        self.readout_attends = bool(readout_attends)
        # Exit mode `select` (Ouro's own semantics): every token runs all K iterations, writing every entry; the
        # rule only chooses which iteration's state is the group's output. Nothing is saved, nothing carried.
        self.select = select
        # Exit mode `freeze` (IBM vLLM-Hook's vLLM executor): every token stays to K too, but from the iteration
        # its rule chose its state is pinned: its attention layers keep writing entries from the pinned state,
        # its MLPs are skipped (`LoopGroup.frozen_step`). Under both, the rule's choice is held until K.
        self.freeze = freeze
        self.hold = select or freeze
        # Exit mode `weighted` (Ouro's use_weighted_exit): every token runs all K iterations and its output is
        # Σ_t p_t · logits_t under the exit distribution of the model's gate, the last step taking what is left.
        self.weighted = weighted
        self.readout_steps, self.probe_is_final, self.record = readout_steps, probe_is_final, record_signals
        self.batch = batch
        self.K = policy.max_steps
        self.window = window
        # A retrospective rule (the oracle) decides after the whole trajectory: its record of it, apart.
        # (Under `select` the iterations past an exit are the token's own: no window entries to put back.)
        self.hindsight = Hindsight(model, group, policy, None if select else window) if policy.retrospective \
            else None
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
        self.record_of: dict[str, torch.Tensor] = {}  # per place: the hindsight's record of every iteration
        self._where: dict | None = None  # where the tokens in flight sit (`_placement`)

    def __len__(self) -> int:
        return self.count

    # ---- joining ----------------------------------------------------------------------------------------------
    def free_places(self) -> int | None:
        """How many more tokens a table of fixed places takes now (None: no limit, the table grows)."""
        return None if self.places is None else self.places - self.count

    def add(self, tokens: list[Token], x: torch.Tensor, s0: torch.Tensor) -> None:
        """Tokens start their loops at states s0 with group inputs x (both (m, 1, d)), in free places first."""
        if self.places is not None:
            return self._add_to_places(tokens, x, s0)
        memory = self.policy.start(s0[:, 0], self.vocab)
        if self.late:  # (a token's first iteration has no decision before it: `defined` reads iteration 0)
            memory = {**memory, "_late": torch.zeros(len(tokens), dtype=torch.float64, device=s0.device)}
        if self.weighted:  # the mixture so far and the probability mass not yet given to a step
            memory = {**memory, "mixture": torch.zeros(len(tokens), self.vocab, device=s0.device),
                      "remaining": torch.ones(len(tokens), device=s0.device)}
        record = self.hindsight.start(tokens, s0) if self.hindsight else {}
        free = [j for j, t in enumerate(self.tokens) if t is None][: len(tokens)]
        step = self.clock.steps_so_far(self.index)
        if self.count == 0:  # every place is free: start the table afresh, no scatter (and no write into
            # the last tensors, which the tokens that left may still hold as their states)
            self.tokens, self.k, self.streak, self.trace, self.joined, self.count = [], [], [], [], [], 0
            self.s = self.x = None
            self.memory, self.record_of = {}, {}
            free = []
        if free:
            at = torch.tensor(free, device=s0.device)
            m = len(free)
            self.s[at], self.x[at] = s0[:m], x[:m]
            for name, value in memory.items():
                self.memory[name][at] = value[:m]
            for name, value in record.items():
                self.record_of[name][at] = value[:m]
            for j, token in zip(free, tokens):
                self.tokens[j], self.k[j], self.streak[j], self.trace[j], self.joined[j] = token, 0, 0, [], step
        rest = len(free)
        if rest < len(tokens):
            grow = lambda old, new: new[rest:] if old is None else torch.cat([old, new[rest:]])  # noqa: E731
            self.s, self.x = grow(self.s, s0), grow(self.x, x)
            self.memory = {name: grow(self.memory.get(name), value) for name, value in memory.items()}
            self.record_of = {name: grow(self.record_of.get(name), value) for name, value in record.items()}
            added = tokens[rest:]
            self.tokens += added
            self.k += [0] * len(added)
            self.streak += [0] * len(added)
            self.trace += [[] for _ in added]
            self.joined += [step] * len(added)
        self.count += len(tokens)
        self._where = None

    def _add_to_places(self, tokens: list[Token], x: torch.Tensor, s0: torch.Tensor) -> None:
        """Fixed places: each token into a free place, its row's own where that is free (so a batch whose rows
        all loop is in row order, and a step at one position and iteration reads one slice of the cache)."""
        if len(tokens) > self.places - self.count:
            raise AssertionError(f"{len(tokens)} tokens for {self.places - self.count} free places")
        memory = self.policy.start(s0[:, 0], self.vocab)
        if self.s is None:  # the first tokens: every place made at once, the ones not taken free
            P = self.places
            self.s, self.x = s0.new_zeros(P, *s0.shape[1:]), x.new_zeros(P, *x.shape[1:])
            self.memory = {name: value.new_zeros(P, *value.shape[1:]) for name, value in memory.items()}
            self.tokens, self.k, self.streak, self.trace, self.joined = [None] * P, [0] * P, [0] * P, \
                [[] for _ in range(P)], [0] * P
        free = {j for j, t in enumerate(self.tokens) if t is None}
        places = []
        for token in tokens:
            j = token.row if token.row in free else min(free)
            free.discard(j)
            places.append(j)
        at = torch.as_tensor(places, device=s0.device)
        self.s.index_copy_(0, at, s0)
        self.x.index_copy_(0, at, x)
        for name, value in memory.items():
            self.memory[name].index_copy_(0, at, value)
        step = self.clock.steps_so_far(self.index)
        for j, token in zip(places, tokens):
            self.tokens[j], self.k[j], self.streak[j], self.trace[j], self.joined[j] = token, 0, 0, [], step
        self.count += len(tokens)
        if self._place_context is not None:
            self._place_context.join(places, [t.row for t in tokens], [t.position for t in tokens])

    # ---- one iteration ----------------------------------------------------------------------------------------
    def step(self, cache: KVCache) -> Leaving | None:
        """One iteration for every token in flight; the tokens that exit after it leave."""
        if self.count < len(self.tokens) and self.places is None:
            self._compact()
        n = self.count
        blocks = self._blocks(cache) if self.places is None else None
        ctx = None if blocks else self._context(cache)
        started = self.clock.start()
        keep = self._active() if self.freeze else None
        if blocks:
            self.s = self._step_blocks(blocks, keep)
        else:
            self.s = self.group.step(self.s, self.x, ctx) if keep is None else \
                self.group.frozen_step(self.s, self.x, ctx, keep)
        self.clock.step(started, "core", self.index, n)
        # (a free place stays where it is: at iteration 0, writing to the spare position, or at the spare slot;
        # no rule lets a token leave before its first iteration, or the place decide anything past max_steps)
        self.k = [k + 1 for k in self.k] if self.count == len(self.tokens) else \
            [k + 1 if t is not None else k for k, t in zip(self.k, self.tokens)]
        started = self.clock.start()
        if self.hindsight:
            self.hindsight.keep_entries(self.record_of, self.tokens, self.k, cache)
        # A block step's contexts are chunks; a readout reads each token at its own position (built only for
        # a rule that decodes).
        ran = [max(k - 1, 0) for k in self.k]
        logits, leave = self._probe(lambda: ctx if ctx is not None else self._context(cache, at=ran), blocks)
        self.clock.step(started, "probe", self.index, n)
        if not any(leave):
            return None
        return self._leave(leave, logits, cache)

    def _probe(self, context: Callable[[], AttnContext], blocks: tuple[AttnContext, int] | None = None
               ) -> tuple[torch.Tensor | None, list[bool]]:
        """Signals and the exit decision: which tokens leave after this iteration."""
        policy = self.policy
        if self.weighted:
            return self._mix(context()), [k >= self.K for k in self.k]
        if policy.signal_free:
            if self.record:
                for trace, k, token in zip(self.trace, self.k, self.tokens):
                    if token is not None:
                        trace.append(float(k))
            return None, [k >= self.K for k in self.k]
        logits = self._readout(context, blocks) if self.decodes else None
        if self.hindsight:
            self.hindsight.record(self.record_of, self.s, self.k, logits)
            return logits, [k >= self.K for k in self.k]
        signal = policy.probe_signal(self.s[:, 0], self.memory, logits)
        if self.late:  # the rule's decision at the previous iteration, acted on now (horizon late)
            ruled, values = [k - 1 for k in self.k], self._late_values(signal)
            now = signal.tolist() if self.record or policy.counts_stalls else []
        else:
            ruled = self.k
            values = now = signal.tolist()  # the iteration's one host read
        if policy.defined_from > 1 or self.late:  # (iteration 0: a token's first, with no decision before it)
            values = policy.read(ruled, values)
            now = policy.read(self.k, now) if self.late else values
        if self.record:
            for trace, v, token in zip(self.trace, now, self.tokens):
                if token is not None:
                    trace.append(v)
        leave = policy.decide_wave(self.tokens, ruled, values, self.streak) if policy.ranks_positions else \
            policy.decide(ruled, values, self.streak)
        if self.late:
            leave = [out or k >= self.K for out, k in zip(leave, self.k)]
        if self.count < len(self.tokens):  # a free place has no token to leave
            leave = [out and t is not None for out, t in zip(leave, self.tokens)]
        if policy.counts_stalls:
            for token, k, v in zip(self.tokens, self.k, now):
                # at the cap without the rule's own exit (under `select`, none chosen earlier either)
                if token is not None and k >= max(self.K, policy.defined_from) and token.selected is None \
                        and policy.stalled(v):
                    token.stalled = True
        return (logits, self._select(leave, logits)) if self.hold else (logits, leave)

    def _late_values(self, signal: torch.Tensor) -> list[float]:
        """Horizon late: the signals of the iteration before, as the host has them now, and this iteration's kept
        for the next. Fixed places keep them in a host buffer filled as they are made (on a GPU a copy to pinned
        memory, then an event), so reading them after the next iteration is launched waits for that copy alone,
        not for the iteration: the device never idles on the host. A table that regroups its tokens keeps them
        with the policy's memory, which moves with the tokens, and reads them the next time."""
        if self.places is None:
            previous = self.memory["_late"]
            self.memory["_late"] = signal.to(previous.dtype)
            return previous.tolist()
        if self._late_host is None:
            self._late_host = torch.zeros(self.places, dtype=torch.float64, pin_memory=signal.is_cuda)
        if self._late_event is not None:
            self._late_event.synchronize()
        values = self._late_host.tolist()
        self._late_host.copy_(signal, non_blocking=signal.is_cuda)
        if signal.is_cuda:
            self._late_event = torch.cuda.Event()
            self._late_event.record()
        return values

    def _readout(self, context: Callable[[], AttnContext], blocks: tuple[AttnContext, int] | None) -> torch.Tensor:
        """Every token's logits "if it exited now", (n, V)."""
        if self.probe_cache is not None:
            return self.probe_cache.readout(self.s, self.tokens, self.k, blocks, context)
        ctx = context() if self.readout_attends else AttnContext()
        return self.model.readout(self.index, self.s, ctx, self.readout_steps)[:, 0]

    def _mix(self, ctx: AttnContext) -> torch.Tensor:
        """Exit mode `weighted`: add this iteration's logits under its exit probability; the mixture so far."""
        logits = self.model.readout(self.index, self.s, ctx, self.readout_steps)[:, 0].float()
        lam = torch.sigmoid(self.group.gate(self.s[:, 0]))
        last = torch.tensor([k >= self.K for k in self.k], device=lam.device)
        p, self.memory["remaining"] = exit_mass(lam, self.memory["remaining"], last)
        self.memory["mixture"] = self.memory["mixture"] + p.unsqueeze(1) * logits
        return self.memory["mixture"]

    def _select(self, leave: list[bool], logits: torch.Tensor | None) -> list[bool]:
        """Exit modes `select` and `freeze`: a token the rule lets go keeps its state (and readout) of that
        iteration and runs on (under freeze, pinned there); tokens leave at K only."""
        final = logits is not None and self.probe_is_final
        for j, (token, out) in enumerate(zip(self.tokens, leave)):
            if out and token.selected is None:
                token.selected = (self.k[j], self.s[j].clone(), logits[j].clone() if final else None)
        return [k >= self.K for k in self.k]

    # ---- where tokens leave -----------------------------------------------------------------------------------
    def _leave(self, leave: list[bool], logits: torch.Tensor | None, cache: KVCache) -> Leaving:
        """The tokens marked in `leave` go: their places are freed for the next tokens of their rows."""
        gone = [j for j, out in enumerate(leave) if out]
        tokens = [self.tokens[j] for j in gone]
        steps = [self.k[j] for j in gone]
        # (then the tensors as they are: no gather; fixed places always gather, since the next tokens are
        # written into these very tensors)
        every = len(gone) == len(self.tokens) and self.places is None
        at = None if every else torch.as_tensor(gone, device=self.s.device)
        states = self.s if every else self.s[at]
        exit_logits = (logits if every else logits[at]) if logits is not None and self.probe_is_final else None
        if self.hold:
            steps, states, exit_logits = self._selected(tokens, steps, states, exit_logits)
        if self.hindsight:
            steps, states, exit_logits = self.hindsight.settle(
                {name: value[gone] for name, value in self.record_of.items()}, tokens, cache,
                (lambda st, ctx: self.model.readout(self.index, st, ctx, self.readout_steps)[:, 0])
                if self.probe_is_final else None)
        if self.probe_cache is not None and not self.hold:
            self.probe_cache.exited(tokens, steps)
        end = self.clock.steps_so_far(self.index)
        for token, k, j in zip(tokens, steps, gone):
            token.exit_steps.append(k)
            if self.record:
                token.signals.append(self.trace[j] + [self.policy.padding] * (self.K - len(self.trace[j])))
            self.clock.charge(token.uid, self.index, self.joined[j], end)
            self.tokens[j] = None
            self.k[j] = self.trash_slot if self.trash_slot is not None else 0
        self.count -= len(gone)
        early = [(t, k) for t, k in zip(tokens, steps) if k < self.K]
        # later tokens read an early exit's deepest entry (`latest`); under `select` and `freeze` every entry
        # was written
        kept = [*self.group.attn_layers, *self.group.state_layers]  # keys and what else a position leaves
        if early and kept and not self.hold:
            self.carries += [(t.row, t.position, k - 1) for t, k in early]
            if not self.defer_carry:
                self.carry(cache)
        if self.places is None:
            self._where = None
        elif self._place_context is not None and self.trash_slot is None:
            self._place_context.leave(gone)
        return Leaving(tokens, states, exit_logits)

    def carry(self, cache: KVCache) -> None:
        """Carry the exited tokens' deepest entries forward (`KVCache.carry_forward`), all waiting ones at once;
        a deferring caller calls it before any of their rows' later tokens reads the loop's keys."""
        if self.carries:
            rows, positions, last_slots = zip(*self.carries)
            cache.carry_forward([*self.group.attn_layers, *self.group.state_layers], rows, positions, last_slots)
            self.carries = []

    def _selected(self, tokens: list[Token], steps: list[int], states: torch.Tensor,
                  logits: torch.Tensor | None) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """Exit mode `select`, tokens leaving at K: each one's chosen iteration, state and readout instead."""
        steps, states = list(steps), states.clone()
        logits = logits.clone() if logits is not None else None
        for i, token in enumerate(tokens):
            if token.selected is not None:
                steps[i], states[i], chosen_logits = token.selected
                if logits is not None and chosen_logits is not None:
                    logits[i] = chosen_logits
                token.selected = None
        return steps, states, logits

    def _active(self) -> torch.Tensor | None:
        """Exit mode `freeze`: the places whose tokens the rule has not let go yet, or None when that is all."""
        keep = [j for j, token in enumerate(self.tokens) if token.selected is None]
        return None if len(keep) == len(self.tokens) else torch.tensor(keep, dtype=torch.long, device=self.s.device)

    def _compact(self) -> None:
        """Drop the free places (a row with no next token left them) so steps run on tokens only."""
        keep = [j for j, t in enumerate(self.tokens) if t is not None]
        at = torch.as_tensor(keep, dtype=torch.long, device=self.s.device)
        self.s, self.x = self.s[at], self.x[at]
        self.memory = {name: value[at] for name, value in self.memory.items()}
        self.record_of = {name: value[at] for name, value in self.record_of.items()}
        for name in ("tokens", "k", "streak", "trace", "joined"):
            setattr(self, name, [getattr(self, name)[j] for j in keep])
        self._where = None

    # ---- attention context ------------------------------------------------------------------------------------
    def _placement(self) -> dict:
        """Where the tokens in flight sit, worked out once per membership: the lockstep position (every row at
        one position), the token-mode context once built, and the runs of consecutive positions per row."""
        if self._where is None:
            rows = [t.row for t in self.tokens]
            positions = [t.position for t in self.tokens]
            lockstep = rows == list(range(self.batch)) and min(positions) == max(positions)
            self._where = {"position": positions[0] if lockstep else None, "tokens": None,
                           "runs": positions_runs(rows, positions),
                           # a depth-major wave (several tokens of a row, entered and iterating together)
                           "by_row": len(set(rows)) < len(rows)}
        return self._where

    def _context(self, cache: KVCache, at: list[int] | None = None) -> AttnContext:
        """Where the tokens in flight read and write this iteration (`at`: these iterations, 0-based, instead
        of the one each token runs next): their rows, positions and slots."""
        if self.places is not None:
            return self._places_at(cache, self.k if at is None else at)
        where, k = self._placement(), self.k if at is None else at
        same_iteration = min(k) == max(k)
        if where["position"] is not None and same_iteration:
            return AttnContext(start=where["position"], cache=cache, iteration=k[0])  # rows in lockstep: a chunk
        if where["tokens"] is None:  # (also in lockstep, when iterations differ)
            where["tokens"] = AttnContext.tokens(cache, [t.row for t in self.tokens],
                                                 [t.position for t in self.tokens], iteration=None,
                                                 by_row=where["by_row"])
        if same_iteration:
            return where["tokens"].at_iteration(k[0])
        return where["tokens"].at_iteration(torch.tensor(k, device=cache.device), host=k)

    def _places_at(self, cache: KVCache, k: list[int]) -> AttnContext:
        """`_context` of fixed places: the place context (places.py), at one iteration where every token is at
        it (free places too, writing to the unread column of that slot), else at each place's own."""
        if self._place_context is None:
            self._place_context = PlaceContext(cache, self.places)
            held = [(j, t) for j, t in enumerate(self.tokens) if t is not None]
            self._place_context.join([j for j, _ in held], [t.row for _, t in held], [t.position for _, t in held])
        places = self._place_context
        full = self.count == len(self.tokens)
        held = k if full else [i for i, t in zip(k, self.tokens) if t is not None]
        # (free places at the spare slot run at their own iteration, never at the tokens' one)
        same_iteration = min(held) == max(held) and (full or self.trash_slot is None)
        position = places.lockstep(full)
        if position is not None and same_iteration:
            return AttnContext(start=position, cache=cache, iteration=held[0])  # rows in lockstep: a chunk
        if same_iteration:
            return self._in_place(cache, places.context().at_iteration(held[0]), k)
        return self._in_place(cache, places.context().at_iteration(torch.tensor(k, device=cache.device), host=k), k)

    def _in_place(self, cache: KVCache, ctx: AttnContext, k: list[int]) -> AttnContext:
        """`ctx` with each place's own keys named, where the cache reads them in place (KVCache.reads_in_place):
        from the host's lists, so no device read. A compiled step gathers inside its graph instead, and a dense
        index at one slot already reads slices of the store."""
        index = ctx.index
        if index.slot is not None or self.group.compiled or not cache.reads_in_place(index.length):
            return ctx
        ctx.index = cache.in_place(index, [(j, t.row, t.position, i)
                                           for j, (t, i) in enumerate(zip(self.tokens, k)) if t is not None])
        return ctx

    def _blocks(self, cache: KVCache) -> tuple[AttnContext, int] | None:
        """A depth-major wave at one iteration whose rows hold runs of one shape: its chunk context and rows."""
        if min(self.k) != max(self.k):
            return None
        return uniform_chunk(self._placement()["runs"], self.batch, cache, self.k[0])

    def _step_blocks(self, blocks: tuple[AttnContext, int], keep: torch.Tensor | None = None) -> torch.Tensor:
        ctx, rows = blocks
        # (a state may be wider than the group's input: HRM-Text's holds its two levels side by side)
        s, x = self.s.view(rows, -1, self.s.shape[-1]), self.x.view(rows, -1, self.x.shape[-1])
        # (places are the block rows' positions in order, so `keep` indexes the flattened blocks as it is)
        out = self.group.step(s, x, ctx) if keep is None else self.group.frozen_step(s, x, ctx, keep)
        return out.reshape(-1, 1, out.shape[-1])


def uniform_chunk(runs: list[tuple[int, int, int, int]] | None, batch: int, cache: KVCache, iteration: int = 0
                  ) -> tuple[AttnContext, int] | None:
    """When every row's tokens are one run of consecutive positions, all of one start and length: one chunk
    context for them all (a prefill's attention, no per-token key gather) and the number of rows. Runs of
    several shapes would need a call each, every layer dispatched once per row: None, and the token path
    (`KVCache.attend_by_row`) runs the layers once for all of them."""
    if runs is None or len({(start, hi - lo) for lo, hi, _, start in runs}) > 1:
        return None
    rows = [row for _, _, row, _ in runs]
    index = None if rows == list(range(batch)) else torch.tensor(rows, device=cache.device)
    return AttnContext(start=runs[0][3], cache=cache, rows=index, iteration=iteration), len(runs)


def positions_runs(rows: list[int], positions: list[int]) -> list[tuple[int, int, int, int]] | None:
    """(first place, end place, row, first position) of each row's run of consecutive positions, when every row
    holds one run and some run holds several tokens (a depth-major wave); else None."""
    runs: list[tuple[int, int, int, int]] = []
    lo = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] or positions[i] != positions[i - 1] + 1:
            runs.append((lo, i, rows[lo], positions[lo]))
            lo = i
    if len({row for _, _, row, _ in runs}) < len(runs) or all(hi - lo == 1 for lo, hi, _, _ in runs):
        return None
    return runs
