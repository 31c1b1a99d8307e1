"""The vLLM model class of exitbench's looped checkpoints (Raven's layout): exitbench's own model, loaded by its
own loader, run by `ExitForward` with one weightless vLLM `Attention` per (attention layer, loop iteration).

Why one per iteration: vLLM keeps one KV cache per Attention instance, and a looped layer's iterations each
need their own keys (calling one instance twice in a step overwrites the first call's entries). The instances
hold no weights; the layer's projections are exitbench's. The exit config arrives as the `exitbench_exit` key
of `hf_overrides` (ExitConfig's fields; default fixed depth)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention

from ...engine.config import ExitConfig
from ...errors import ExitbenchError
from ...models.checkpoint import open_checkpoint
from .forward import Bridge, ExitForward
from .ledger import LEDGER


class VllmLoopedLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        mc = vllm_config.model_config
        dtype = str(mc.dtype).removeprefix("torch.")
        device = str(getattr(vllm_config.device_config, "device", None) or "cpu")  # where vLLM runs: cpu, cuda
        self.looped = open_checkpoint(mc.model, dtype=dtype, device=device).model
        self.configure(getattr(mc.hf_config, "exitbench_exit", None) or {"policy": "fixed"})
        c = self.looped.config
        heads_kv, head_dim = self.looped.cache_geometry()
        # slot n of the KV caches: (layer, iteration) pairs, every iteration the checkpoint allows, so that any
        # rule (max_steps up to the checkpoint's maximum) runs on one started engine
        self.slot: dict[tuple[int, int], int] = {}
        for layer, n in self.looped.cache_slots().items():
            for i in range(n):
                self.slot[(layer, i)] = len(self.slot)
        self.attention = nn.ModuleList(
            Attention(c.n_heads, head_dim, head_dim ** -0.5, heads_kv, cache_config=vllm_config.cache_config,
                      prefix=f"{prefix}{'.' if prefix else ''}layers.{n}.attn")  # one integer, unique: vLLM's rule
            for n in range(len(self.slot)))
        self.bridge = Bridge(self._attend)
        self.vocab = mc.get_vocab_size()

    def configure(self, exit_config: dict) -> None:
        """The rule (ExitConfig's fields) every later forward runs; refused in one line where not servable."""
        self.exit_config = ExitConfig.from_dict(dict(exit_config), what="exitbench_exit key")
        self.run = ExitForward(self.looped, self.exit_config)

    def _attend(self, layer: int, iteration: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention[self.slot[(layer, iteration)]](q.contiguous(), k.contiguous(), v.contiguous())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.looped.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ExitbenchError("the exitbench vLLM plugin takes token ids, not prompt embeddings")
        exits, traces = self._plan(input_ids, positions)
        hidden, steps = self.run(input_ids, positions, exits, self.bridge)
        pos = positions.tolist()
        for j, trace in traces:
            trace.steps[pos[j]] = steps[j]
        return hidden

    def _plan(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Which scheduled tokens run with exits, and the trace each computed token's exit goes to."""
        n = input_ids.shape[0]
        meta = get_forward_context().attn_metadata
        if not meta:  # vLLM's warm-up and profiling runs: no requests
            return [False] * n, []
        md = next(iter(meta.values())) if isinstance(meta, dict) else meta
        starts = md.query_start_loc.tolist()
        blocks = md.block_table[:, 0].tolist()
        ids, pos = input_ids.tolist(), positions.tolist()
        exits, traces = [False] * n, []
        for r in range(len(starts) - 1):
            lo, hi = starts[r], starts[r + 1]
            if pos[lo] == 0:
                trace, first = LEDGER.start(tuple(ids[lo:hi]), blocks[r])
            elif hi - lo == 1 and blocks[r] in LEDGER.by_block:
                trace, first = LEDGER.by_block[blocks[r]], pos[lo]
            else:
                raise ExitbenchError(f"vLLM scheduled positions {pos[lo]}…{pos[hi - 1]} of a request whose prefill "
                                     "this model did not see (chunked prefill or prefix caching); the exit "
                                     "plugin needs enable_chunked_prefill=False and enable_prefix_caching=False")
            for j in range(lo, hi):
                exits[j] = pos[j] >= first
                traces.append((j, trace))
        return exits, traces

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.looped.head(hidden_states)[..., : self.vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # exitbench's loader already read the checkpoint (its key checks, variants, tied head); vLLM's reading of
        # the same files is drained, and every parameter reported loaded.
        for _ in weights:
            pass
        return {name for name, _ in self.named_parameters()}
