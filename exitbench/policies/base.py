"""The exit-policy interface and its registry.

A policy watches tokens' loops: after each iteration it turns each token's state s_k (and, if it declares
`needs_logits`, the log-probabilities of the readout at s_k) into a signal on the device, and `decide` turns
the signals into exits on the host: a token exits once its signal has passed the threshold on `patience`
consecutive iterations with k ≥ min_steps, or at max_steps. The engine reads the signals to the host once per
iteration anyway (that read is its one synchronisation), so the exit rule costs Python arithmetic, not
kernel launches.

Policies work on a batch of tokens at once, and the tokens of a batch need not be at the same iteration.
`memory` holds what a policy carries between iterations, one row per token; `start` makes every entry for
new tokens, so tokens joining a batch are stacked onto it.

Iterations are counted from 1: s_0 is the initial state, Δ_k = s_k − s_{k−1}. A signal is defined from
iteration `defined_from`; before that (Δ_{k−1} at k = 1, say) it reads +inf for "exit below" rules and −inf
for "exit above" rules, so it never counts as a hit.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import ExitbenchError

Memory = dict[str, torch.Tensor]

REGISTRY: dict[str, type["ExitPolicy"]] = {}
# The knobs a policy takes (their defaults and help live in exitbench.engine.config.ExitConfig).
POLICY_KNOBS = ("threshold", "min_steps", "max_steps", "patience", "relative", "exit_model", "rules", "vary",
                "draft_tokens", "draft")


def register(cls: type["ExitPolicy"]) -> type["ExitPolicy"]:
    REGISTRY[cls.name] = cls
    return cls


def runs_end(hits: np.ndarray, p: int) -> np.ndarray:
    """(n, K) booleans: a run of p consecutive hits ends at k (the hit count over (k − p, k] is p)."""
    n, K = hits.shape
    counts = np.concatenate([np.zeros((n, 1), dtype=np.int64), np.cumsum(hits, axis=1, dtype=np.int64)], axis=1)
    ends = np.zeros_like(hits)
    if p <= K:
        ends[:, p - 1:] = (counts[:, p:] - counts[:, :-p]) == p
    return ends


# A rule whose definition leaves it at most this many iterations before full depth to exit at is marked late.
LATE_STEPS = 2


def log_grid(lo: float, hi: float, per_decade: int = 1) -> tuple[float, ...]:
    n = round(math.log10(hi / lo) * per_decade)
    return tuple(float(f"{lo * 10 ** (i / per_decade):.3g}") for i in range(n + 1))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a rule reads, in float64: KL and entropy differences near their thresholds (1e-5
    and below) sit at float32's rounding noise, which varies with batch shape; in float64 batching cannot flip
    an exit."""
    return torch.log_softmax(logits.double(), -1)


