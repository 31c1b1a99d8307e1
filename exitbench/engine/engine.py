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

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import ExitbenchError
from ..models import AttnContext, LoopedLM
from ..runtime.validation import at_least
from ..timing.clocks import PHASES, PhaseClock
from .config import ExitConfig
from .flops import FlopModel
from .loop import Leaving, TokenLoop, positions_runs, uniform_chunk
from .noise import PositionNoise
from .prefixes import PrefixStore
from .probe_cache import ProbeCache
from .records import SequenceResult, Token, TokenRecord
from .waves import DepthMajor, block_positions, depth_major_blocker

# consume(request, position, log-probabilities (V,) (scoring; None in generation, which reads none), their argmax,
# the log-probability of the target (scoring) or of the argmax (generation)) -> the next input token, or None when
# the request is done
Consume = Callable[[int, int, "torch.Tensor | None", int, float], "int | None"]
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
    def __init__(self, model: LoopedLM, config: ExitConfig | None = None, schedule: str = "auto",
                 prefixes: PrefixStore | None = None):
        """`schedule`: how teacher-forced requests run, "depth_major" (a sequence's positions together, one wave
        per iteration: exitbench.engine.waves), "token_major" (one position in flight per row), or "auto":
        depth-major wherever it is exact. Generation is always token by token. `prefixes`: where prefilled
        prompts are kept for reuse (prefixes.py; the lm-eval model shares one per model)."""
        self.model = model.eval()
        self.config = config or ExitConfig()
        self.prefixes = prefixes
        if schedule not in SCHEDULES:
            raise ExitbenchError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.groups = model.loop_groups()
        if not self.groups:
            raise ExitbenchError(f"{model.architecture} model has no loop group: nothing to exit from")
        self.policies = self.config.bound_policies(self.groups)
        if self.policies[0].drafts:
            raise ExitbenchError(f"{self.config.policy} is no per-token exit: it drafts whole tokens and verifies them "
                                 "at full depth (engine/speculation.py, SpeculativeEngine), in generation only")
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
        layout_problem = model.cache_layout_problem(*self.config.cache_layout())
        if layout_problem:
            raise ExitbenchError(layout_problem)
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
        # The clocks (docs/engine.md, two clocks): `decode_s`, each run's wall-clock without its prefills, and its
        # steady state, the same up to the moment its queue of requests ran dry (`steady_s`; a row then has no
        # request left, and the rows drain), with the token-iterations its loops ran by then (`steady_work`) and
        # the tokens finished by then and their iterations; `work`: token-iterations over the whole run.
        self.stats: dict[str, float] = dict.fromkeys(
            (*PHASES, "wall", "tokens", "steps", "decode_s", "work", "steady_s", "steady_work", "steady_tokens",
             "steady_token_iterations"), 0.0)
        blocker = depth_major_blocker(self)
        if schedule == "depth_major" and blocker is not None:
            raise ExitbenchError(f"schedule depth_major is not exact here ({blocker}); use auto or token_major")
        # What teacher-forced requests run as; the reason when it is not depth-major.
        self.scoring_schedule = "token_major" if schedule == "token_major" or blocker else "depth_major"
        self.schedule_note = blocker
        # A rule that ranks a sequence's positions (the budgeted prefill exit), or None.
        self.budget = next((p for p in self.policies if p.ranks_positions), None)
        if self.budget is not None and self.scoring_schedule != "depth_major":
            raise ExitbenchError(f"{self.budget.name} ranks a sequence's positions at one iteration, which only the "
                                 f"depth-major schedule holds together, and this run scores token-major "
                                 f"({blocker or 'schedule token_major'}); use schedule auto or depth_major")

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
        if self.budget is not None:
            raise ExitbenchError(f"{self.budget.name} ranks the positions of a scored sequence (loglikelihood requests); "
                                 "generation makes one token at a time, with nothing to rank it against: score "
                                 "instead, or choose a rule that decides each token on its own")
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
        for name, value in run.clocks().items():
            self.stats[name] += value


