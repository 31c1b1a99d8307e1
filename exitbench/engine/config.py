"""The exit knobs, defined once.

`ExitConfig`'s fields are the knobs: their defaults and help text live here and nowhere else. The policies take
the policy knobs from it, the engine the rest; the lm-eval model accepts its fields as model arguments, the
command line builds its options from them (exitbench.cli `exit_knobs`), and a sweep holds the shared ones.
"""
from __future__ import annotations

import functools
import re
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, create_model

from ..errors import ExitbenchError
from ..policies import POLICY_KNOBS, REGISTRY, ExitPolicy, check_policy_name
from ..runtime.validation import parse

ROLES = ("policy", "engine", "run")
EXIT_MODES = ("physical", "select", "weighted", "freeze")
REFILLS = ("continuous", "wave", "balanced", "eager")
HORIZONS = ("same", "late")
# KV layouts (docs/engine.md, KV layouts): (window, private) of the loop layers' slots, models/cache.py.
KV_LAYOUTS = {"latest": (None, 0), "single": (1, 0), "first_then_shared": (1, 1)}


def knob(help: str, *, role: str, when_set: bool = False, flags: tuple[str, ...] = (), swept: bool = False,
         command_line: bool = True) -> dict[str, Any]:
    """Field metadata, the one statement of what each knob is for.

    `role`: who reads it: the exit policy ("policy": its rule and step limits), the engine ("engine": how tokens
    run: prompt depth, warm start, KV window; a fixed-depth baseline keeps these), or whoever runs the config
    ("run": seed, recording). `when_set`: the knob came after results were first written, so a config (and a
    cell's key) holds it only when it is set away from its default, and configs without it read as they did
    before it existed.
    `swept`: a sweep varies it itself (policy, threshold), so it is not one of the knobs shared by a sweep's
    cells; `command_line`: the commands offer it as an option."""
    assert role in ROLES, role
    return {"help": help, "role": role, "when_set": when_set, "flags": flags, "swept": swept,
            "command_line": command_line}


def engine_knob(default: Any, help: str, *, when_set: bool = True) -> Any:
    """An engine knob's field, `when_set` unless told otherwise: all but prefill and warm_start came after results
    were first written."""
    return field(default=default, metadata=knob(help, role="engine", when_set=when_set))


