"""What a sweep is: its config, the command line's text form of it, and every refusal of its options.

`RunOptions` is `exitbench run`'s options as typed (the CLI derives its flags from these fields, as it derives
the exit knobs from ExitConfig's); `SweepConfig.from_options` parses them, applies a preset, and refuses what
cannot run, all before a checkpoint loads. `grid` is the sweep's exit configs; `check_depths` and
`check_named` are the refusals that need the loaded model, made when the sweep is planned.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from ..engine import ExitConfig
from ..engine.recorder import check_recordable
from ..errors import ExitbenchError
from ..harness.prompting import Prompting
from ..policies import REGISTRY, check_policy_name
from ..policies.grids import parse_depths, parse_quantiles, parse_thresholds
from ..runtime.distributed import init_distributed
from ..runtime.options import (checkpoint_option, compile_option, data_dir_option, dtype_option, nonfinite_option,
                               option, threads_option)
from ..runtime.validation import at_least
from ..timing import retime, trust
from . import backends


@dataclass
class RunOptions:
    """`exitbench run`'s options as the command line gives them (text, unparsed)."""
    tasks: str = field(default="chains", metadata=option("Comma-separated lm-eval task names.", "--tasks", "-t"))
    policy: list[str] = field(default_factory=lambda: ["second_order"], metadata=option(
        "Exit policy (repeatable), or 'all'.", "--policy", "-p"))
    thresholds: Optional[str] = field(default=None, metadata=option(
        "Comma-separated thresholds, or quantiles:N: N thresholds at quantiles of each rule's own signal, from "
        "one recording pass (default: each policy's grid)."))
    baselines: Optional[str] = field(default=None, metadata=option(
        "Fixed depths, comma-separated (default 1,2,4,…,max)."))
    exit_config: Optional[Path] = field(default=None, metadata=option(
        "An exit-config YAML: its knobs (an all_of conjunction's rules among them) are the sweep's, its policy "
        "and threshold the sweep's where --policy / --thresholds are not given.", "--exit-config"))
    checkpoint: Optional[str] = checkpoint_option()
    dtype: str = dtype_option()
    allow_nonfinite: bool = nonfinite_option()
    limit: Optional[float] = field(default=None, metadata=option(
        "Documents per task (testing only; <1 = fraction)."))
    num_fewshot: Optional[int] = field(default=None, metadata=option("Few-shot examples (default: the task's)."))
    batch_size: int = field(default=16, metadata=option("Sequences run together (never changes answers)."))
    seed: int = field(default=0, metadata=option("Seed of lm-eval's sampling and the initial-state noise."))
    out: Optional[Path] = field(default=None, metadata=option(
        "Result directory (default results/<checkpoint name>)."))
    shard: Optional[str] = field(default=None, metadata=option("Run only cells j with j % n == i, as i/n."))
    data_dir: Optional[Path] = data_dir_option()
    include_path: list[Path] = field(default_factory=list, metadata=option("More lm-eval task folders."))
    log_samples: Optional[bool] = field(default=None, metadata=option(
        "Write each cell's samples with per-token exits beside it, what the report's exit maps draw (default: "
        "on for the cells this run computes; --log-samples also recomputes finished cells that have none).",
        "--log-samples/--no-log-samples"))
    add_bos_token: Optional[bool] = field(default=None, metadata=option(
        "Force BOS on (or off) every request, as lm-eval's hf model's add_bos_token (default: the tokenizer "
        "decides).", "--add-bos-token/--no-add-bos-token"))
    device: Optional[str] = field(default=None, metadata=option(
        "auto, cpu, cuda, cuda:N or mps (default auto: cuda when available)."))
    quiet: bool = field(default=False, metadata=option(
        "No progress and no lm-eval chatter; warnings and the table still print.", "--quiet"))
    replay: bool = field(default=False, metadata=option(
        "Every cell from one recording pass (mode: replay; docs/sweeps.md says when to trust it).", "--replay"))
    verify: bool = field(default=False, metadata=option(
        "With --replay: rerun each policy's frontier cells exactly into OUT/verify and print replay vs exact.",
        "--verify"))
    verify_cells: Optional[str] = field(default=None, metadata=option(
        "With --verify: more cells to rerun exactly, as policy:threshold pairs (kl:1e-3,…).", "--verify-cells"))
    apply_chat_template: bool = field(default=False, metadata=option(
        "Render prompts with the tokenizer's chat template, as lm-eval's --apply_chat_template.",
        "--apply-chat-template"))
    chat_template: Optional[str] = field(default=None, metadata=option(
        "Which of several named chat templates (implies --apply-chat-template).", "--chat-template"))
    system_instruction: Optional[str] = field(default=None, metadata=option(
        "A system prompt before every request (lm-eval's --system_instruction).", "--system-instruction"))
    fewshot_as_multiturn: Optional[bool] = field(default=None, metadata=option(
        "Few-shot examples as chat turns [lm-eval's default].", "--fewshot-as-multiturn/--no-fewshot-as-multiturn"))
    gen_kwargs: Optional[str] = field(default=None, metadata=option(
        "Generation settings k=v,… over each task's (lm-eval's --gen_kwargs), e.g. max_gen_toks=512.",
        "--gen-kwargs"))
    preset: Optional[str] = field(default=None, metadata=option(
        "A family's published protocol (`exitbench presets`): task, shots, template, dtype, depths; flags "
        "override it.", "--preset"))
    compile_step: bool = compile_option()
    threads: Optional[int] = threads_option()
    timing_repeats: int = field(default=retime.DEFAULT_REPEATS, metadata=option(
        "After each cell, time documents drawn across each task again this often beside full depth, "
        "alternately: a paired speed-up with its range (0: none; replay cells never).", "--timing-repeats"))
    timing_stream: Optional[int] = field(default=None, metadata=option(
        "Documents in the throughput clock's stream (default: three batches, at most an eighth of the task); its "
        "time is the engine's steady state, while the queue still holds requests (docs/engine.md).",
        "--timing-stream"))
    backend: str = field(default="hf", metadata=option(
        "Which engine runs the cells: hf (exitbench's own) or vllm (its exit rules inside vLLM, exit mode freeze; "
        "pip install 'exitbench[vllm]', docs/serving.md). A vllm cell says so in its key.", "--backend"))
    memory_check: bool = field(default=True, metadata=option(
        "Refuse, before the first cell, a sweep whose memory plan exceeds the device's free memory.",
        "--memory-check/--no-memory-check"))