def continuous_depth_batching(engine: ExitEngine, teacher_forced: bool, depth_major: bool, rows: int) -> bool:
    """Whether a run keeps fixed places (refill "continuous"): generation of several rows whose rule decides each
    token as it runs. Under a signal-free rule (fixed depth) every token leaves at max_steps, under select, weighted
    and freeze too, and the oracle settles after max_steps: tokens leave together, and static batching is that
    already; one row holds one token at a time whatever the schedule."""
    config = engine.config
    return (config.refill == "continuous" and rows > 1 and not teacher_forced and not depth_major
            and config.exit_mode is None and all(p.decides_as_it_runs() for p in engine.policies))


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
        # Continuous depth batching (refill "continuous", generation): the loops keep `rows` fixed places, and
        # the run holds `coda_batch` more sequences than places, so that while some wait for their exited tokens'
        # outputs, computed `coda_batch` at a time (`bucket`: one coda, head and next-token input for all of
        # them, not one each), the others fill every place. A loop group that hands its tokens to another keeps
        # no spare rows (its tokens could find the next group's places full).
        self.continuous = continuous_depth_batching(engine, teacher_forced, depth_major, rows)
        self.bucket = engine.config.coda_bucket(rows)
        spare = min(self.bucket, len(reqs) - rows) if self.continuous and len(engine.groups) == 1 else 0
        self.places = rows if self.continuous else None
        rows += spare
        self.B = rows
        # (a fixed-shape step's free places write into the last position, which no token reads)
        capacity = max(r.end for r in reqs) + 1 + (1 if self.continuous else 0)
        self.clock = PhaseClock(self.model.device)
        window, private = engine.config.cache_layout()
        # Free places write to a spare slot past max_steps where only loop layers see their context (no rolling
        # window, no readout that attends), else to the spare position above (loop.py, `trash_slot`).
        spare_slot = self.continuous and window is None and not any(
            p.needs_logits and engine.readout_layers[g] for g, p in enumerate(engine.policies))
        self.cache = self.model.new_cache(rows, capacity, [p.max_steps + spare_slot for p in engine.policies],
                                          window, private)
        # The slots a prefix fills: what the prefix store keys and keeps, so a cell with a spare slot and one
        # without (full depth's) share their prefilled prompts.
        self.prefix_slots = self.model.cache_slots([p.max_steps for p in engine.policies], window, private)
        # Fixed places join tokens a few at a time (one update of the places' context for several), at batch 16
        # two: a place idles a step at most, where joining costs about a tenth of a step each time.
        self.join_min = max(1, rows // 8) if self.continuous else 1
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
                                defer_carry=not teacher_forced and not depth_major, places=self.places,
                                late=engine.config.horizon == "late" and not policy.signal_free,
                                trash_slot=policy.max_steps if spare_slot else None)
                      for g, (group, policy) in enumerate(zip(engine.groups, engine.policies))]
        # Depth-major: a row's block of positions enters and leaves each loop group together (waves.py).
        # (a rule ranking a sequence's positions needs each sequence whole in one block: its selection is the
        # sequence's, never a block's that the batch size sized)
        block = capacity if engine.budget is not None else \
            block_positions(self.model, rows, capacity)
        self.waves = DepthMajor(self, block) if depth_major else None
        # Token-major scoring defers outputs to batch them; depth-major blocks are batches already.
        self.defer = teacher_forced and not engine.policies[-1].needs_logits and not depth_major
        self.queue = deque(reqs)
        self.serving: list[Request | None] = [None] * rows
        self.next_pos = [0] * rows
        self.idle = [False] * rows  # rows whose next token is ready to enter
        # Continuous: each row's next token, staged with its input and start state (`stage`) until a place
        # frees, and when it was (places are taken first come, first served).
        self.staged: dict[int, Token] = {}
        self.staged_x = self.staged_s0 = None
        self.ready_at = [0] * rows
        # Rows done with their request: they take their next ones at the next tick.
        self.done_rows: list[int] = []
        self.pending: list[Leaving] = []
        self.parked: list[Leaving] = []  # generated tokens out of the loops, their outputs not yet computed
        self.finished: list[tuple[TokenRecord, int]] = []
        self.uids = iter(range(1 << 62))
        self.on_request, self.requests_done = on_request, 0
        # (a stored prefix is the weights' as they were: an in-place change of a weight bumps its version)
        self.weights_version = sum(p._version for p in self.model.parameters()) if engine.prefixes else 0
        self.steps = 0
        self.work = 0  # token-iterations the loops ran (tokens in flight, summed over steps)
        self.finished_iterations = 0
        # (mark, work, tokens finished, their iterations) when the queue ran dry; None until it does
        self.dry: tuple[int, int, int, int] | None = None

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
        start = self.clock.mark()
        self.assign(list(range(self.B)))
        if not self.queue:  # (no request ever waits for a row: there is no steady state to time)
            self.dry = (start, 0, 0, 0)
        while True:
            if self.done_rows:
                self.reassign()
            if self.places is None:
                entering = [b for b in range(self.B) if self.idle[b]]
            else:
                self.stage([b for b in range(self.B) if self.idle[b]])
                free = self.loops[0].free_places()
                entering = sorted(self.staged, key=self.ready_at.__getitem__)[:free] \
                    if free >= self.join_min or not any(len(loop) for loop in self.loops) else []
            if entering:
                self.enter(entering)
            if not any(len(loop) for loop in self.loops) and not self.done_rows:
                break
            for g, loop in enumerate(self.loops):
                if len(loop):
                    self.steps += 1
                    self.work += len(loop)
                    out = loop.step(self.cache)
                    if out is not None:
                        self.leave(g, out)
        if self.pending:
            self.finish(self.pending)
        self.end = self.clock.mark()
        self.clock.settle()
        for record, uid in self.finished:
            record.time_s = self.clock.take(uid)

    def clocks(self) -> dict[str, float]:
        """The run's clocks for `ExitEngine.stats` (after `go`)."""
        marks = self.clock.marks_s
        out = {"decode_s": marks[self.end], "work": self.work}
        if self.dry is not None:
            mark, work, tokens, iterations = self.dry
            out.update(steady_s=marks[mark], steady_work=work, steady_tokens=tokens,
                       steady_token_iterations=iterations)
        return out

    def row_done(self, row: int) -> None:
        """Row `row` is done with its request; with none left in the queue the run's steady state ends here."""
        self.done_rows.append(row)
        if not self.queue and self.dry is None:
            self.dry = (self.clock.mark(), self.work, len(self.finished), self.finished_iterations)

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
                self.ready_at[b] = self.steps
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
            self.row_done(row)
        else:
            self.next_pos[row] = position + 1
            self.idle[row] = True
            self.ready_at[row] = self.steps

    def prefill(self, pairs: list[tuple[int, Request]]) -> None:
        """The rows' requests' inputs (teacher-forced) and their prefixes [0, first) at full depth. With a prefix
        store, each request alone (prefixes.py: so its entries depend on its prompt alone, stored or restored);
        without one, all together."""
        if self.engine.prefixes is None:
            return self._prefill_together(pairs)
        started = self.clock.start()
        for b, req in pairs:
            self._prefill_one(b, req)
        firsts = [(b, r.first) for b, r in pairs if r.first > 0]
        for probes in self.probe_caches:
            if probes is not None:
                probes.copy_prefix(self.cache, firsts)
        self.clock.stop(started, "prefill", [])

    def _prefill_together(self, pairs: list[tuple[int, Request]]) -> None:
        """`prefill` without a prefix store: one pass over the rows, right-padded. Padding computes junk entries
        that each row's own tokens overwrite, at every slot, before any token of that row reads them."""
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

    def _prefill_one(self, b: int, req: Request) -> None:
        engine, cache = self.engine, self.cache
        row = torch.tensor([b], device=cache.device)
        ctx = AttnContext(start=0, cache=cache, rows=row, prefix=req.block if engine.prompt_block else None)
        if self.teacher_forced:  # everything before the first loop group, for every position
            ids = torch.tensor([req.tokens[:req.end + 1]], device=cache.device)
            x = self.model.walk(self.model.embed(ids, 0), ctx, stop=engine.bounds[0])
            if self.inputs is None:
                self.inputs = x.new_zeros(self.B, self.cache.capacity, x.shape[-1])
            self.inputs[b, :req.end + 1] = x[0]
        L = max(req.first, req.block)
        if L == 0:
            return
        depths = [p.max_steps for p in engine.policies]
        store = engine.prefixes if self.warm is None else None  # (warm starts read the prefill's last states)
        key = (self.teacher_forced, tuple(req.tokens[:L]), req.block, tuple(depths), engine.config.cache_layout(),
               tuple(self.prefix_slots.items()), engine.config.seed, str(self.model.dtype), self.weights_version)
        held = store.get(key) if store is not None else None
        if held is not None:
            for layer, (k, v) in held.items():
                cache.k[layer][:len(k), b, :L] = k
                cache.v[layer][:len(v), b, :L] = v
            return

        def keep_final(g: int, k: int, s: torch.Tensor) -> None:
            if self.warm is not None and k == engine.policies[g].max_steps and req.first > 0:
                self.warm.remember(g, row, s[:, req.first - 1])

        def noise(group, x):
            return engine.noise.rows(0, L, x.dtype, x.device).unsqueeze(0) if group.random_init else None

        if self.teacher_forced:
            self.model.walk(self.inputs[b:b + 1, :L], ctx, depths, start=engine.bounds[0], noise=noise,
                            on_state=keep_final)
        else:
            ids = torch.tensor([req.tokens[:L]], device=cache.device)
            self.model.walk(self.model.embed(ids, 0), ctx, depths, noise=noise, on_state=keep_final)
        if store is not None:
            store.put(key, {layer: (cache.k[layer][:n, b, :L].clone(), cache.v[layer][:n, b, :L].clone())
                            for layer, n in self.prefix_slots.items()})

    # ---- tokens in and out of the loops -----------------------------------------------------------------------
    def enter(self, rows: list[int]) -> None:
        """The rows' next tokens into the first loop group: their inputs, known in advance or run now
        (embedding and the plain stages before the group), or staged (continuous)."""
        if self.places is not None:
            tokens = [self.staged.pop(b) for b in rows]
            at = torch.as_tensor(rows, device=self.cache.device)
            self.loops[0].add(tokens, self.staged_x.index_select(0, at), self.staged_s0.index_select(0, at))
            return
        tokens = self.waves.tokens(rows) if self.waves is not None else self._next_tokens(rows)
        x, s0 = self._prelude(tokens)
        self.loops[0].add(tokens, x, s0)

    def stage(self, rows: list[int]) -> None:
        """Continuous: the rows' next tokens made ready to enter, their inputs and start states computed now, all
        of them in one batch (the rows a bucket of outputs or a prefill just made ready), not a few at each step
        as places free."""
        if not rows:
            return
        tokens = self._next_tokens(rows)
        x, s0 = self._prelude(tokens)
        if self.staged_x is None:
            self.staged_x = x.new_zeros(self.B, *x.shape[1:])
            self.staged_s0 = s0.new_zeros(self.B, *s0.shape[1:])
        at = torch.as_tensor(rows, device=self.cache.device)
        self.staged_x.index_copy_(0, at, x)
        self.staged_s0.index_copy_(0, at, s0)
        for token in tokens:
            self.staged[token.row] = token
            self.ready_at[token.row] = self.steps

    def _prelude(self, tokens: list[Token]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' inputs to the first loop group, (m, 1, d), and their start states there."""
        started = self.clock.start()
        if self.inputs is not None:
            at = torch.tensor([t.row * self.inputs.shape[1] + t.position for t in tokens], device=self.cache.device)
            x = self.inputs.view(-1, self.inputs.shape[-1]).index_select(0, at).unsqueeze(1)
        else:
            ctx = self._context(tokens, 0, self.engine.bounds[0])
            ids = torch.tensor([[self.reqs[t.request].tokens[t.position]] for t in tokens], device=self.cache.device)
            x = self.model.walk(self.model.embed(ids, ctx.start, ctx.positions), ctx, stop=self.engine.bounds[0])
        s0 = self._start_states(0, tokens, x)
        self.clock.stop(started, "prelude", [t.uid for t in tokens])
        return x, s0

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
        if refill == "wave" or looping == 0 or not self.continuous and refill == "continuous":
            # (a run continuous batching has no use for: every token leaves at max_steps, so all at once)
            return looping == 0
        parked = sum(len(o.tokens) for o in self.parked)
        if refill == "continuous":  # CDB's coda queue: a bucket of outputs at a time, the spare rows looping
            # (or sooner, when no token waits to take a place that frees: finishing is then all there is to do)
            return parked >= self.bucket or not self.staged and not any(self.idle)
        return parked >= looping

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
        if self.teacher_forced:
            targets = torch.tensor([-1 if t.target is None else t.target for t in tokens], device=logp.device)
            picked = logp.gather(1, torch.where(targets >= 0, targets, top).unsqueeze(1)).squeeze(1)
        else:  # (generation: every token's pick is its argmax)
            picked = logp.gather(1, top.unsqueeze(1)).squeeze(1)
        # A row's sum is non-finite exactly when the row holds a NaN or an infinity (float32 sums would need a
        # total magnitude past 3e38 to overflow): one reduction per row, checked on the host, not elementwise
        # masks. (float32 holds every token id below 2^24 and each pick exactly: one read to the host.)
        total = states.flatten(1).sum(1, dtype=torch.float32) + logits.float().sum(-1)
        host = torch.stack([top.to(picked.dtype), picked, total], 1).tolist()
        self.clock.stop(started, "coda", [t.uid for t in tokens])
        # (a row of logp is a view op each: only scoring's consumer reads it)
        rows_logp = logp if self.teacher_forced else [None] * len(tokens)
        for token, row_logp, (top_j, picked_j, total_j) in zip(tokens, rows_logp, host):
            token.nonfinite |= not math.isfinite(total_j)
            more = True
            if token.consumed:
                self.finished.append((self._record(token), token.uid))
                self.finished_iterations += sum(token.exit_steps)
                self.results[token.request].records.append(self.finished[-1][0])
                more = self.consume(token.request, token.position, row_logp, int(top_j), picked_j) is not None
            else:
                self.results[token.request].prompt_positions += 1
                self.results[token.request].prompt_iterations += sum(token.exit_steps)
            if not self.defer:  # (deferred rows moved on when their tokens left the loop)
                if more:
                    self.advance(token.row, token.position)
                else:
                    self.row_done(token.row)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _walk(self, x: torch.Tensor, tokens: list[Token], start: int, stop: int | None = None) -> torch.Tensor:
        """The plain stages [start, stop) for tokens (x: (n, 1, d)). A depth-major block whose rows hold runs of
        one shape walks as one chunk; other sets token by token (several of a row: one slice of its keys)."""
        rows, positions = [t.row for t in tokens], [t.position for t in tokens]
        chunk = uniform_chunk(positions_runs(rows, positions), self.B, self.cache)
        if chunk is None:
            return self.model.walk(x, self._context(tokens, start, stop), start=start, stop=stop)
        ctx, n_rows = chunk
        # (a stage may leave a position wider or narrower than it came: Inkling 2's coda reads packed blocks)
        out = self.model.walk(x.view(n_rows, -1, x.shape[-1]), ctx, start=start, stop=stop)
        return out.reshape(-1, 1, out.shape[-1])

    def _context(self, tokens: list[Token], start: int = 0, stop: int | None = None) -> AttnContext:
        """Where tokens read and write in the stages [start, stop). Where none of those stages attends, only
        their positions (an embedding may read them): a token-mode index costs a dozen ops to build, and a
        generated token passes such stretches at each refill (tiny-raven's empty prelude and coda)."""
        rows = [t.row for t in tokens]
        positions = [t.position for t in tokens]
        if rows == list(range(self.B)) and min(positions) == max(positions):
            return AttnContext(start=positions[0], cache=self.cache)
        if not self._attends(start, stop):
            return AttnContext(positions=torch.as_tensor(positions, device=self.cache.device))
        return AttnContext.tokens(self.cache, rows, positions, by_row=len(set(rows)) < len(rows))

    def _attends(self, start: int, stop: int | None) -> bool:
        """Whether any of the stages [start, stop) keeps entries in the cache."""
        return any(stage.attn_layers or stage.state_layers for stage in self.model.stages()[start:stop])

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