class ExitPolicy:
    name: ClassVar[str]
    source: ClassVar[str]
    needs_logits: ClassVar[bool] = False
    exits_below: ClassVar[bool] = True
    default_threshold: ClassVar[float]
    default_patience: ClassVar[int] = 1
    default_grid: ClassVar[tuple[float, ...]] = ()
    integer_threshold: ClassVar[bool] = False
    uses_relative: ClassVar[bool] = False
    # Decided after running every token to max_steps (the oracle); not a usable policy.
    retrospective: ClassVar[bool] = False
    # Exits by counting alone (fixed depth): the engine needs no signal, only k = max_steps.
    signal_free: ClassVar[bool] = False
    # The first iteration at which the signal means something.
    defined_from: ClassVar[int] = 1
    # Reads a fitted model from the file named by the exit_model knob (the learned rule).
    needs_exit_model: ClassVar[bool] = False
    # Reads the model's trained exit gate (`LoopGroup.gate`), given at `bind`.
    needs_gate: ClassVar[bool] = False
    gate = None
    # Combines other rules (`rules`, `vary`): the conjunction.
    takes_rules: ClassVar[bool] = False
    # Not a per-token exit but lossless depth speculation (`draft_tokens`, `draft`): the lm-eval model generates
    # with it (engine/speculation.py), and no exit engine runs it.
    drafts: ClassVar[bool] = False
    # The lm-eval request types (output_type) of the tasks it can run; None: every type.
    output_types: ClassVar[tuple[str, ...] | None] = None
    # Ranks the positions of one scored sequence against each other at one iteration (the budgeted prefill exit,
    # policies/budget.py): the engine hands it a step's tokens (`decide_wave`), it needs every position of the
    # sequence in flight together (depth-major scoring, prompt included: prefill "exit"), and no token's exit is
    # its own trajectory's alone, so nothing replays it token by token.
    ranks_positions: ClassVar[bool] = False
    # The run's seed (ExitConfig.seed), set when the config binds its policies: what a random rule draws from.
    seed: int = 0

    def __init__(self, **knobs: Any):
        unknown = sorted(set(knobs) - set(POLICY_KNOBS))
        if unknown:
            raise ExitbenchError(f"{self.name}: unknown knob {unknown[0]!r}; knobs are {', '.join(POLICY_KNOBS)}")
        threshold, patience = knobs.get("threshold"), knobs.get("patience")
        self.threshold = self.default_threshold if threshold is None else threshold
        self.threshold_given = threshold is not None
        self.min_steps = knobs.get("min_steps", 1)
        self.max_steps = knobs.get("max_steps")
        self.patience = self.default_patience if patience is None else patience
        self.relative = knobs.get("relative", False)
        self.exit_model = knobs.get("exit_model")
        self.rules, self.vary = knobs.get("rules"), knobs.get("vary")
        self.draft_tokens, self.draft = knobs.get("draft_tokens"), knobs.get("draft")
        self._validate()

    def _validate(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t <= 0:
            raise ExitbenchError(f"{self.name}: threshold must be a finite number > 0, got {t!r}")
        if self.integer_threshold and float(t) != int(t):
            raise ExitbenchError(f"{self.name}: threshold counts iterations and must be a whole number, got {t}")
        if not isinstance(self.min_steps, int) or self.min_steps < 1:
            raise ExitbenchError(f"{self.name}: min_steps must be an integer ≥ 1, got {self.min_steps!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ExitbenchError(f"{self.name}: max_steps must be an integer ≥ 1, got {self.max_steps!r}")
        if self.max_steps is not None and self.min_steps > self.max_steps:
            raise ExitbenchError(f"{self.name}: min_steps={self.min_steps} is greater than max_steps={self.max_steps}")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ExitbenchError(f"{self.name}: patience must be an integer ≥ 1, got {self.patience!r}")
        if self.relative and not self.takes("relative"):
            raise ExitbenchError(f"{self.name}: relative=True has no meaning for this policy; "
                                 f"it applies to {', '.join(n for n, c in REGISTRY.items() if c.takes('relative'))}")
        if self.needs_exit_model and not self.exit_model:
            raise ExitbenchError(f"{self.name}: needs --exit-model FILE, the exit model `exitbench fit-exit` "
                                 "writes for this checkpoint")
        if (self.rules is not None or self.vary is not None) and not self.takes("rules"):
            raise ExitbenchError(f"{self.name}: rules and vary have no meaning for this policy; they define an "
                                 "all_of conjunction")
        if (self.draft_tokens is not None or self.draft is not None) and not self.takes("draft"):
            raise ExitbenchError(f"{self.name}: draft_tokens and draft have no meaning for this policy; they set "
                                 "depth speculation's drafts (--policy speculate)")
        if self.exit_model and not self.takes("exit_model"):
            raise ExitbenchError(f"{self.name}: --exit-model has no meaning for this policy; it applies to "
                                 f"{', '.join(n for n, c in REGISTRY.items() if c.takes('exit_model'))}")

    @classmethod
    def takes(cls, knob: str) -> bool:
        """Whether this rule has a use for `knob`: every rule takes its threshold, step limits and patience;
        `relative` only a rule that reads step norms, the exit model only the learned rule, a late horizon only a
        rule that decides as it runs."""
        return {"relative": cls.uses_relative, "exit_model": cls.needs_exit_model, "rules": cls.takes_rules,
                "vary": cls.takes_rules, "horizon": cls.decides_as_it_runs(), "draft_tokens": cls.drafts,
                "draft": cls.drafts}.get(knob, True)

    @classmethod
    def decides_as_it_runs(cls) -> bool:
        """Whether the rule decides each token's exit as the token runs (not by a count alone, like fixed depth, nor
        after the whole trajectory, like the oracle): what a late horizon reads and what lets tokens of one batch
        leave at different iterations (continuous depth batching)."""
        return not (cls.retrospective or cls.signal_free or cls.drafts)

    def bind(self, max_steps: int, group: Any = None) -> "ExitPolicy":
        """Fix max_steps from the loop group when the config left it open; a gate rule takes the group's gate."""
        if self.max_steps is None:
            self.max_steps = max_steps
            self._validate()
        if self.needs_gate and group is not None:
            if getattr(group, "gate", None) is None:
                raise ExitbenchError(f"{self.name}: reads a trained exit gate, and loop group {group.name!r} of this "
                                     "model has none (Ouro checkpoints have one); choose another policy")
            self.gate = group.gate
        return self

    def knobs(self) -> dict[str, Any]:
        return {"policy": self.name, **{name: getattr(self, name) for name in POLICY_KNOBS
                                        if name not in ("exit_model", "rules", "vary", "draft_tokens", "draft")
                                        or getattr(self, name)}}

    @property
    def variant(self) -> str:
        """What a recording of this rule's signal depends on beyond thresholds, patience and step limits."""
        return self.name + ("-rel" if self.relative else "")

    # ---- how early it can exit, by its definition alone -------------------------------------------------
    def first_hit(self) -> int:
        """The first iteration whose signal can count as a hit, whatever the values: `defined_from`, later for a
        rule whose threshold is itself a count of iterations."""
        return self.defined_from

    @property
    def earliest_exit(self) -> int:
        """The first iteration at which the rule can exit: its signal counting, `patience` hits in a row and
        min_steps reached. At max_steps or beyond it never exits before full depth."""
        return max(self.min_steps, self.first_hit() + self.patience - 1)

    def exit_reach(self) -> dict[str, Any]:
        """What a cell records of it, bound: `earliest_exit`, and `late_exit` where its own definition leaves it
        only the last iteration or two before full depth to exit at (a rule exiting from iteration 1 on a
        two-loop model has nothing to be marked for: no rule can do better there)."""
        if self.signal_free:
            return {}
        e = self.earliest_exit
        return {"earliest_exit": e, **({"late_exit": True} if 1 < e and self.max_steps - e <= LATE_STEPS else {})}

    def never_exits_early(self, capped: bool, limit: int) -> str | None:
        """None where the bound rule can exit before its max_steps; else one line saying the earliest iteration it
        can exit at and what to change. `capped`: max_steps was set (--max-steps), not the loop's own depth;
        `limit`: the most iterations the loop allows."""
        e, depth = self.earliest_exit, self.max_steps
        if self.signal_free or e < depth:
            return None
        if depth == 1:
            return (f"{'--max-steps 1' if capped else 'a loop of one iteration'} leaves {self.label} nothing to "
                    "save: every token runs its one iteration whatever the rule; raise --max-steps (or run fixed "
                    "depth 1 alone, --baselines 1)")
        loop = f"--max-steps {depth} caps the loop" if capped else f"the model's loop runs {depth} iterations"
        fixes = [f"--max-steps {e + 1} or more"] if e < limit else []
        room = depth - self.first_hit()  # the longest run of hits that ends before full depth
        if self.patience > room >= 1 and self.min_steps < depth:
            fixes.append(f"--patience {room} or less")
        if self.min_steps >= depth:
            fixes.append(f"--min-steps below {depth}")
        fixes += self._threshold_fix(depth)
        early = [n for n in ("first_order", "kl", "confidence") if n != self.name]
        fixes.append(f"a rule that can exit from iteration 1 ({', '.join(early)})")
        return (f"{self.label} can first exit at iteration {e} ({self._why_late()}), and {loop}, so it never exits "
                f"before full depth; use {', or '.join(fixes)}")

    @property
    def label(self) -> str:
        """The rule as a message names it: its name, and its τ where τ decides how early it can exit."""
        return self.name + (f" at τ={self.threshold:g}" if self.integer_threshold else "")

    def _why_late(self) -> str:
        why = [f"its signal counts from iteration {self.first_hit()}"] if self.first_hit() > 1 else []
        if self.patience > 1:
            why.append(f"then needs {self.patience} hits in a row")
        if self.min_steps == self.earliest_exit:
            why = [f"min_steps is {self.min_steps}"]
        return ", ".join(why)

    def _threshold_fix(self, depth: int) -> list[str]:
        """The largest τ that would let it exit before `depth`, where τ counts iterations (argmax_stability, or a
        conjunction varying it); none for other rules."""
        rule = self._varied_rule()
        if not rule.integer_threshold or rule.signal_free:
            return []
        saved = rule.threshold
        try:
            for tau in range(int(saved) - 1, 0, -1):
                rule.threshold = tau
                if self.earliest_exit < depth:
                    return [f"a threshold of at most {tau} (--thresholds)"]
        finally:
            rule.threshold = saved
        return []

    def _varied_rule(self) -> "ExitPolicy":
        """The rule whose threshold is this one's τ (a conjunction's varied member)."""
        return self

    # ---- what subclasses implement -----------------------------------------------------------------
    def start(self, s0: torch.Tensor, vocab: int) -> Memory:
        """Memory for tokens starting their loops at states s0 (n, d), every entry present; `vocab` is the width
        of the readout's distribution, for rules that read one."""
        return {"prev": s0}

    def signal(self, s: torch.Tensor, memory: Memory, logp: torch.Tensor | None) -> torch.Tensor:
        """The rule's value for each token from its new state s (n, d), shape (n,); updates `memory`."""
        raise NotImplementedError

    def stalled(self, value: float) -> bool:
        """Whether a token that ran to max_steps with this last signal never settled by the rule's own measure
        (the contraction rule: still not contracting); such tokens are counted in the cell."""
        return False

    @property
    def counts_stalls(self) -> bool:
        return type(self).stalled is not ExitPolicy.stalled

    # ---- the probe: one sequence for every engine that runs a rule -----------------------------------------
    # After an iteration, exitbench's TokenLoop, its recorder and hindsight, and the vLLM plugin's forward all
    # read a rule the same way: `probe_signal` (the readout's float64 log-probabilities, the signal), then
    # `read` (each value as the rule reads it at its token's iteration), then `decide`.
    def probe_signal(self, s: torch.Tensor, memory: Memory, logits: torch.Tensor | None) -> torch.Tensor:
        """The rule's signal for tokens at states s (n, d) whose readout gave `logits` (n, V), None where the
        rule reads none; updates `memory`."""
        return self.signal(s, memory, None if logits is None else log_probs(logits))

    def read(self, k: list[int], values: list) -> list:
        """`defined` for each token j at its iteration k[j]: the values `decide` reads."""
        return [self.defined(kj, v) for kj, v in zip(k, values)]

    # ---- the shared exit rule, on the host ---------------------------------------------------------------
    @property
    def never(self) -> float:
        return math.inf if self.exits_below else -math.inf

    def defined(self, k: int, value: float) -> float:
        """The signal as the rule reads it at iteration k: `never` before `defined_from`."""
        return value if k >= self.defined_from else self.never

    def defined_tensor(self, k: int, value: torch.Tensor) -> torch.Tensor:
        """`defined` for every token of a recording at iteration k at once."""
        return value if k >= self.defined_from else torch.full_like(value, self.never)

    @property
    def padding(self) -> float:
        """A recorded trajectory's entry for the iterations after the token's exit."""
        return math.nan

    def hit(self, value: float) -> bool:
        return value < self.threshold if self.exits_below else value >= self.threshold  # NaN never hits

    def decide(self, k: list[int], values: list[float], streak: list[int]) -> list[bool]:
        """Which tokens exit after their iteration k[j] with signal values[j] (as `defined` reads them):
        `patience` consecutive hits at k ≥ min_steps, or k = max_steps. Updates the hit streaks in place
        (`streak[j]` is the rule's own count for the token, 0 when it starts)."""
        leave = []
        for j, (kj, v) in enumerate(zip(k, values)):
            streak[j] = streak[j] + 1 if self.hit(v) else 0
            leave.append(kj >= self.max_steps or (kj >= self.min_steps and streak[j] >= self.patience))
        return leave

    def decide_wave(self, tokens: list[Any], k: list[int], values: list[float], streak: list[int]) -> list[bool]:
        """`decide` for a rule that ranks positions (`ranks_positions`): the step's tokens (engine Tokens: their
        requests and positions) beside their iterations, values and streaks."""
        return self.decide(k, values, streak)

    def first_exit(self, signals: list[float]) -> int:
        """`decide` walked over one token's recorded signal trajectory (s_1 … s_max): its exit step. The bridge
        by which the tests hold `first_exits` to the streaming form."""
        streak = [0]
        for k, value in enumerate(signals, start=1):
            if self.decide([k], [value], streak)[0]:
                return k
        return len(signals)

    # ---- the same rule over recorded trajectories (replay, calibration): arrays, not a walk ---------------------
    def first_exits(self, values: np.ndarray) -> np.ndarray:
        """Exit step (1-based) of each token from its signals (n, K) at iterations 1 … K, as `defined` reads
        them (+inf / −inf where undefined), K ≥ max_steps: `decide`'s rule as a few array operations."""
        K = min(values.shape[1], self.max_steps)
        v = values[:, :K]
        with np.errstate(invalid="ignore"):
            hits = v < self.threshold if self.exits_below else v >= self.threshold  # NaN never hits
        steps = np.arange(1, K + 1)
        leave = runs_end(hits, self.patience) & (steps >= self.min_steps)
        leave[:, K - 1] = True  # k = max_steps
        return leave.argmax(axis=1) + 1

    def recorded_exits(self, n: int, signals: np.ndarray | None, top: np.ndarray | None,
                       picked: np.ndarray | None, by_target: bool) -> np.ndarray:
        """Exit steps (n,) from a recording of `n` tokens: this rule's signals (n, K), and the readout's argmax
        and the target's log-probability at every iteration (n, K), which only the oracle reads."""
        return self.first_exits(signals)


def policy_names() -> list[str]:
    return list(REGISTRY)


def check_policy_name(name: str) -> None:
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ExitbenchError(f"unknown policy {name!r}{hint}; valid: {', '.join(REGISTRY)}")