@dataclass
class SweepConfig:
    tasks: list[str]
    policies: list[str]
    thresholds: list[float] | None = None
    # --thresholds quantiles:N: each rule's grid from its own signal (sweep/quantiles.py), derived when the sweep
    # opens into `derived` (the grids and how they were made, recorded in every cell's run section).
    quantiles: int | None = None
    derived: dict[str, Any] | None = None
    baselines: list[int] | None = None
    limit: int | float | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    seed: int = 0
    shard: tuple[int, int] = (0, 1)
    log_samples: bool = False
    # A finished cell without a samples file is computed again only when samples were asked for by name: on by
    # default, they must not make a resumed sweep recompute every cell an older exitbench wrote.
    samples_required: bool = False
    # Exit knobs every cell shares (ExitConfig fields other than policy and threshold, which the sweep varies).
    exit: dict[str, Any] = field(default_factory=dict)
    bootstrap_iters: int = 1000
    add_bos_token: bool | None = None
    quiet: bool = False  # lm-eval's own chatter (warnings, bootstrap lines, request bars) silenced
    replay: bool = False  # cells computed from one recording pass (exitbench.sweep.replay), keyed apart from exact
    prompting: Prompting = field(default_factory=Prompting)  # chat template, system instruction, gen_kwargs
    preset: Any = None  # the presets.Preset the options came from: its published numbers go into each cell
    # Paired timings of each cell against full depth after its evaluation (timing/retime.py); 0: none. Not in
    # a cell's key: they add numbers to the cell and change none of its others.
    timing_repeats: int = retime.DEFAULT_REPEATS
    timing_stream: int | None = None  # the throughput clock's stream, in documents (None: retime.sample_size's)
    # The engine the cells run on (exitbench.serving.vllm for "vllm"); in the key only when not hf, so the hf
    # cells keep their ids.
    backend: str = "hf"
    extra: dict[str, Any] = field(default_factory=dict)
    # Where and how the sweep runs (sweep/run.py): none of these is in a cell's key.
    checkpoint: str | None = None  # directory or embedded name; None: the embedded default
    dtype: str = "auto"
    allow_nonfinite: bool = False
    device: str | None = None
    out: Path | None = None  # None: results/<checkpoint name>
    data_dir: Path | None = None
    include_path: list[Path] = field(default_factory=list)
    verify: bool = False  # replay: rerun each policy's frontier exactly
    verify_cells: list[tuple[str, float]] = field(default_factory=list)  # more (policy, threshold) to rerun
    compile_step: bool = False
    memory_check: bool = True

    @classmethod
    def from_options(cls, options: RunOptions, knobs: dict[str, Any], given: set[str] = frozenset()
                     ) -> "SweepConfig":
        """The sweep `exitbench run` was asked for, every option parsed and refused here, before a checkpoint
        loads. `given`: the options typed on the command line, which a preset never overrides."""
        chosen = None
        if options.preset is not None:
            from .. import presets

            chosen = presets.load(options.preset)
            picked = {f.name: getattr(options, f.name) for f in fields(options)}
            options = RunOptions(**presets.apply(chosen, picked, given))
            knobs = {**knobs, **preset_knobs(chosen, given)}
        o = options
        if o.exit_config is not None:
            o, knobs = with_exit_config(o, knobs, given)
        knobs = budget_prefill(o.policy, knobs, given)
        quantiles = parse_quantiles(o.thresholds)
        cfg = cls(tasks=[t.strip() for t in o.tasks.split(",") if t.strip()], policies=o.policy,
                  thresholds=None if quantiles else parse_thresholds(o.thresholds), quantiles=quantiles,
                  baselines=parse_depths(o.baselines, "--baselines"),
                  limit=parse_limit(o.limit), num_fewshot=o.num_fewshot, batch_size=o.batch_size, seed=o.seed,
                  shard=parse_shard(o.shard), log_samples=o.log_samples is not False,
                  samples_required=o.log_samples is True, exit=knobs, quiet=o.quiet,
                  add_bos_token=o.add_bos_token, replay=o.replay, preset=chosen,
                  prompting=Prompting(o.chat_template or o.apply_chat_template, o.system_instruction,
                                      o.fewshot_as_multiturn, o.gen_kwargs),
                  timing_repeats=o.timing_repeats, timing_stream=o.timing_stream, checkpoint=o.checkpoint,
                  dtype=o.dtype,
                  allow_nonfinite=o.allow_nonfinite, device=o.device, out=o.out, data_dir=o.data_dir,
                  include_path=list(o.include_path), compile_step=o.compile_step, memory_check=o.memory_check,
                  backend=o.backend)
        if chosen is not None and chosen.thresholds and "thresholds" not in given and "policy" not in given:
            # not in the key, as quantiles' grids: a cell at τ is the same cell however τ was chosen
            cfg.derived = {"from": f"preset {chosen.name}", "grids": dict(chosen.thresholds)}
        cfg.verify_cells = check_mode(cfg, o.verify, o.verify_cells)
        cfg.verify = o.verify or bool(cfg.verify_cells)
        cfg.check_counts()
        return cfg

    def check_counts(self) -> None:
        backends.check_options(self.backend, self)
        at_least("--batch-size", self.batch_size)
        at_least("--timing-repeats", self.timing_repeats, 0)
        if self.timing_repeats > trust.MAX_REPEATS:  # each repeat reruns an eighth of every task twice
            raise ExitbenchError(f"--timing-repeats {self.timing_repeats}: at most {trust.MAX_REPEATS} (each "
                                 "repeat times the cell and full depth again; more repeats do not narrow this "
                                 "machine's noise, see bench/RESULTS.md)")
        if self.num_fewshot is not None:
            at_least("--num-fewshot", self.num_fewshot, 0)
        if self.timing_stream is not None and self.timing_stream < self.batch_size:
            raise ExitbenchError(f"--timing-stream {self.timing_stream} is shorter than the batch "
                                 f"(--batch-size {self.batch_size}): a throughput stream needs more documents than "
                                 "rows, or no row ever takes a second request; give at least the batch size")


