"""One vLLM forward of a looped model with per-token exits, written against exitbench's own pieces and free of
vLLM (the attention it calls is passed in), so the rule it runs is exitbench's, step for step.

vLLM hands a model a flat batch: N scheduled tokens of several requests, each with its position. Every token
runs the loop group to K = the policy's max_steps under exit mode freeze (what vLLM's KV layout asks for: it
writes every scheduled token's keys and values at every attention call): from the iteration its rule fires, a
token's state is pinned, its MLP skipped, while its attention keeps writing entries from the pinned state
(`LoopGroup.frozen_step`, exactly what exitbench's engine runs under `--exit-mode freeze`). Tokens whose outputs
nobody reads (a prompt's prefix, exitbench's prefill="full") run all K iterations without a rule, as the
engine's prefill does.

Attention goes through `Bridge`, which stands where exitbench's KV cache stands in an `AttnContext`: a layer's
call at loop iteration i reaches the attention of (layer, i), one vLLM Attention instance each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...engine.config import ExitConfig
from ...engine.noise import PositionNoise
from ...errors import ExitbenchError
from ...models import AttnContext, LoopedLM
from ...policies import REGISTRY

# attend(layer_id, iteration, q (N, H·D), k (N, H_kv·D), v (N, H_kv·D)) -> (N, H·D)
Attend = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SERVED_MODES = ("freeze",)


def vllm_own_model(architecture: str) -> str:
    """Whether the installed vLLM ships a model of its own by this name: one that runs the loop count it was
    started with, with no per-token exits, so the exit plugin cannot use it."""
    import importlib.util

    try:
        ships = importlib.util.find_spec(f"vllm.model_executor.models.{architecture}") is not None
    except ModuleNotFoundError:  # no vLLM at all
        return "and no vLLM is installed"
    return (f"the installed vLLM has its own {architecture} model, which runs a fixed loop count with no per-token "
            "exits" if ships else f"the installed vLLM has no {architecture} model either")


def check_servable(model: LoopedLM, config: ExitConfig) -> None:
    """Refuse, in one line, what the plugin cannot serve: it runs one loop group under exit mode freeze (or a
    fixed depth, where no token exits), with readouts that attend to no other token when the rule decodes."""
    from . import MODEL_TYPES

    groups = model.loop_groups()
    if model.architecture not in MODEL_TYPES:  # the plugin registers these alone: vLLM would fail on the config
        raise ExitbenchError(f"the vLLM backend serves {', '.join(MODEL_TYPES)} checkpoints (Raven's layout: "
                             f"tiny-raven, Huginn-0125); this is a {model.architecture} model "
                             f"({vllm_own_model(model.architecture)}): use --backend hf")
    if len(groups) != 1 or groups[0].frozen_step is None:
        raise ExitbenchError(f"the vLLM backend serves models with one loop group that has a freeze step (Raven's "
                             f"layout: tiny-raven, Huginn-0125); this {model.architecture} model has "
                             f"{len(groups)} loop group(s){'' if len(groups) != 1 else ' and no freeze step'}; "
                             "use --backend hf")
    if REGISTRY[config.policy].drafts:
        raise ExitbenchError(f"{config.policy} drafts and verifies in exitbench's own passes, which the vLLM backend "
                             "does not run; use --backend hf")
    if config.policy != "fixed" and config.exit_mode not in SERVED_MODES:
        raise ExitbenchError(f"the vLLM backend runs per-token exits in exit mode freeze only (vLLM writes every "
                             f"scheduled token's keys at every iteration), got exit mode "
                             f"{config.exit_mode or 'physical'}; add --exit-mode freeze, or use --backend hf")
    if (config.warm_start or config.kv_window or config.kv_layout != "latest" or config.prefill != "full"
            or config.causal_prompt
            or config.refill != "continuous" or config.coda_batch is not None or config.horizon != "same"):
        raise ExitbenchError("the vLLM backend runs the default engine knobs (prefill full, no warm_start, no "
                             "kv_window or kv_layout, no causal_prompt, horizon same, and vLLM's own scheduler in place of "
                             "--refill and --coda-batch); drop those knobs or use --backend hf")
    policy = config.bound_policies(groups)[0]
    if policy.needs_logits and model.readout_attention(0):
        raise ExitbenchError(f"{config.policy} reads logits at every iteration, and this model's readout runs "
                             "attention layers after the loop (a coda), which the vLLM backend does not probe; "
                             "use a latent rule (second_order, first_order, contraction), fixed, or --backend hf")
    if policy.retrospective:
        raise ExitbenchError(f"{config.policy} decides after the whole trajectory; the vLLM backend cannot pin a "
                             "state for it: use --backend hf")


@dataclass
class IterationIndex:
    """What a layer reads off `ctx.index`: the iteration whose attention it calls (`by_row` routes exitbench's
    attention to `Bridge.attend_by_row`; no `spans`: vLLM's cache is never read in place by exitbench)."""

    iteration: int
    by_row: bool = True
    spans: None = None


class Bridge:
    """exitbench's KV cache's place in an `AttnContext`, for tokens laid out one per row (N, 1, d)."""

    def __init__(self, attend: Attend):
        self.attend = attend

    def at_iteration(self, places, iteration: int | torch.Tensor, host: list[int] | None = None) -> IterationIndex:
        return IterationIndex(int(iteration))

    def attend_by_row(self, layer_id: int, index: IterationIndex, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        # q (N, H, 1, D), k and v (N, H_kv, 1, D), as exitbench's attention hands them over; back as q's shape
        n, h, _, d = q.shape
        out = self.attend(layer_id, index.iteration, q.reshape(n, h * d), k.reshape(n, -1), v.reshape(n, -1))
        return out.view(n, 1, h, d).transpose(1, 2)


class ExitForward:
    """The looped model's forward for vLLM's flat batch, with the config's rule per token."""

    def __init__(self, model: LoopedLM, config: ExitConfig):
        check_servable(model, config)
        self.model, self.config = model, config
        self.group = model.loop_groups()[0]
        self.policy = config.bound_policies([self.group])[0]
        self.K = self.policy.max_steps
        self.bound = next(i for i, st in enumerate(model.stages()) if st is self.group)
        self.readout_steps = [min(self.group.default_steps, self.K)]
        dim = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device)).shape[-1]
        self.noise = PositionNoise(config.seed, dim)
        self.vocab = model.output_size

    def context(self, bridge: Bridge, positions: torch.Tensor) -> AttnContext:
        # token mode, one token per row: each reads its own request's keys through vLLM (places only marks it so)
        return AttnContext(cache=bridge, positions=positions, places=True, index=IterationIndex(0), rotations={})

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, exits: list[bool], bridge: Bridge
                 ) -> tuple[torch.Tensor, list[int]]:
        """The states the head reads (N, d) and each token's exit iteration (K for a token without a rule)."""
        model, group, policy = self.model, self.group, self.policy
        ctx = self.context(bridge, positions)
        x = model.walk(model.embed(ids[:, None]), ctx, start=0, stop=self.bound)
        pos = positions.tolist()
        noise = self.noise.at(pos, x.dtype, x.device).unsqueeze(1) if group.random_init else None
        s = group.init(x, noise)
        n = len(pos)
        ruled = [j for j in range(n) if exits[j]]
        chosen: dict[int, tuple[int, torch.Tensor]] = {}  # token -> (its exit iteration, its pinned state)
        memory = policy.start(s[:, 0], self.vocab) if ruled and not policy.signal_free else None
        streak = [0] * n
        for k in range(1, self.K + 1):
            step_ctx = ctx.at_iteration(k - 1)
            if chosen:
                keep = torch.tensor([j for j in range(n) if j not in chosen], dtype=torch.long, device=s.device)
                s = group.frozen_step(s, x, step_ctx, keep)
            else:
                s = group.step(s, x, step_ctx)
            if memory is None or k == self.K:
                continue
            self._probe(s, k, memory, streak, ruled, chosen)
        steps = [self.K] * n
        final = s
        if chosen:
            final = s.clone()
            for j, (k, state) in chosen.items():
                steps[j] = k
                final[j] = state
        out = model.walk(group.finish(final), ctx.at_iteration(0), start=self.bound + 1)
        return out[:, 0], steps

    def _probe(self, s: torch.Tensor, k: int, memory: dict, streak: list[int], ruled: list[int],
               chosen: dict[int, tuple[int, torch.Tensor]]) -> None:
        """The rule after iteration k, as exitbench's TokenLoop probes (its signal in float64 from the readout's
        log-probabilities; `decide` with its hit streaks): a ruled token it lets go is pinned here."""
        policy = self.policy
        logits = self.model.readout(0, s, AttnContext(), self.readout_steps)[:, 0] if policy.needs_logits else None
        at = [k] * s.shape[0]
        leave = policy.decide(at, policy.read(at, policy.probe_signal(s[:, 0], memory, logits).tolist()), streak)
        for j in ruled:
            if leave[j] and j not in chosen:
                chosen[j] = (k, s[j].clone())
