"""Lossless depth speculation: the baseline an exit rule has to beat (LoopSpec, WaveFront, DAS).

A round drafts k tokens greedily, one pass each, at a shallow depth (or each by an exit rule), then verifies them at
full depth in one pass over their k + 1 positions (the last kept token and the k drafts, side by side: chunk mode,
every iteration of every position written before any is read), keeps the longest prefix of drafts that full depth's
own greedy tokens agree with, and emits full depth's token where they first disagree, or full depth's next token
after all k (the bonus). Every emitted token is full depth's greedy choice and every kept position's cache entries
are full depth's own (the verify pass wrote them), so the output is full depth's greedy output, token for token, to
float rounding: a draft only decides how many positions one full-depth pass covers.

The cache needs no rollback: a draft writes only the iterations it runs at its positions (an exit rule's draft
carries its last entry into the slots above, as an exited token's are under the `latest` layout) and reads only
those iterations of earlier positions, which are full depth's entries where kept; the verify pass rewrites every
iteration at every position it covers; a rejected position is rewritten when the sequence reaches it again.
Initial-state noise is keyed by position (engine/noise.py), as the engine keys it, so a random-start loop (Raven's)
draws the same start for a position whichever pass computes it.

What a token costs: a round's drafts and its verification, loop iterations and FLOPs, shared among the tokens the
round emitted (`Speculated.charges`), so a cell's mean iterations per token counts every draft, kept or not. The
prompt, but for its last token, is prefilled at full depth before the clock starts, as the engine's prefill is.

`SpeculativeEngine` is the lm-eval model's engine under `--policy speculate`: ExitEngine's generation surface (its
results, records, FLOP model and clocks) over this algorithm, one sequence at a time: a round's accepted length
differs between sequences, so sequences do not share its passes (a latency method; its throughput clock says so).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..errors import ExitbenchError
from ..models import LoopedLM, Stage
from ..models.attention import AttnContext
from ..policies import ExitPolicy, log_probs
from .config import ExitConfig
from .flops import FlopModel
from .noise import PositionNoise
from .records import SequenceResult, TokenRecord


@dataclass
class Speculated:
    """One prompt's continuation: full depth's tokens and their log-probabilities (float64 log-softmax of full
    depth's logits), and what it took: drafts accepted per round, the loop iterations drafts and verification ran
    (a position verified at full depth counts every group's full depth), and per emitted token its share of its
    round's cost (`Charge`)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_iterations: int = 0
    verify_iterations: int = 0
    stopped_by: str | None = None
    charges: list["Charge"] = field(default_factory=list)
    decode_s: float = 0.0  # the rounds' wall-clock, the prefill left out
    steps: int = 0  # loop steps run: a draft pass's depth, a verify pass's full depth
    drafted: int = 0  # drafts made, kept or not

    def record(self) -> dict[str, int | list[int]]:
        """What a request's statistics keep of it (store/cells.py sums them into a cell's `speculation`)."""
        return {"accepted": self.accepted, "drafted": self.drafted, "draft_iterations": self.draft_iterations,
                "verify_iterations": self.verify_iterations, "steps": self.steps}

    @property
    def iterations_per_token(self) -> float:
        """Loop iterations per emitted token, drafts and verification counted, the prefill left out."""
        return (self.draft_iterations + self.verify_iterations) / max(1, len(self.tokens))


class DepthSpeculator:
    """Greedy generation by depth speculation: drafts at `draft_depth` iterations of every loop group (or by
    `draft_rules`, one bound exit rule per loop group), `k` per round, verified at `full` depth (default: each group's
    default). k = 0 drafts nothing: full depth one token a pass, through the same passes (speculation's own baseline
    for a clock)."""

    def __init__(self, model: LoopedLM, draft_depth: int | None, k: int = 4, seed: int = 0,
                 draft_rules: Sequence[ExitPolicy] | None = None, full: Sequence[int] | None = None):
        self.model = model.eval()
        self.full = list(full) if full is not None else model.resolve_steps(None)
        self.rules = list(draft_rules) if draft_rules is not None else None
        if self.rules is None:
            if isinstance(draft_depth, bool) or not isinstance(draft_depth, int) or draft_depth < 1:
                raise ExitbenchError(f"a draft depth must be a whole number ≥ 1, got {draft_depth!r}")
            if draft_depth >= min(self.full):
                raise ExitbenchError(f"draft depth {draft_depth} is not below full depth {min(self.full)}: a draft "
                                     "that deep saves nothing over generating at full depth; give a shallower one")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ExitbenchError(f"draft tokens (k) must be a whole number ≥ 1 (0: none, full depth alone), got {k!r}")
        self.draft = model.resolve_steps(draft_depth) if self.rules is None else None
        self.k = k
        dim = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device)).shape[-1]
        self.noise = PositionNoise(seed, dim)
        self.flops = FlopModel(model, self.full)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None) -> list[Speculated]:
        """Each prompt's continuation; stops at a stop id, when `stop(index, generated)` says so, or after
        max_new_tokens."""
        if max_new_tokens < 1:
            raise ExitbenchError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ExitbenchError("generation needs a non-empty prompt (at least a BOS token)")
        return [self._one(i, list(p), max_new_tokens, set(stop_ids), stop) for i, p in enumerate(prompts)]

    def _noise(self, start: int):
        def noise(group, h: torch.Tensor) -> torch.Tensor | None:
            return self.noise.rows(start, h.shape[1], h.dtype, h.device).unsqueeze(0) if group.random_init else None
        return noise

    def _pass(self, ids: list[int], start: int, depths: list[int], cache, prefix: int | None = None) -> torch.Tensor:
        """Logits (T, V) of `ids` at positions start … through the cache, every loop group at `depths`."""
        model, x = self.model, torch.tensor([ids], device=self.model.device)
        h = model.walk(model.embed(x, start), AttnContext(start=start, cache=cache, prefix=prefix), depths,
                       noise=self._noise(start))
        return model.head(h)[0]

    def _ruled_pass(self, token: int, pos: int, cache) -> tuple[torch.Tensor, list[int], list[int]]:
        """One draft token's logits (V,) with each loop group run until its draft rule exits, as the engine's probe
        reads a rule (signal, `read`, `decide`); with the iterations each group ran and the readouts it made."""
        model = self.model
        ctx = AttnContext(start=pos, cache=cache)
        x = model.embed(torch.tensor([[token]], device=model.device), pos)
        groups = {id(g): i for i, g in enumerate(model.loop_groups())}
        ran, probes = [0] * len(groups), [0] * len(groups)
        for stage in model.stages():
            if isinstance(stage, Stage):
                x = stage.run(x, ctx)
                continue
            g, rule = groups[id(stage)], self.rules[groups[id(stage)]]
            s = stage.init(x, self._noise(pos)(stage, x))
            memory, streak = rule.start(s[:, 0], model.output_size), [0]
            for i in range(rule.max_steps):
                s = stage.step(s, x, ctx.at_iteration(i))
                logits = model.readout(g, s, ctx)[:, 0] if rule.needs_logits else None
                value = rule.read([i + 1], rule.probe_signal(s[:, 0], memory, logits).tolist())
                probes[g] += logits is not None
                if rule.decide([i + 1], value, streak)[0]:
                    break
            ran[g] = i + 1
            # later drafts read this position at their own iterations: its last entry stands in above it
            cache.carry_forward(stage.attn_layers, 0, pos, i)
            x = stage.finish(s)
        return model.head(x)[0, -1], ran, probes

    def _draft(self, token: int, pos: int, cache) -> tuple[int, list[int], dict[str, float]]:
        """The next draft after `token` at `pos`: (the draft, iterations per group, its FLOPs)."""
        if self.rules is None:
            logits = self._pass([token], pos, self.draft, cache)[-1]
            ran, probes = self.draft, [0] * len(self.draft)
        else:
            logits, ran, probes = self._ruled_pass(token, pos, cache)
        return int(logits.argmax()), ran, self.flops.token(pos + 1, ran, probes)

    def _one(self, index: int, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
             stop: Callable[[int, list[int]], bool] | None) -> Speculated:
        model, out = self.model, Speculated()
        n = len(prompt)
        # (a round drafts no further than the last new token's input: generation's own positions, as the engine's)
        if n + max_new_tokens - 1 > model.config.block_size:
            raise ExitbenchError(f"a sequence needs {n + max_new_tokens - 1} positions but the model's context is "
                                 f"{model.config.block_size}")
        cache = model.new_cache(1, n + max_new_tokens, self.full)

        def emit(logits: torch.Tensor) -> int:
            logp = log_probs(logits)  # the engine's float64 log-softmax, so the two agree
            token = int(logp.argmax())
            out.tokens.append(token)
            out.logprobs.append(float(logp[token]))
            if token in stop_ids:
                out.stopped_by = "stop_id"
            elif stop is not None and stop(index, out.tokens):
                out.stopped_by = "stop"
            elif len(out.tokens) >= max_new_tokens:
                out.stopped_by = "max_new_tokens"
            return token

        if model.prefix_lm:  # the prompt is one bidirectional block: its last token is read with the rest
            emit(self._pass(prompt, 0, self.full, cache, n)[-1])
            out.charges.append(Charge(list(self.full), self.flops.token(n, self.full, [0] * len(self.full))))
        elif n > 1:
            self._pass(prompt[:-1], 0, self.full, cache)
        t0 = time.perf_counter()
        while out.stopped_by is None:
            began = time.perf_counter()
            pos = n + len(out.tokens) - 1  # the last kept token's position: the round's first input
            last = out.tokens[-1] if out.tokens else prompt[-1]
            k = min(self.k, max_new_tokens - len(out.tokens) - 1)  # the bonus token fills the last place
            drafts, ran, flops = [], [0] * len(self.full), _zero()
            for j in range(k):
                token, steps, cost = self._draft(drafts[-1] if drafts else last, pos + j, cache)
                drafts.append(token)
                ran, flops = [a + b for a, b in zip(ran, steps)], _add(flops, cost)
                out.steps += sum(steps)
            verified = self._pass([last, *drafts], pos, self.full, cache)
            out.steps += sum(self.full)
            for j in range(k + 1):
                flops = _add(flops, self.flops.token(pos + j + 1, self.full, [0] * len(self.full)))
            out.draft_iterations += sum(ran)
            out.drafted += k
            out.verify_iterations += (k + 1) * sum(self.full)
            before = len(out.tokens)
            for j in range(k + 1):
                token = emit(verified[j])
                if out.stopped_by is not None or j == k or token != drafts[j]:
                    break
            out.accepted.append(len(out.tokens) - before - 1)
            spent = [r + (k + 1) * f for r, f in zip(ran, self.full)]
            out.charges += _share(spent, flops, len(out.tokens) - before, time.perf_counter() - began)
        out.decode_s = time.perf_counter() - t0
        return out