def preset_knobs(preset: Any, given: set[str]) -> dict[str, Any]:
    """A published sweep's shared exit knobs that the command line did not set, each refused in one line where it
    is not a knob a sweep shares or its rules are not exitbench's."""
    for name in preset.policies:
        check_policy_name(name)
    stray = sorted(set(preset.thresholds) - set(preset.policies))
    if stray:
        raise ExitbenchError(f"preset {preset.name} gives thresholds for {stray[0]}, which is not among its policies "
                             f"({', '.join(preset.policies) or 'none'})")
    shared = set(ExitConfig.names(command_line=True, swept=False))
    for name in preset.exit:
        if name not in shared:
            raise ExitbenchError(f"preset {preset.name}: exit knob {name!r} is not one a sweep's rules share "
                                 f"({', '.join(sorted(shared))})")
    return {k: v for k, v in preset.exit.items() if k not in given}


def with_exit_config(options: RunOptions, knobs: dict[str, Any], given: set[str]
                     ) -> tuple[RunOptions, dict[str, Any]]:
    """--exit-config FILE beside the options typed, by every command's one rule (`ExitConfig.file_knobs`): a knob
    set in both places is refused. The file's policy, threshold and seed are the sweep's --policy, --thresholds
    (so `--thresholds` sweeps a conjunction's varied rule when the file leaves its threshold open) and --seed."""
    path = options.exit_config
    typed = {k for k in knobs if k in given} | {k for k in ("policy", "seed") if k in given}
    typed |= {"threshold"} if "thresholds" in given else set()
    raw = ExitConfig.file_knobs(path, typed, spell=lambda k: "--" + RUN_SPELLING.get(k, k).replace("_", "-"))
    policy = [raw["policy"]] if "policy" in raw else options.policy
    thresholds = repr(raw["threshold"]) if raw.get("threshold") is not None else options.thresholds
    knobs = {**knobs, **{k: v for k, v in raw.items() if k not in ("policy", "threshold", "seed")}}
    for name in (n for n in policy if n != "all"):  # what the file's knobs mean to each rule, before a checkpoint
        ExitConfig.for_policy(name, raw.get("threshold"), knobs)
    return replace(options, policy=policy, thresholds=thresholds, seed=raw.get("seed", options.seed)), knobs


