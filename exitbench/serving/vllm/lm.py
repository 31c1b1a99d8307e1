"""The lm-eval model of `exitbench run --backend vllm`: exitbench's own (tokenizing, request bookkeeping, each
request's exits and costs for the cells) with its engine swapped for `VllmEngine`.

One difference in what it asks: a loglikelihood request is scored on its own, not in a pass shared with the
other options of its question (that needs whole distributions per position, which vLLM does not return);
the numbers are the same, the cost counts each option's tokens."""
from __future__ import annotations

from typing import Any

from ...harness.model import ExitbenchLM
from .engine import VllmEngine


class VllmLM(ExitbenchLM):
    def _setup(self, ck, exit_config, batch_size, max_batch_size, max_length, max_gen_toks, add_bos_token,
               schedule: str = "auto") -> None:
        super()._setup(ck, exit_config, batch_size, max_batch_size, max_length, max_gen_toks, add_bos_token,
                       schedule)
        self.engine = VllmEngine(ck, exit_config, rows=self.batch_size)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.received["loglikelihood"] = requests
        pairs, _ = self.scoring_groups(requests)
        results, seconds = self._run_scoring([[pair] for pair, _ in pairs])
        out = []
        for req, (res,), sec in zip(requests, results, seconds):
            out.append((float(sum(res.logprobs)), all(res.greedy)))
            self._record(req, "loglikelihood", [res], sec)
        return out

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["exitbench"]["backend"] = "vllm"
        return info