def _zero() -> dict[str, float]:
    return dict.fromkeys(("prelude", "core", "probe", "coda", "total"), 0.0)


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] + b[k] for k in a}


def _share(iterations: list[int], flops: dict[str, float], tokens: int, seconds: float) -> list[Charge]:
    """A round's cost over the `tokens` it emitted: FLOPs and wall-clock evenly, each group's iterations as whole
    numbers that sum to the round's (the first tokens take the remainder), so a cell's counts add up to what ran."""
    out = []
    for t in range(tokens):
        steps = [it // tokens + (1 if t < it % tokens else 0) for it in iterations]
        out.append(Charge(steps, {k: v / tokens for k, v in flops.items()}, seconds / tokens))
    return out


@dataclass
class Charge:
    """An emitted token's share of its round: loop iterations per group, FLOPs by component, seconds."""
    iterations: list[int]
    flops: dict[str, float]
    seconds: float = 0.0


class SpeculativeEngine:
    """Generation by depth speculation behind ExitEngine's interface (its results, records, FLOP model and clocks),
    for the lm-eval model under `--policy speculate`: the draft is the config's τ (a depth) or its draft rule at
    threshold τ, `draft_tokens` per round, verified at the rule's max_steps (full depth)."""

    scoring_schedule = "token_major"
    schedule_note = None

    def __init__(self, model: LoopedLM, config: ExitConfig):
        self.model, self.config = model.eval(), config
        self.groups = model.loop_groups()
        self.policies = config.bound_policies(self.groups)
        spec = self.policies[0]
        full = [p.max_steps for p in self.policies]
        rules = None if spec.draft is None else [p.draft_rule().bind(p.max_steps, g)
                                                 for p, g in zip(self.policies, self.groups)]
        depth = None if rules is not None else int(spec.threshold)
        self.speculator = DepthSpeculator(model, depth, spec.k, config.seed, rules, full)
        self.flops = self.speculator.flops
        self.stats: dict[str, float] = dict.fromkeys(
            ("wall", "tokens", "steps", "decode_s", "work", "steady_s", "steady_work", "steady_tokens",
             "steady_token_iterations"), 0.0)
        self.last: list[Speculated] = []  # the last run's speculations, for their rounds and drafts kept

    def score(self, *args, **kwargs):
        raise ExitbenchError("speculate drafts and verifies generated tokens; a scoring request (loglikelihood) has "
                             "its tokens given, so there is nothing to draft: use an exit rule or fixed depth there")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None, batch_size: int | None = None,
                 on_request: Callable[[int], None] | None = None) -> list[SequenceResult]:
        """ExitEngine.generate's contract, one sequence at a time (`batch_size` is read by no pass)."""
        wall, results, self.last = time.perf_counter(), [], []
        for i, prompt in enumerate(prompts):
            (got,) = self.speculator.generate([prompt], max_new_tokens, stop_ids,
                                              None if stop is None else (lambda _, gen, i=i: stop(i, gen)))
            self.last.append(got)
            start = len(prompt) - 1
            # (a round's time is its loop's, the phase every exit cell's per-token time reads: `core`)
            records = [TokenRecord(start + j, c.iterations, {"core": c.seconds}, c.flops)
                       for j, c in enumerate(got.charges)]
            results.append(SequenceResult(got.tokens, got.logprobs, [True] * len(got.tokens), records,
                                          got.stopped_by, speculation=got.record()))
            self.stats["decode_s"] += got.decode_s
            self.stats["steps"] += got.steps
            self.stats["tokens"] += len(got.tokens)
            self.stats["work"] += got.draft_iterations + got.verify_iterations
            if on_request is not None:
                on_request(i + 1)
        self.stats["wall"] += time.perf_counter() - wall
        return results