# The exit knobs `run` takes under another option's name.
RUN_SPELLING = {"threshold": "thresholds"}


def budget_prefill(policies: list[str], knobs: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The shared knobs of a sweep of budgeted prefill exits (rules that rank a sequence's positions, prompt
    included): prefill exit, so that its fixed-depth baselines loop the prompt too and the paired clocks and the
    frontier compare the same work. Refused in one line where --prefill full was typed, or where other rules
    would silently run under prefill exit with them."""
    names = [n for n in policies if n != "all"]
    for n in names:
        check_policy_name(n)
    budget = [n for n in names if REGISTRY[n].ranks_positions]
    if not budget or knobs.get("prefill", "full") == "exit":
        return knobs
    if "prefill" in given:
        raise ExitbenchError(f"--prefill {knobs['prefill']}: {budget[0]} ranks every position of a scored sequence, "
                             "its prompt's too, so it runs the prompt with exits; drop --prefill (or give exit)")
    others = [n for n in names if n not in budget and n != "fixed"] + (["all"] if "all" in policies else [])
    if others:
        raise ExitbenchError(f"{budget[0]} runs prompts with exits (prefill exit), and {others[0]} would then run so "
                             f"too: give --prefill exit to run them all so, or run {budget[0]} in a sweep of its own")
    return {**knobs, "prefill": "exit"}


def check_mode(cfg: SweepConfig, verify: bool = False, verify_cells: str | None = None) -> list[tuple[str, float]]:
    """What the chosen mode refuses, from the options alone (before a checkpoint loads); the named cells."""
    if (verify or verify_cells) and not cfg.replay:
        raise ExitbenchError("--verify checks a replay sweep against exact runs; add --replay")
    if not cfg.replay:
        return []
    check_replayable(cfg)  # before planning, which may build the tasks to count their documents
    return parse_named(verify_cells)


def check_replayable(cfg: SweepConfig) -> None:
    if cfg.shard != (0, 1) or init_distributed()[1] > 1:
        raise ExitbenchError("--replay runs in one process (its cost is one recording pass); drop --shard and "
                             "torchrun, or run without --replay")
    check_recordable(cfg.exit, "run")
    if cfg.preset is not None:
        raise ExitbenchError("--preset reproduces published fixed-depth numbers exactly; run it without --replay")
    if cfg.prompting.key_dict():
        raise ExitbenchError("--replay does not take --apply-chat-template, --system-instruction, "
                             "--fewshot-as-multiturn or --gen-kwargs yet; run those cells exactly (without --replay)")


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ExitbenchError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ExitbenchError(f"--shard {text}: need 0 ≤ i < n (shards are numbered from 0)")
    return i, n


def parse_limit(limit: float | None) -> int | float | None:
    if limit is None:
        return None
    # `not limit > 0` also catches nan, which every comparison fails and lm-eval would only trip over later.
    if not limit > 0 or not math.isfinite(limit):
        raise ExitbenchError(f"--limit must be a finite number > 0 (documents per task, or a fraction < 1 of "
                             f"them), got {limit:g}; leave it out for every document")
    return int(limit) if limit >= 1 else limit


def parse_named(text: str | None) -> list[tuple[str, float]]:
    """`policy:threshold` pairs, comma-separated (e.g. kl:1e-3,second_order:0.316); None: the option not given."""
    if text is not None and not text.replace(",", "").strip():
        raise ExitbenchError("--verify-cells is empty; name policy:threshold pairs (e.g. kl:1e-3) or leave the "
                             "option out")
    out = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, tau = part.strip().partition(":")
        try:
            out.append((name, float(tau)))
        except ValueError:
            raise ExitbenchError(f"--verify-cells wants policy:threshold pairs (e.g. kl:1e-3), got {part.strip()!r}"
                                 ) from None
        if not sep:
            raise ExitbenchError(f"--verify-cells wants policy:threshold pairs (e.g. kl:1e-3), got {part.strip()!r}")
    return out


def expand_policies(names: list[str]) -> list[str]:
    if not names:
        raise ExitbenchError("--policy names no policy; give one or more, or 'all'")
    if "all" in names:  # every exit rule: not the budgeted prefill exits (they need a scoring task and prefill exit)
        # nor depth speculation (the baseline the rules are compared with), each asked for by name
        return [n for n in REGISTRY if n != "fixed" and not REGISTRY[n].ranks_positions and not REGISTRY[n].drafts]
    for n in names:
        check_policy_name(n)  # unknown names fail here, with the closest match
    return [n for n in dict.fromkeys(names) if n != "fixed"]


def default_baselines(max_steps: int) -> list[int]:
    """Every depth of a loop of at most four (the families that loop so few times publish each depth as an
    operating point: Ouro's T = 1–4), else 1, 2, 4, … and full depth."""
    if max_steps <= 4:
        return list(range(1, max_steps + 1))
    rs, r = [], 1
    while r < max_steps:
        rs.append(r)
        r *= 2
    return rs + [max_steps]


def grid(cfg: SweepConfig, default_steps: int, grids: dict[str, tuple[float, ...]] | None = None,
         gated: bool = False) -> list[ExitConfig]:
    """Exit configs of the sweep: fixed-depth baselines first, then each policy over its thresholds (`grids`:
    the model's own default grids, `LoopedLM.exit_grids`, else the rule's). The shared exit knobs go to the
    policies that take them; a baseline keeps those that change how it runs (prefill, warm start, KV window).
    `gated`: the model has a trained exit gate, so 'all' includes the gate rules."""
    swept = {name for name, *_ in ExitConfig.knobs(swept=True)}
    shared = {k: v for k, v in cfg.exit.items() if k not in swept}
    unknown = sorted(set(shared) - {name for name, *_ in ExitConfig.knobs()})
    if unknown:
        raise ExitbenchError(f"unknown exit knob {unknown[0]!r} for a sweep")
    # By default the baselines end at the sweep's full depth, the cap its rules run to (--max-steps, else the
    # loop's default): the depth every ratio and matched-quality row is taken against.
    depths = cfg.baselines or default_baselines(cfg.exit.get("max_steps") or default_steps)
    configs = [ExitConfig.fixed_depth(r, {**shared, "seed": cfg.seed}) for r in depths]
    names = _runnable(cfg, shared, gated)
    full = cfg.exit.get("max_steps") or default_steps
    # Speculation drafts at the sweep's depths below full depth, by default.
    grids = {"speculate": tuple(r for r in default_baselines(full) if r < full), **(grids or {})}
    for name in names:
        # A conjunction sweeps its varied member's threshold, over that member's grid; speculation by an exit
        # rule its draft rule's.
        rule = ExitConfig.for_policy(name, None, shared).build_policy() \
            if REGISTRY[name].takes_rules or REGISTRY[name].drafts else REGISTRY[name]
        swept = _grid_name(rule)
        grids.setdefault(swept, REGISTRY[swept].default_grid)
        configs += [ExitConfig.for_policy(name, tau, {**shared, "seed": cfg.seed})
                    for tau in _thresholds(rule, swept, cfg.thresholds, grids)]
    unique = {json.dumps(c.to_dict(), sort_keys=True): c for c in configs}  # (an all_of's rules are a list)
    return list(unique.values())


def _runnable(cfg: SweepConfig, shared: dict[str, Any], gated: bool) -> list[str]:
    """The policies asked for that this sweep can run ('all': those without a missing exit model or gate)."""
    names = expand_policies(cfg.policies)
    if "all" in cfg.policies and not shared.get("exit_model"):
        names = [n for n in names if not REGISTRY[n].needs_exit_model]
    if "all" in cfg.policies and not gated:
        names = [n for n in names if not REGISTRY[n].needs_gate]
    if "all" in cfg.policies and not shared.get("rules"):
        names = [n for n in names if not REGISTRY[n].takes_rules]
    if shared.get("horizon", "same") != "same" and not any(REGISTRY[n].decides_as_it_runs() for n in names):
        raise ExitbenchError(f"--horizon {shared['horizon']} reads a rule's exit decision one iteration late, and "
                             f"it applies to none of the policies asked for ({', '.join(cfg.policies)}): the oracle "
                             "decides after the whole trajectory and fixed depths by counting")
    if (cfg.thresholds or cfg.quantiles) and not any(not REGISTRY[n].retrospective for n in names):
        given = f"quantiles:{cfg.quantiles}" if cfg.quantiles else ','.join(f'{t:g}' for t in cfg.thresholds)
        raise ExitbenchError(f"--thresholds {given} apply to none of the policies "
                             f"asked for ({', '.join(cfg.policies)}): fixed depths are set with --baselines, and "
                             "the oracle has no threshold to sweep")
    return names


def _grid_name(rule: Any) -> str:
    """Whose grid a rule sweeps: its own, a conjunction's varied member's, a speculation's draft rule's."""
    if rule.takes_rules:
        return rule.vary
    if rule.drafts and isinstance(rule.draft, dict):
        return rule.draft.get("policy", rule.name)
    return rule.name


def _thresholds(cls: Any, name: str, given: list[float] | None, grids: dict[str, tuple[float, ...]] | None
                ) -> list[float]:
    if cls.retrospective:
        return [cls.default_threshold]
    out = []
    for tau in given or list((grids or {}).get(name, cls.default_grid)):
        if cls.integer_threshold and float(tau) != int(tau):
            raise ExitbenchError(f"--thresholds {tau:g}: {name} counts iterations, so its thresholds must be "
                                 "whole numbers; sweep it in a run of its own")
        out.append(int(tau) if cls.integer_threshold else tau)
    return out


def check_depths(configs: list[ExitConfig], groups: list[Any]) -> None:
    """Every config's depths within each loop group's maximum, and its step knobs consistent, checked when the
    sweep is planned: the engine would refuse the same config only when its cell came up, after the cells
    before it had been computed."""
    for config in configs:
        for g, policy in zip(groups, config.bound_policies(groups)):  # min_steps > max_steps fails here too
            if policy.max_steps <= g.max_steps:
                continue
            what = (f"--baselines {policy.max_steps}: a fixed depth of {policy.max_steps}" if config.policy == "fixed"
                    else f"--max-steps {policy.max_steps}")
            raise ExitbenchError(f"{what} exceeds the {g.name} group's maximum of {g.max_steps} iterations (the "
                                 f"checkpoint's configured maximum); give at most {g.max_steps}")


def reachable(configs: list[ExitConfig], cfg: SweepConfig, groups: list[Any]) -> list[ExitConfig]:
    """The configs whose rule can exit before full depth on these loop groups, checked when the sweep is planned: a
    row that cannot is not a measurement of its rule. A threshold typed on the command line that cannot is refused;
    a point of a grid the sweep chose (a rule's own, or derived by quantiles:N) is left out, and a rule none of whose
    points can is refused, unless `--policy all` asked for every rule this model can run."""
    every = "all" in cfg.policies
    kept, why = [], {}
    for config in configs:
        reason = config.never_exits_early(groups)
        if reason is None:
            kept.append(config)
        elif cfg.thresholds is not None and not every:
            raise ExitbenchError(reason)
        else:
            why.setdefault(config.policy, reason)
    left = {c.policy for c in kept}
    for name, reason in why.items():
        if name not in left and not every:
            raise ExitbenchError(reason)
    if why and left <= {"fixed"}:  # --policy all where no rule can: say why the first one cannot
        raise ExitbenchError(next(iter(why.values())))
    return kept


def check_named(named: list[tuple[str, float]], configs: list[ExitConfig]) -> None:
    """Each named cell is one the sweep has: a name or threshold it lacks would otherwise verify nothing, without
    a word. Checked when the sweep is planned, before any cell is computed."""
    have: dict[str, set[float]] = {}
    for c in configs:
        if c.threshold is not None:
            have.setdefault(c.policy, set()).add(float(c.threshold))
    for name, tau in named:
        if tau in have.get(name, ()):
            continue
        swept = "; ".join(f"{p} at {', '.join(f'{t:g}' for t in sorted(ts))}" for p, ts in have.items())
        what = (f"policy {name!r} is not in this sweep" if name not in have
                else f"{name} has no threshold {tau:g} in this sweep")
        raise ExitbenchError(f"--verify-cells {name}:{tau:g}: {what}; the sweep has {swept}")