@dataclass
class ExitConfig:
    """Everything that decides how tokens exit: the policy and its knobs, and how the engine runs them."""

    # The policy's rule and its step limits.
    policy: str = field(default="fixed", metadata=knob(
        "Exit policy (`exitbench policies` lists them).", role="policy", flags=("--policy", "-p"), swept=True))
    threshold: float | None = field(default=None, metadata=knob(
        "Threshold τ (default: the policy's own).", role="policy", swept=True))
    min_steps: int = field(default=1, metadata=knob("No exit before this iteration.", role="policy"))
    max_steps: int | None = field(default=None, metadata=knob(
        "Cap on iterations (default: each loop group's default depth).", role="policy"))
    patience: int | None = field(default=None, metadata=knob(
        "Consecutive hits needed to exit (default: the policy's own).", role="policy"))
    relative: bool = field(default=False, metadata=knob(
        "Latent rules: divide step norms by ‖s_k‖.", role="policy"))
    exit_model: str | None = field(default=None, metadata=knob(
        "The learned policy's exit model (the JSON file `exitbench fit-exit` wrote).", role="policy",
        when_set=True))
    rules: list[dict[str, Any]] | None = field(default=None, metadata=knob(
        "all_of: its member rules, each a mapping with `policy` and its own threshold, patience, min_steps, "
        "relative (given in an --exit-config file).", role="policy", when_set=True, command_line=False))
    vary: str | None = field(default=None, metadata=knob(
        "all_of: the member rule whose threshold is the conjunction's τ, the one a sweep varies (default: the "
        "first member given without a threshold).", role="policy", when_set=True, command_line=False))
    draft_tokens: int | None = field(default=None, metadata=knob(
        "speculate: tokens drafted per round, then verified together at full depth (default 4).", role="policy",
        when_set=True))
    draft: dict[str, Any] | None = field(default=None, metadata=knob(
        "speculate: an exit rule that drafts in place of a fixed depth, a mapping with `policy` and its own patience, "
        "min_steps, relative; its threshold is the cell's τ (given in an --exit-config file).", role="policy",
        when_set=True, command_line=False))
    # How the engine runs tokens.
    prefill: str = engine_knob("full", "Prompt tokens run at full depth ('full') or with exits like the rest ('exit').",
                               when_set=False)
    warm_start: bool = engine_knob(False, "Start each token from the previous token's final state.", when_set=False)
    kv_window: int | None = engine_knob(None, (
        "Keep each loop layer's KV entries of the last C iterations only, a rolling buffer (Huginn's compress-s, "
        "C × core layers; 1 is its vLLM plugin); 0 or unset: one slot per iteration."))
    kv_layout: str = engine_knob("latest", (
        "How loop layers keep keys across iterations. latest (default; Huginn's reference, Continuous Depth "
        "Batching's last_exited): a slot per iteration, an exited token's entry carried into the slots above its "
        "exit, so a later token at iteration i reads it at min(i, its exit); single: one slot for every iteration "
        "(kv_window 1; the last_loop KV mode of vLLM's looped models, CDB's single): a later token reads each "
        "earlier one's last entry; first_then_shared (CDB's): a slot for iteration 1, one shared slot for the "
        "rest."))
    refill: str = engine_knob("continuous", (
        "When a generated token that exited hands its row the next token. continuous (default; continuous depth "
        "batching): the loop keeps fixed places, a free place takes a waiting token at once, and exited tokens' "
        "outputs are computed in batches of --coda-batch while spare rows keep every place busy; wave: once every "
        "token in flight has exited, all together (static batching: a batch waits for its slowest row); eager: at "
        "the next step, rows regrouped at each exit; balanced: once the waiting tokens are as many as those still "
        "looping. The same tokens under each; only the time moves (docs/engine.md)."))
    coda_batch: int | None = engine_knob(None, (
        "refill continuous: exited generated tokens' outputs are computed (coda, head, the next tokens' inputs) "
        "in batches of at least this many, and the run holds as many sequences more than its batch size, so no "
        "place idles while they wait (Continuous Depth Batching's min_coda_batch_size); default the batch size: "
        "a coda and head pass per batch of outputs, as static batching has, for twice the rows of KV cache."))
    horizon: str = engine_knob("same", (
        "When the exit decision is read: same (default): after the iteration that computed it; late: one "
        "iteration later (Continuous Depth Batching's one-step-late horizon), so a device never waits for the "
        "host between iterations, and a token runs one iteration more than its rule says."))
    exit_mode: str | None = engine_knob(None, (
        "physical (default): an exited token stops and later tokens read its entries at its exit, so exits save "
        "compute; select: every token runs every iteration and the exit only picks which one's output is read "
        "(Ouro's own code and paper); weighted: every token runs every iteration and reads the logits averaged "
        "under the exit distribution of the model's gate (Ouro's use_weighted_exit; --policy fixed); freeze: every "
        "token stays to the last iteration, but an exited one is pinned at its exit state, its MLPs skipped, while "
        "its attention layers keep writing keys and values from that pinned state (IBM vLLM-Hook's vLLM executor)."))
    causal_prompt: bool = engine_knob(False, (
        "Read a prefix-LM's prompt causally, each token seeing only those before it, as lm-eval's hf model runs it "
        "(default: as the model was trained, one bidirectional block; HRM-Text is the prefix-LM here)."))
    # Set by whoever runs the config.
    record_signals: bool = field(default=False, metadata=knob(
        "Keep every token's signal at every iteration.", role="run", command_line=False))
    seed: int = field(default=0, metadata=knob("Seed of the initial-state noise.", role="run", command_line=False))

    def __post_init__(self):
        if self.policy in REGISTRY and REGISTRY[self.policy].drafts and self.changed("engine"):
            flags = ", ".join("--" + k.replace("_", "-") for k in self.changed("engine"))
            raise ExitbenchError(f"{self.policy} drafts and verifies in passes of its own, one sequence at a time, "
                                 f"with the engine's defaults; drop {flags}")
        if self.prefill not in ("full", "exit"):
            raise ExitbenchError(f"prefill must be 'full' or 'exit', got {self.prefill!r}")
        if self.kv_window is not None:
            if isinstance(self.kv_window, bool) or not isinstance(self.kv_window, int) or self.kv_window < 0:
                raise ExitbenchError(f"kv_window must be an integer ≥ 1, the iterations whose KV entries each "
                                     f"loop layer keeps (0: all of them), got {self.kv_window!r}")
            self.kv_window = self.kv_window or None  # 0 is the full cache: the same config, the same cells
        if self.kv_layout not in KV_LAYOUTS:
            raise ExitbenchError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_layout != "latest" and self.kv_window is not None:
            raise ExitbenchError(f"kv_layout {self.kv_layout} sets the loop layers' slots itself; kv_window "
                                 f"{self.kv_window} sets them too: give one")
        if self.kv_layout == "single":  # kv_window 1 by another name: one config, one cell key
            self.kv_layout, self.kv_window = "latest", 1
        if self.kv_layout == "first_then_shared" and self.policy in REGISTRY and REGISTRY[self.policy].retrospective:
            raise ExitbenchError(f"kv_layout first_then_shared shares one slot between iterations 2 and on; "
                                 f"{self.policy} settles each exit after running to max_steps, and would need every "
                                 "iteration's entries back: use kv_layout latest or single")
        if self.refill not in REFILLS:
            raise ExitbenchError(f"refill must be one of {', '.join(REFILLS)}, got {self.refill!r}")
        if self.coda_batch is not None:
            if isinstance(self.coda_batch, bool) or not isinstance(self.coda_batch, int) or self.coda_batch < 1:
                raise ExitbenchError(f"coda_batch must be an integer ≥ 1, the exited tokens whose outputs are "
                                     f"computed together, got {self.coda_batch!r}")
            if self.refill != "continuous":
                raise ExitbenchError(f"coda_batch sizes continuous depth batching's batches of outputs; with refill "
                                     f"{self.refill} it means nothing: drop it, or use refill continuous")
        if self.horizon not in HORIZONS:
            raise ExitbenchError(f"horizon must be one of {', '.join(HORIZONS)}, got {self.horizon!r}")
        if self.horizon == "late" and self.policy in REGISTRY and (REGISTRY[self.policy].retrospective
                                                                   or REGISTRY[self.policy].signal_free):
            rule = REGISTRY[self.policy]
            why = "decides only after the whole trajectory" if rule.retrospective else "exits by counting iterations"
            raise ExitbenchError(f"horizon late reads a rule's exit decision one iteration late; {self.policy} {why}, "
                                 "so there is no decision to read late: drop --horizon or choose a rule that decides "
                                 "as it runs")
        if self.exit_mode not in (None, *EXIT_MODES):
            raise ExitbenchError(f"exit_mode must be 'physical', 'select', 'weighted' or 'freeze', "
                                 f"got {self.exit_mode!r}")
        if self.exit_mode == "weighted" and self.policy != "fixed":
            raise ExitbenchError(f"exit_mode weighted reads every step's logits under the gate's exit distribution, "
                                 f"so no rule decides an exit: use --policy fixed (its depth is T), not {self.policy}")
        if self.exit_mode == "freeze" and self.policy in REGISTRY and REGISTRY[self.policy].retrospective:
            raise ExitbenchError(f"exit_mode freeze pins a token's state when its rule fires; {self.policy} decides "
                                 f"only after the whole trajectory, so there is nothing to pin: use physical or select")
        self.exit_mode = None if self.exit_mode == "physical" else self.exit_mode  # the default: the same cells
        if self.policy in REGISTRY and REGISTRY[self.policy].ranks_positions:
            self._check_budget()
        parse(_typed_knobs(), {f.name: getattr(self, f.name) for f in fields(self)}, "exit knobs")
        # Validate the knobs now, not at the first token; the learned rule reads its exit model here, once:
        # every policy this config builds, its cells' keys and the check that it fits the checkpoint use
        # those same bytes (`fitted_exit_model`, an ExitModel, None for every other rule).
        self.fitted_exit_model = None
        policy = self.build_policy()
        self.fitted_exit_model = getattr(policy, "model", None) if policy.needs_exit_model else None

    def _check_budget(self) -> None:
        """A rule that ranks a sequence's positions (the budgeted prefill exit) runs every position under its
        budget, prompt included, and its positions leave together at one iteration: prefill exit, physical
        exits, the decision read when it is made."""
        if self.prefill != "exit":
            raise ExitbenchError(f"{self.policy} ranks every position of a scored sequence, its prompt's too, so it "
                                 "runs the prompt with exits: set prefill exit (exitbench run sets it for a sweep of "
                                 "budget rules alone)")
        if self.warm_start or self.cache_layout() != KV_LAYOUTS["latest"]:
            what = "warm_start" if self.warm_start else (f"kv_window {self.kv_window}" if self.kv_window
                                                          else f"kv_layout {self.kv_layout}")
            raise ExitbenchError(f"{self.policy} ranks a sequence's positions at one iteration, which only the "
                                 f"depth-major schedule holds together, and {what} scores one position at a time: "
                                 "drop it")
        if self.exit_mode is not None or self.horizon != "same":
            what = f"exit_mode {self.exit_mode}" if self.exit_mode is not None else f"horizon {self.horizon}"
            raise ExitbenchError(f"{self.policy} stops the positions it does not keep at its chosen iteration; "
                                 f"{what} would change what that means: drop it")

    def coda_bucket(self, batch_size: int) -> int:
        """refill continuous: how many exited tokens' outputs are computed together, and how many sequences a run
        holds beside its `batch_size` places so that none idles while they wait (its spare rows)."""
        return max(1, self.coda_batch or batch_size)

    def cache_layout(self) -> tuple[int | None, int]:
        """(window, private): how the loop layers' cache slots map iterations (models/cache.py)."""
        window, private = KV_LAYOUTS[self.kv_layout]
        return (self.kv_window, 0) if self.kv_window else (window, private)

    def build_policy(self) -> ExitPolicy:
        check_policy_name(self.policy)
        knobs = {name: getattr(self, name) for name in _POLICY_ROLE if name != "policy"}
        if self.fitted_exit_model is not None:
            knobs["exit_model"] = self.fitted_exit_model
        return REGISTRY[self.policy](**knobs)

    def bound_policies(self, groups: Sequence[Any]) -> list[ExitPolicy]:
        """One policy per loop group, its open max_steps fixed from the group's default depth."""
        policies = [self.build_policy().bind(g.default_steps, g) for g in groups]
        for policy in policies:
            policy.seed = self.seed
        return policies

    def never_exits_early(self, groups: Sequence[Any]) -> str | None:
        """Why this config's rule can never exit before full depth in any of the loop groups (one line: the
        earliest iteration it can exit at and what to change), or None where it can somewhere."""
        if REGISTRY[self.policy].signal_free:
            return None
        why = [p.never_exits_early(self.max_steps is not None, g.max_steps)
               for g, p in zip(groups, self.bound_policies(groups))]
        return None if None in why else why[0]

    def changed(self, role: str) -> list[str]:
        """The knobs of `role` set away from their defaults."""
        return [f.name for f in fields(self) if f.metadata["role"] == role and getattr(self, f.name) != f.default]

    @classmethod
    def for_policy(cls, name: str, threshold: float | None, knobs: dict[str, Any]) -> "ExitConfig":
        """A config of policy `name` from knobs shared by several rules (a sweep's, a config compared with
        another rule): those the rule takes none of drop out (`relative` where it reads no step norm, the exit
        model where it is not the learned rule), instead of each caller knowing which rule takes what."""
        check_policy_name(name)
        cls_ = REGISTRY[name]
        kept = {k: v for k, v in knobs.items() if k not in ("policy", "threshold") and cls_.takes(k)}
        return cls(name, threshold=threshold, **kept)

    @classmethod
    def fixed_depth(cls, depth: int | None, knobs: dict[str, Any]) -> "ExitConfig":
        """Full depth r (None: each group's default) run the way `knobs` run tokens: the engine and run knobs
        stay, the policy's go, so a baseline differs from the policies it is compared with only in the rule."""
        kept = {k: v for k, v in knobs.items() if k in cls.names(role="engine") + cls.names(role="run")
                and REGISTRY["fixed"].takes(k)}
        return cls("fixed", threshold=depth, **kept)

    def to_dict(self) -> dict[str, Any]:
        """Every knob; a `when_set` knob only when set away from its default."""
        out = asdict(self)
        for f in fields(self):
            if f.metadata["when_set"] and out[f.name] == f.default:
                del out[f.name]
        return out

    def key_dict(self) -> dict[str, Any]:
        """to_dict() as a cell's key holds it: an exit model by its content, not by where the file lies."""
        out = self.to_dict()
        if self.fitted_exit_model is not None:
            out["exit_model"] = "sha256:" + self.fitted_exit_model.digest
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], what: str = "exit config key") -> "ExitConfig":
        _refuse_unknown(raw, what)
        return cls(**raw)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ExitConfig":
        return cls.with_file(path, {})

    @classmethod
    def with_file(cls, path: str | Path, given: dict[str, Any], where: str | None = None,
                  defaults: dict[str, Any] | None = None) -> "ExitConfig":
        """The config of an exit-config file and the knobs `given` one by one beside it (flags typed, or lm-eval's
        model arguments: `where` names them so, e.g. "exitbench model argument"), over a command's `defaults`
        for the knobs neither sets: how every command reads --exit-config (`file_knobs` says the rule)."""
        spell = (lambda name: f"{where} {name}") if where else None
        return cls.from_dict({**(defaults or {}), **cls.file_knobs(path, given, spell), **given},
                             what=f"knob in exit config {path}")

    @classmethod
    def file_knobs(cls, path: str | Path, given: Iterable[str] = (), spell: Callable[[str], str] | None = None
                   ) -> dict[str, Any]:
        """An exit-config file's knobs, by the one rule of every command: known knobs, at least one, and none of
        the knobs `given` beside it, one of which would otherwise be silently dropped. `spell` says how the
        user gave a knob (default its flag, `--min-steps`)."""
        raw = cls.read_yaml(path)
        _refuse_unknown(raw, f"knob in exit config {path}")
        if not raw:
            raise ExitbenchError(f"exit config {path} sets no knob; give at least its policy, or leave "
                                 "--exit-config out")
        # typed here, so a wrong value is named by the file whatever the policy it ends up beside
        parse(_typed_knobs(), {**{f.name: f.default for f in fields(cls)}, **raw}, f"exit config {path}")
        both = sorted(set(raw) & set(given))
        if both:
            name = spell(both[0]) if spell else "--" + both[0].replace("_", "-")
            raise ExitbenchError(f"{both[0]} is set both in exit config {path} and by {name}; set it in one place")
        return raw

    @staticmethod
    def read_yaml(path: str | Path) -> dict[str, Any]:
        """An exit-config file's knobs as written (a mapping), unchecked."""
        try:
            raw = yaml.load(Path(path).read_text(), Loader=_KnobLoader) or {}
        except OSError as exc:
            raise ExitbenchError(f"cannot read exit config {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ExitbenchError(f"cannot read exit config {path}: not valid YAML{where}: {problem}") from None
        if not isinstance(raw, dict):
            raise ExitbenchError(f"exit config {path} must be a mapping of knobs")
        return raw

    @classmethod
    def knobs(cls, *, role: str | None = None, swept: bool | None = None, command_line: bool | None = None
              ) -> list[tuple[str, Any, Any, dict]]:
        """(name, type, default, metadata) of each knob, filtered by its metadata."""
        hints = typing.get_type_hints(cls)
        return [(f.name, hints[f.name], f.default, dict(f.metadata)) for f in fields(cls)
                if (role is None or f.metadata["role"] == role)
                and (swept is None or f.metadata["swept"] == swept)
                and (command_line is None or f.metadata["command_line"] == command_line)]

    @classmethod
    def names(cls, **selected: Any) -> list[str]:
        """The names of the knobs `knobs(**selected)` gives."""
        return [name for name, *_ in cls.knobs(**selected)]


# The policies take their knobs by keyword (POLICY_KNOBS, their constructor's contract); the fields of the policy
# role are the same list, checked here so the two cannot drift apart.
_POLICY_ROLE = ExitConfig.names(role="policy")
if set(_POLICY_ROLE) - {"policy"} != set(POLICY_KNOBS):
    raise AssertionError(f"ExitConfig's policy knobs {_POLICY_ROLE} and the policies' {POLICY_KNOBS} differ")


def _refuse_unknown(raw: dict[str, Any], what: str) -> None:
    known = sorted(f.name for f in fields(ExitConfig))
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ExitbenchError(f"unknown {what} {unknown[0]!r}; known: {', '.join(known)}")


@functools.cache
def _typed_knobs() -> type[BaseModel]:
    """ExitConfig's fields as a strict pydantic model: the dataclass's annotations are the one statement of
    each knob's type, so `relative: "no"`, `warm_start: 3` or `seed: abc` are refused rather than read as
    true, true and a crash later (a float knob still takes an int: 1 is a threshold)."""
    hints = typing.get_type_hints(ExitConfig)
    return create_model("ExitKnobs", __config__=ConfigDict(strict=True),
                        **{f.name: (hints[f.name], ...) for f in fields(ExitConfig)})


class _KnobLoader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `5e-4` (no dot) is a string; YAML 1.2, and every user writing a threshold,
    means a float. This loader adds 1.2's float forms and is otherwise SafeLoader."""


_KnobLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
