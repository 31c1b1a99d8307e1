"""The adaptive recurrence: every scored or generated token runs its own loop and exits on its own.

How a run moves:
- A run has B rows, each serving one request at a time; when a request is done its row takes the next one
  (continuous batching), so the rows stay full until the queue runs dry.
- A request's prefix whose outputs nobody scores is prefilled at full depth, all positions at once (or, with
  `prefill="exit"`, token by token with exits like everything else). A prefix-LM's prompt (`model.prefix_lm`:
  a scoring request's context, a generation's prompt) is one bidirectional block (unless `causal_prompt` reads it
  causally, as lm-eval's hf model does), so the prefill runs all of it, its last position too; that position then
  runs again with exits as the first scored one, reading the block as its causal self would (the last member of a
  block sees exactly what causal attention gives it).
- From then on each row advances on its own: it holds one token in flight; when that token has left the last
  loop group the row moves to its next position while the other rows' tokens keep iterating. Every tick, each
  loop group runs one iteration for whatever tokens are in it (`TokenLoop`), whatever their rows, positions
  and iterations: a batch costs what its tokens' iterations cost, not what its slowest row's do.
- A token that exits at iteration e has its KV entries at e copied into the slots above e: a later token
  reading iteration i > e of that layer sees the exited token's deepest entry (Huginn's `latest`). With a KV
  window (`kv_window`) each loop layer keeps c slots, reused every c iterations (models/cache.py has the rule).
- Rows never see each other, and each position's initial-state noise depends only on (seed, position), so a
  batched run gives the answers of a batch-size-1 run, up to float rounding that the batch shape moves:
  batching is a speed choice, never a change of answer.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import ExitbenchError
from ..models import AttnContext, LoopedLM
from ..runtime.validation import at_least
from .config import ExitConfig
from .flops import FlopModel
from .loop import Leaving, TokenLoop, positions_runs, uniform_chunk
from .noise import PositionNoise
from .probe_cache import ProbeCache
from .records import SequenceResult, Token, TokenRecord
from .timing import PHASES, PhaseClock
from .waves import DepthMajor, block_positions, depth_major_blocker

# consume(request, position, log-probabilities (V,), their argmax, the log-probability of the target (scoring)
# or of the argmax (generation)) -> the next input token, or None when the request is done
Consume = Callable[[int, int, torch.Tensor, int, float], "int | None"]
# Tokens whose outputs wait to be computed together (teacher-forced runs): enough to fill a batched head,
# few enough that their logits stay small.
DEFERRED_BATCH = 256


@dataclass
class Request:
    """One sequence: positions start … end produce consumed outputs; `first` is where exits begin (start under
    prefill="full", 0 under prefill="exit"); the first `block` positions are a prefix-LM's bidirectional prompt
    (0: none)."""

    index: int
    tokens: list[int]
    first: int
    start: int
    end: int
    block: int = 0


SCHEDULES = ("auto", "depth_major", "token_major")


class ExitEngine:
    def __init__(self, model: LoopedLM, config: ExitConfig | None = None, schedule: str = "auto"):
        """`schedule`: how teacher-forced requests run, "depth_major" (a sequence's positions together, one wave
        per iteration: exitbench.engine.waves), "token_major" (one position in flight per row), or "auto":
        depth-major wherever it is exact. Generation is always token by token."""
        self.model = model.eval()
        self.config = config or ExitConfig()
        if schedule not in SCHEDULES:
            raise ExitbenchError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.groups = model.loop_groups()
        if not self.groups:
            raise ExitbenchError(f"{model.architecture} model has no loop group: nothing to exit from")
        self.policies = self.config.bound_policies(self.groups)
        if self.config.exit_mode == "weighted" and (len(self.groups) != 1 or self.groups[0].gate is None
                                                    or model.stages()[-1] is not self.groups[0]):
            raise ExitbenchError(f"exit_mode weighted averages the readouts of one loop group under its trained exit "
                                 f"gate; this {model.architecture} model has no such group (Ouro's models do)")
        if self.config.warm_start and not all(g.injects_input for g in self.groups):
            raise ExitbenchError(f"warm_start starts a token from the previous token's final state, but this "
                                 f"{model.architecture} model's loop reads the token's input only as its start state, "
                                 f"so the token would be lost; warm_start needs a loop that injects its input (Raven's)")
        if self.config.causal_prompt and not model.prefix_lm:
            raise ExitbenchError(f"causal_prompt reads a prefix-LM's prompt causally, and this {model.architecture} "
                                 "model reads every prompt causally already; drop it")
        # A prefix-LM's prompt is one bidirectional block, unless the config reads it causally (as lm-eval's hf does).
        self.prompt_block = model.prefix_lm and not self.config.causal_prompt
        if self.prompt_block and self.config.prefill == "exit":
            raise ExitbenchError(f"prefill exit runs a prompt token by token with exits, but this {model.architecture} "
                                 f"model reads its prompt as one bidirectional block (prefix_lm); use prefill full, "
                                 "or causal_prompt")
        if self.config.exit_mode == "freeze" and any(g.frozen_step is None for g in self.groups):
            raise ExitbenchError(f"exit_mode freeze runs a loop group's MLPs for its active tokens only; this "
                                 f"{model.architecture} model's loop groups have no such step")
        for g, p in zip(self.groups, self.policies):
            if p.max_steps > g.max_steps:
                raise ExitbenchError(f"{p.name}: max_steps={p.max_steps} exceeds the {g.name} group's maximum of "
                                     f"{g.max_steps} iterations (the checkpoint's configured maximum)")
        # Where each loop group sits among the stages: the plain stretches between them run as a walk.
        stages = model.stages()
        self.bounds = [next(i for i, st in enumerate(stages) if st is g) for g in self.groups]
        # A probe reads out the later groups at their default depth, capped where this run's policy caps them
        # (the cache has no slot past a group's max_steps).
        self.readout_steps = [min(g.default_steps, p.max_steps) for g, p in zip(self.groups, self.policies)]
        # The attention layers each group's readout runs (none: it reads no other token).
        self.readout_layers = [model.readout_attention(g) for g in range(len(self.groups))]
        self.noise = PositionNoise(self.config.seed, self._state_dim())
        self.flops = FlopModel(model, self.readout_steps)
        # Seconds per phase and in all, tokens recorded, and loop steps run (batched iterations: with rows
        # advancing on their own, the steps a run takes are what its time follows on a dispatch-bound device).
        self.stats: dict[str, float] = dict.fromkeys((*PHASES, "wall", "tokens", "steps"), 0.0)
        blocker = depth_major_blocker(self)
        if schedule == "depth_major" and blocker is not None:
            raise ExitbenchError(f"schedule depth_major is not exact here ({blocker}); use auto or token_major")
        # What teacher-forced requests run as; the reason when it is not depth-major.
        self.scoring_schedule = "token_major" if schedule == "token_major" or blocker else "depth_major"
        self.schedule_note = blocker

    def _state_dim(self) -> int:
        return self.model.embed(torch.zeros(1, 1, dtype=torch.long, device=self.model.device)).shape[-1]

    # ---- public entry points ---------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, requests: Sequence[tuple[Sequence[int], int]], keep_distributions: bool = False,
              batch_size: int | None = None, on_request: Callable[[int], None] | None = None
              ) -> list[SequenceResult]:
        """Teacher-forced log-probabilities of tokens[n_context:] for each (tokens, n_context) request, with
        `batch_size` rows (default: one per request); `on_request(n)` hears each time n requests are done.

        The outputs at positions n_context−1 … len−2 predict the scored tokens, so those positions run with
        exits; positions before them are the prefill.
        """
        for tokens, n_ctx in requests:
            if not 1 <= n_ctx < len(tokens):
                raise ExitbenchError(f"a scoring request needs 1 ≤ n_context < len(tokens), got {n_ctx}, {len(tokens)}")
        reqs = [self._request(i, list(t), n - 1, len(t) - 2) for i, (t, n) in enumerate(requests)]
        results = [SequenceResult([], [], [], distributions=[] if keep_distributions else None) for _ in reqs]

        def consume(i: int, pos: int, logp: torch.Tensor, top: int, picked: float) -> int:
            target = reqs[i].tokens[pos + 1]
            res = results[i]
            if keep_distributions:
                res.distributions.append(logp.cpu())
            res.tokens.append(target)
            res.logprobs.append(picked)
            res.greedy.append(top == target)
            return target

        self._run(reqs, consume, results, teacher_forced=True, batch_size=batch_size, on_request=on_request)
        return results

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None, batch_size: int | None = None,
                 on_request: Callable[[int], None] | None = None) -> list[SequenceResult]:
        """Greedy continuation of each prompt, each new token with its own exit; stops at a stop id, when
        `stop(index, generated)` says so, or after max_new_tokens. Rows and `on_request` as in `score`."""
        if max_new_tokens < 1:
            raise ExitbenchError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ExitbenchError("generation needs a non-empty prompt (at least a BOS token)")
        reqs = [self._request(i, list(p), len(p) - 1, len(p) - 2 + max_new_tokens) for i, p in enumerate(prompts)]
        results = [SequenceResult([], [], []) for _ in reqs]
        stop_set = set(stop_ids)

        def consume(i: int, pos: int, logp: torch.Tensor, top: int, picked: float) -> int | None:
            res = results[i]
            res.tokens.append(top)
            res.logprobs.append(picked)
            res.greedy.append(True)
            reqs[i].tokens.append(top)
            if top in stop_set:
                res.stopped_by = "stop_id"
                return None
            if stop is not None and stop(i, res.tokens):
                res.stopped_by = "stop"
                return None
            return top

        self._run(reqs, consume, results, teacher_forced=False, batch_size=batch_size, on_request=on_request)
        for res in results:
            res.stopped_by = res.stopped_by or "max_new_tokens"
        return results

    def _request(self, index: int, tokens: list[int], start: int, end: int) -> Request:
        if end + 1 > self.model.config.block_size:
            raise ExitbenchError(f"a sequence needs {end + 1} positions but the model's context is "
                                 f"{self.model.config.block_size}")
        # A prefix-LM's prompt is everything before the first output's input's successor: the context (scoring)
        # or the prompt (generation), start + 1 tokens.
        block = start + 1 if self.prompt_block else 0
        return Request(index, tokens, start if self.config.prefill == "full" else 0, start, end, block)

    # ---- a run: rows serving requests, advancing on their own ----------------------------------------------
    def _run(self, reqs: list[Request], consume: Consume, results: list[SequenceResult], teacher_forced: bool,
             batch_size: int | None, on_request: Callable[[int], None] | None) -> None:
        if not reqs:
            return
        if batch_size is not None:
            at_least("batch_size", batch_size)
        wall = time.perf_counter()
        depth_major = teacher_forced and self.scoring_schedule == "depth_major"
        run = Run(self, reqs, consume, results, teacher_forced, min(batch_size or len(reqs), len(reqs)), on_request,
                  depth_major)
        run.go()
        for phase, seconds in run.clock.totals.items():
            self.stats[phase] += seconds
        self.stats["wall"] += time.perf_counter() - wall
        self.stats["tokens"] += run.n_records
        self.stats["steps"] += run.steps


class WarmStarts:
    """Each row's latest final state per loop group: where its next token starts under warm_start (Huginn
    §6.3). A row without one (its request's first token, with nothing prefilled) starts cold."""

    def __init__(self, groups: int, batch: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.states = [torch.zeros(batch, dim, dtype=dtype, device=device) for _ in range(groups)]
        self.valid = [torch.zeros(batch, dtype=torch.bool, device=device) for _ in range(groups)]

    def forget(self, row: int) -> None:
        for valid in self.valid:
            valid[row] = False

    def remember(self, g: int, rows: torch.Tensor, states: torch.Tensor) -> None:
        self.states[g][rows] = states
        self.valid[g][rows] = True

    def start(self, g: int, rows: torch.Tensor, cold: torch.Tensor) -> torch.Tensor:
        """(n, 1, d) starts: the remembered state where there is one, else `cold`."""
        return torch.where(self.valid[g][rows].view(-1, 1, 1), self.states[g][rows].unsqueeze(1), cold)


class Run:
    """One call of the engine: B rows of one KV cache, the requests they serve, the loops their tokens are in.

    Teacher-forced, every input is known in advance: the stages before the first loop group run once per
    request for all its positions (`inputs`), and tokens whose last exit brought no logits are finished in
    batches, since no later token waits for their outputs.
    """

    def __init__(self, engine: ExitEngine, reqs: list[Request], consume: Consume, results: list[SequenceResult],
                 teacher_forced: bool, rows: int, on_request: Callable[[int], None] | None = None,
                 depth_major: bool = False):
        self.engine, self.model = engine, engine.model
        self.reqs, self.consume, self.results, self.teacher_forced = reqs, consume, results, teacher_forced
        self.B = rows
        capacity = max(r.end for r in reqs) + 1
        self.clock = PhaseClock(self.model.device)
        window = engine.config.kv_window
        self.cache = self.model.new_cache(rows, capacity, [p.max_steps for p in engine.policies], window)
        # (allocated at the first prefill, as wide as the stages before the first loop group leave a position)
        self.inputs: torch.Tensor | None = None
        self.warm = WarmStarts(len(engine.groups), rows, engine.noise.dim, self.model.dtype, self.model.device) \
            if engine.config.warm_start else None
        # Per token's record: under exit modes select and weighted every token ran all K iterations, so its
        # FLOPs are those of K; weighted reads out (probes) at every one of them. Under freeze its attention
        # (and readout) ran all K, its MLPs to its exit only.
        mode = engine.config.exit_mode
        self.ran_all = [p.max_steps for p in engine.policies] if mode in ("select", "weighted", "freeze") else None
        self.freeze = mode == "freeze"
        self.probed = [p.needs_logits or mode == "weighted" for p in engine.policies]
        self.counts_stalls = any(p.counts_stalls for p in engine.policies)
        # Scoring, a readout through stages that attend reads other tokens in its own world, and its logits are
        # then not the token's output (probe_cache.py).
        self.probe_caches = [self._probe_cache(g, depth_major) for g in range(len(engine.groups))]
        self.loops = [TokenLoop(self.model, g, group, policy, self.clock, readout_steps=engine.readout_steps,
                                probe_is_final=g == len(engine.groups) - 1 and self.probe_caches[g] is None,
                                probe_cache=self.probe_caches[g],
                                readout_attends=bool(engine.readout_layers[g]),
                                record_signals=engine.config.record_signals, batch=rows, window=window,
                                select=engine.config.exit_mode == "select",
                                weighted=engine.config.exit_mode == "weighted", freeze=self.freeze,
                                # generation: a row's next token enters after its last one is finished
                                defer_carry=not teacher_forced and not depth_major)
                      for g, (group, policy) in enumerate(zip(engine.groups, engine.policies))]
        # Depth-major: a row's block of positions enters and leaves each loop group together (waves.py).
        self.waves = DepthMajor(self, block_positions(self.model, rows, capacity)) if depth_major else None
        # Token-major scoring defers outputs to batch them; depth-major blocks are batches already.
        self.defer = teacher_forced and not engine.policies[-1].needs_logits and not depth_major
        self.queue = deque(reqs)
        self.serving: list[Request | None] = [None] * rows
        self.next_pos = [0] * rows
        self.idle = [False] * rows  # rows whose next token is ready to enter
        # Rows done with their request: they take their next one together at the next tick, so their prompts'
        # prefills run as one batch (one row at a time, a short answer's run is mostly prefill).
        self.done_rows: list[int] = []
        self.pending: list[Leaving] = []
        self.parked: list[Leaving] = []  # generated tokens out of the loops, their outputs not yet computed
        self.finished: list[tuple[TokenRecord, int]] = []
        self.uids = iter(range(1 << 62))
        self.on_request, self.requests_done = on_request, 0
        self.steps = 0

    def _probe_cache(self, g: int, depth_major: bool) -> ProbeCache | None:
        layers = self.engine.readout_layers[g]
        if not (self.teacher_forced and self.probed[g] and layers):
            return None
        return ProbeCache(self.model, g, self.engine.readout_steps, self.cache, layers,
                          self.engine.policies[g].max_steps, per_iteration=not depth_major)

    @property
    def n_records(self) -> int:
        return len(self.finished)

    def go(self) -> None:
        self.assign(list(range(self.B)))
        while True:
            if self.done_rows:
                self.reassign()
            entering = [b for b in range(self.B) if self.idle[b]]
            if entering:
                self.enter(entering)
            if not any(len(loop) for loop in self.loops) and not self.done_rows:
                break
            for g, loop in enumerate(self.loops):
                if len(loop):
                    self.steps += 1
                    out = loop.step(self.cache)
                    if out is not None:
                        self.leave(g, out)
        if self.pending:
            self.finish(self.pending)
        self.clock.settle()
        for record, uid in self.finished:
            record.time_s = self.clock.take(uid)

    # ---- rows and requests ------------------------------------------------------------------------------------
    def assign(self, rows: list[int]) -> None:
        """Give each row the next request (its prefix prefilled), or leave it empty when none is left."""
        pairs = []
        for b in rows:
            if self.serving[b] is not None:
                self.requests_done += 1
                if self.on_request is not None:
                    self.on_request(self.requests_done)
            self.serving[b] = self.queue.popleft() if self.queue else None
            if self.serving[b] is not None:
                pairs.append((b, self.serving[b]))
                self.next_pos[b] = self.serving[b].first
                self.idle[b] = self.serving[b].first <= self.serving[b].end
                if self.warm is not None:
                    self.warm.forget(b)
        if pairs:
            self.prefill(pairs)

    def reassign(self) -> None:
        """The rows done with their requests take their next ones, in one prefill."""
        rows, self.done_rows = self.done_rows, []
        if any(t.row in rows for out in self.pending for t in out.tokens):
            # Finish the rows' deferred tokens before the next requests' prefill overwrites their keys.
            self.finish(self.pending)
            self.pending = []
        self.assign(rows)

    def advance(self, row: int, position: int) -> None:
        """Row `row` is done with `position`: on to the next one, or (at the next tick) to the next request.
        Depth-major, a row moves on when its block's last position is done."""
        if self.waves is not None and not self.waves.block_done(row, position):
            return
        req = self.serving[row]
        if position >= req.end:
            self.done_rows.append(row)
        else:
            self.next_pos[row] = position + 1
            self.idle[row] = True

    def prefill(self, pairs: list[tuple[int, Request]]) -> None:
        """The rows' requests' inputs (teacher-forced) and their prefixes [0, first) at full depth: one pass over
        the rows, right-padded. Padding computes junk entries that each row's own tokens overwrite, at every
        slot, before any token of that row reads them."""
        engine, cache = self.engine, self.cache
        started = self.clock.start()
        rows = [b for b, _ in pairs]
        every_row = rows == list(range(self.B))
        index = None if every_row else torch.tensor(rows, device=cache.device)
        blocks = torch.tensor([r.block for _, r in pairs], device=cache.device) if engine.prompt_block else None
        ctx = AttnContext(start=0, cache=cache, rows=index, prefix=blocks)
        if self.teacher_forced:  # everything before the first loop group, for every position
            L = max(r.end + 1 for _, r in pairs)
            ids = self._padded([r.tokens for _, r in pairs], L)
            x = self.model.walk(self.model.embed(ids, 0), ctx, stop=engine.bounds[0])
            if self.inputs is None:
                self.inputs = x.new_zeros(self.B, self.cache.capacity, x.shape[-1])
            self.inputs[rows, :L] = x
        L = max(max(r.first, r.block) for _, r in pairs)
        if L == 0:
            self.clock.stop(started, "prefill", [])
            return
        B = len(pairs)
        done = torch.tensor([j for j, (_, r) in enumerate(pairs) if r.first > 0], device=cache.device)
        last = torch.tensor([r.first - 1 for _, r in pairs if r.first > 0], device=cache.device)

        def keep_final(g: int, k: int, s: torch.Tensor) -> None:
            if self.warm is not None and k == engine.policies[g].max_steps:
                self.warm.remember(g, torch.tensor(rows, device=cache.device)[done], s[done, last])

        def noise(group, x):
            return engine.noise.rows(0, L, x.dtype, x.device).expand(B, -1, -1) if group.random_init else None

        depths = [p.max_steps for p in engine.policies]
        if self.teacher_forced:
            self.model.walk(self.inputs[rows, :L], ctx, depths, start=engine.bounds[0], noise=noise,
                            on_state=keep_final)
        else:
            ids = self._padded([r.tokens for _, r in pairs], L)
            self.model.walk(self.model.embed(ids, 0), ctx, depths, noise=noise, on_state=keep_final)
        firsts = [(b, r.first) for b, r in pairs if r.first > 0]
        for probes in self.probe_caches:
            if probes is not None:
                probes.copy_prefix(cache, firsts)
        self.clock.stop(started, "prefill", [])

    def _padded(self, seqs: list[list[int]], length: int) -> torch.Tensor:
        return torch.tensor([s[:length] + [0] * (length - len(s[:length])) for s in seqs], device=self.cache.device)

    # ---- tokens in and out of the loops -----------------------------------------------------------------------
    def enter(self, rows: list[int]) -> None:
        """The rows' next tokens into the first loop group: their inputs, known in advance or run now
        (embedding and the plain stages before the group)."""
        tokens = self.waves.tokens(rows) if self.waves is not None else self._next_tokens(rows)
        started = self.clock.start()
        if self.inputs is not None:
            at = torch.tensor([t.row * self.inputs.shape[1] + t.position for t in tokens], device=self.cache.device)
            x = self.inputs.view(-1, self.inputs.shape[-1]).index_select(0, at).unsqueeze(1)
        else:
            ctx = self._context(tokens)
            ids = torch.tensor([[self.reqs[t.request].tokens[t.position]] for t in tokens], device=self.cache.device)
            x = self.model.walk(self.model.embed(ids, ctx.start, ctx.positions), ctx, stop=self.engine.bounds[0])
        s0 = self._start_states(0, tokens, x)
        self.clock.stop(started, "prelude", [t.uid for t in tokens])
        self.loops[0].add(tokens, x, s0)

    def _next_tokens(self, rows: list[int]) -> list[Token]:
        """Token-major: each row's next position, one token per row."""
        tokens = []
        for b in rows:
            req, pos = self.serving[b], self.next_pos[b]
            tokens.append(Token(next(self.uids), b, pos, req.tokens[pos + 1] if self.teacher_forced else None,
                                pos >= req.start, request=req.index))
            self.idle[b] = False
        return tokens

    def leave(self, g: int, out: Leaving) -> None:
        """Tokens left loop group g: on to the next group, or (after the last) to their outputs. Depth-major,
        a row's block goes on once all of its positions have left."""
        if self.waves is not None:
            out = self.waves.complete(g, out)
            if out is None:
                return
        if self.warm is not None:
            self.warm.remember(g, torch.tensor([t.row for t in out.tokens], device=self.cache.device),
                               out.states[:, 0])
        if g + 1 < len(self.loops):
            self.hand_over(g, out)
        elif self.defer:
            self.pending.append(out)
            for token in out.tokens:  # its row moves on now; its output is computed later, in a batch
                self.advance(token.row, token.position)
            if sum(len(o.tokens) for o in self.pending) >= DEFERRED_BATCH:
                self.finish(self.pending)
                self.pending = []
        elif self.teacher_forced:
            self.finish([out])
        else:
            # Generation: a token's output is its row's next input, so its row waits until it is finished.
            # Exited tokens wait to be finished together as the `refill` knob says: one coda, head and next-token
            # entry for many, and one regrouping of the tokens in flight, instead of one per step whose exits
            # spread (docs/engine.md, what a step costs). The same outputs under every refill. Scoring keeps
            # finishing at once: finished later, a decoding rule's scored log-probabilities moved (depth-major
            # against token-major, contraction on the Ouro layout, tests/test_depth_major.py), and a scored row's
            # next input is known in advance anyway.
            self.parked.append(out)
            if self.refill_due():
                for loop in self.loops:  # before the rows' next tokens (or next requests' prefills) read them
                    loop.carry(self.cache)
                self.finish(self.parked)
                self.parked = []

    def refill_due(self) -> bool:
        """Whether the exited generated tokens are finished now (their rows take their next tokens)."""
        refill = self.engine.config.refill
        if refill == "eager":
            return True
        looping = sum(len(loop) for loop in self.loops)
        if refill == "wave":
            return looping == 0
        return sum(len(o.tokens) for o in self.parked) >= looping

    def hand_over(self, g: int, out: Leaving) -> None:
        """Tokens that left loop group g: its finish and the plain stages up to the next group, into its loop."""
        engine = self.engine
        started = self.clock.start()
        x = self._walk(engine.groups[g].finish(out.states), out.tokens, engine.bounds[g] + 1, engine.bounds[g + 1])
        s0 = self._start_states(g + 1, out.tokens, x)
        self.clock.stop(started, "coda", [t.uid for t in out.tokens])
        self.loops[g + 1].add(out.tokens, x, s0)

    def finish(self, batches: list[Leaving]) -> None:
        """Tokens that left the last loop group, in the order they left: their next-token log-probabilities
        (the exit probe's readout when it decoded, else the rest of the model and the head), read to the host
        at once, then recorded and consumed."""
        engine = self.engine
        started = self.clock.start()
        tokens = [t for out in batches for t in out.tokens]
        states = torch.cat([out.states for out in batches]) if len(batches) > 1 else batches[0].states
        logits = torch.cat([out.logits for out in batches]) if batches[0].logits is not None else None
        if logits is None:
            g = len(engine.groups) - 1
            # Several tokens of one row may finish together: each reads the plain stages' entries of the row's
            # earlier positions, written in this same call before any token reads.
            x = self._walk(engine.groups[g].finish(states), tokens, engine.bounds[g] + 1)
            logits = self.model.head(x)[:, 0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.argmax(-1)
        targets = torch.tensor([-1 if t.target is None else t.target for t in tokens], device=logp.device)
        picked = logp.gather(1, torch.where(targets >= 0, targets, top).unsqueeze(1)).squeeze(1)
        # A row's sum is non-finite exactly when the row holds a NaN or an infinity (float32 logits would need a
        # total magnitude past 3e38 to overflow): one reduction, not an elementwise mask over (n, vocabulary).
        finite = torch.isfinite(states).flatten(1).all(1) & torch.isfinite(logits.sum(-1))
        host = torch.stack([top.double(), picked.double(), finite.double()], 1).tolist()
        self.clock.stop(started, "coda", [t.uid for t in tokens])
        for token, row_logp, (top_j, picked_j, finite_j) in zip(tokens, logp, host):
            token.nonfinite |= not finite_j
            more = True
            if token.consumed:
                self.finished.append((self._record(token), token.uid))
                self.results[token.request].records.append(self.finished[-1][0])
                more = self.consume(token.request, token.position, row_logp, int(top_j), picked_j) is not None
            if not self.defer:  # (deferred rows moved on when their tokens left the loop)
                if more:
                    self.advance(token.row, token.position)
                else:
                    self.done_rows.append(token.row)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _walk(self, x: torch.Tensor, tokens: list[Token], start: int, stop: int | None = None) -> torch.Tensor:
        """The plain stages [start, stop) for tokens (x: (n, 1, d)). A depth-major block whose rows hold runs of
        one shape walks as one chunk; other sets token by token (several of a row: one slice of its keys)."""
        rows, positions = [t.row for t in tokens], [t.position for t in tokens]
        chunk = uniform_chunk(positions_runs(rows, positions), self.B, self.cache)
        if chunk is None:
            return self.model.walk(x, self._context(tokens), start=start, stop=stop)
        ctx, n_rows = chunk
        # (a stage may leave a position wider or narrower than it came: Inkling 2's coda reads packed blocks)
        out = self.model.walk(x.view(n_rows, -1, x.shape[-1]), ctx, start=start, stop=stop)
        return out.reshape(-1, 1, out.shape[-1])

    def _context(self, tokens: list[Token]) -> AttnContext:
        rows = [t.row for t in tokens]
        positions = [t.position for t in tokens]
        if rows == list(range(self.B)) and min(positions) == max(positions):
            return AttnContext(start=positions[0], cache=self.cache)
        return AttnContext.tokens(self.cache, rows, positions, by_row=len(set(rows)) < len(rows))

    def _start_states(self, g: int, tokens: list[Token], x: torch.Tensor) -> torch.Tensor:
        group = self.engine.groups[g]
        noise = self.engine.noise.at([t.position for t in tokens], x.dtype, x.device).unsqueeze(1) \
            if group.random_init else None
        s0 = group.init(x, noise)
        if self.warm is not None:
            s0 = self.warm.start(g, torch.tensor([t.row for t in tokens], device=x.device), s0)
        return s0

    def _record(self, token: Token) -> TokenRecord:
        ran = self.ran_all or token.exit_steps
        mlp = token.exit_steps if self.freeze else ran
        probes = [k if probed else 0 for k, probed in zip(ran, self.probed)]
        return TokenRecord(token.position, token.exit_steps, {},
                           self.engine.flops.token(token.position + 1, ran, probes, mlp_steps=mlp),
                           token.signals if self.engine.config.record_signals else None, token.nonfinite,
                           token.stalled if self.counts_stalls else None,
                           attention_steps=sum(ran), mlp_steps=sum(mlp))
