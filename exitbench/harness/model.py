"""exitbench as an lm-eval model: every scored or generated token runs its own loop under an exit policy.

- `loglikelihood`: the context up to its last token is prefilled at full depth; the positions whose outputs
  score the continuation run with exits (teacher-forced). `is_greedy` is whether each of those outputs'
  argmax was the continuation token.
- `loglikelihood_rolling`: every token with exits, in lm-eval's disjoint rolling windows when the text is longer
  than the context.
- `generate_until`: greedy, each new token with its own exit; stops at EOS, a stop string or `max_gen_toks`.

Text becomes tokens exactly as lm-eval's `hf` model makes them, so the same weights give the same numbers under
both: the tokenizer's post-processor decides special tokens (or `add_bos_token` forces BOS on or special tokens
off), a string that already starts with the BOS text gets none added, and the prefix token (BOS, else EOS)
conditions an empty context and the first rolling window.

Each request's exit steps, iterations, FLOPs and wall-clock are kept in a side table keyed by
(task, doc_id, idx), which `exitbench run` joins into lm-eval's samples and task results.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from pydantic import BaseModel, ConfigDict

from ..engine import ExitEngine, SequenceResult
from ..engine.config import ExitConfig
from ..engine.prefixes import shared_store
from ..engine.speculation import SpeculativeEngine
from ..errors import ExitbenchError
from ..models import Checkpoint
from ..models.checkpoint import open_checkpoint
from ..models.embedded import recorded_path
from ..models.hub import hub_source
from ..policies import REGISTRY
from ..runtime.devices import resolve_device
from ..runtime.distributed import init_distributed
from ..runtime.validation import at_least, parse
from ..store import cells
from . import exit_statistics
from .chat import ChatTemplate


class ModelArgs(BaseModel):
    """The types of the model's own arguments (as lm-eval's parser leaves them: true/false already booleans,
    numbers numbers), so that `allow_nonfinite=no` is refused rather than read as true."""
    model_config = ConfigDict(strict=True)
    checkpoint: Optional[str] = None
    pretrained: Optional[str] = None
    dtype: str = "auto"
    batch_size: Union[int, str] = 1
    max_batch_size: Optional[int] = None
    device: Optional[str] = None
    max_length: Optional[int] = None
    max_gen_toks: int = 256
    allow_nonfinite: bool = False  # (add_bos_token has a check of its own, with the tokenizer at hand)
    schedule: str = "auto"


@register_model("exitbench")
class ExitbenchLM(LM):
    def __init__(self, checkpoint: str | Checkpoint | None = None, dtype: str = "auto", batch_size: int | str = 1,
                 max_batch_size: int | None = None, device: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, allow_nonfinite: bool = False,
                 schedule: str = "auto", exit_config: ExitConfig | str | None = None, on_progress: Callable[[int, int], None] | None = None,
                 pretrained: str | None = None, **exit_knobs: Any):
        """The one constructor. lm-eval builds the model from its model arguments (its own
        `create_from_arg_string`): a checkpoint by path or embedded name, and any of ExitConfig's fields
        (policy, threshold, min_steps, …). A sweep hands it a Checkpoint it loaded once for all its cells, and
        each cell's ExitConfig (`exit_config`, instead of knobs); on lm-eval's command line, `exit_config` names
        an exit-config YAML file (knobs given one by one beside it may not repeat its own). `schedule`: how the engine runs teacher-forced
        requests (exitbench.engine.ExitEngine; auto: depth-major wherever exact), a speed choice only.
        `pretrained` is lm-eval's usual name for `checkpoint` (a directory, an embedded name or a hub id)."""
        super().__init__()
        if pretrained is not None:
            if checkpoint is not None and checkpoint != pretrained:
                raise ExitbenchError(f"model arguments name checkpoint={checkpoint} and pretrained={pretrained}; "
                                     "they are one argument, give one")
            checkpoint = pretrained
        loaded = isinstance(checkpoint, Checkpoint)
        if not loaded:
            parse(ModelArgs, {"checkpoint": checkpoint, "dtype": dtype, "batch_size": batch_size,
                              "max_batch_size": max_batch_size, "device": device, "max_length": max_length,
                              "max_gen_toks": max_gen_toks, "allow_nonfinite": allow_nonfinite,
                              "schedule": schedule},
                  "exitbench model arguments")
        if isinstance(exit_config, str):  # lm-eval's model args name an exit-config file (an all_of's rules)
            exit_config, exit_knobs = ExitConfig.with_file(exit_config, exit_knobs, "exitbench model argument"), {}
        if exit_config is not None and exit_knobs:
            raise ExitbenchError(f"give exit_config or exit knobs ({', '.join(sorted(exit_knobs))}), not both")
        if exit_config is None:
            exit_config = ExitConfig.from_dict(exit_knobs, what="exitbench model argument")
        self._init_distributed()
        if loaded:
            ck = checkpoint
            self._device = ck.model.device
        else:
            self._device = torch.device(resolve_device(device))
            ck = open_checkpoint(checkpoint, dtype=dtype, device=str(self._device), allow_nonfinite=allow_nonfinite)
        self._setup(ck, exit_config, batch_size, max_batch_size, max_length, max_gen_toks, add_bos_token, schedule)
        self.on_progress = on_progress

    @classmethod
    def from_checkpoint(cls, ck: Checkpoint, exit_config: ExitConfig, **kwargs: Any) -> "ExitbenchLM":
        """`ExitbenchLM(ck, exit_config=…)`: an adapter over an already loaded checkpoint."""
        return cls(ck, exit_config=exit_config, **kwargs)

    def _setup(self, ck: Checkpoint, exit_config: ExitConfig, batch_size, max_batch_size, max_length,
               max_gen_toks, add_bos_token, schedule: str = "auto") -> None:
        self.ck = ck
        if ck.tokenizer is None:
            raise ExitbenchError(f"{ck.path} has no tokenizer.json; lm-eval tasks need text in and out")
        self.tok = ck.tokenizer
        if self.tok.bos_token_id is None and self.tok.eos_token_id is None:
            raise ExitbenchError(f"{ck.path} names neither bos_token_id nor eos_token_id; an empty context and the "
                                 "first rolling window are conditioned on one of them")
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise ExitbenchError(f"add_bos_token must be true, false or none (the tokenizer decides), "
                                 f"got {add_bos_token!r}")
        if add_bos_token and self.tok.bos_token_id is None:
            raise ExitbenchError(f"add_bos_token=true, but {ck.path} names no bos_token_id to add; name one in "
                                 "config.json or leave add_bos_token unset")
        self.add_bos_token = add_bos_token
        # Decoded with special tokens kept, as lm-eval's hf model compares it against the start of each string.
        self._prefix_text = self.tok.decode([self.prefix_token_id], skip_special_tokens=False)
        bos = self.tok.bos_token_id
        self._bos_text = None if bos is None else self.tok.token(bos)
        never = exit_config.never_exits_early(ck.model.loop_groups())
        if never:  # lm-eval's model args reach here without a sweep's planning, which refuses the same
            raise ExitbenchError(never)
        self.exit_config = exit_config
        self.engine = SpeculativeEngine(ck.model, exit_config) if REGISTRY[exit_config.policy].drafts \
            else ExitEngine(ck.model, exit_config, schedule, prefixes=shared_store(ck.model))
        self.batch_size = self._parse_batch_size(batch_size, max_batch_size)
        self.max_length = int(max_length or ck.model.config.block_size)
        self.max_gen_toks = int(max_gen_toks)
        self.request_stats: list[dict[str, Any]] = []
        # Each request type's requests as lm-eval last handed them over, so a sweep can time some of them
        # again (timing/retime.py) without asking lm-eval to build its tasks a second time.
        self.received: dict[str, list] = {}
        self._chat: ChatTemplate | None = None  # built when lm-eval first asks for the chat template
        exit_statistics.register(self)  # for `exitbench lm-eval run`'s tables (kept only while one runs)

    # ---- setup -------------------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        self._rank, self._world_size = init_distributed()

    def _progress(self, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total)

    @staticmethod
    def _parse_batch_size(batch_size: int | str, max_batch_size: int | None) -> int:
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            return int(max_batch_size or 16)  # no OOM probing on CPU: auto means "as large as allowed"
        try:
            value = int(batch_size)
        except (TypeError, ValueError):
            raise ExitbenchError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}") from None
        at_least("batch_size", value)
        return min(value, max_batch_size) if max_batch_size else value

    # ---- data parallel -------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        out = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return torch.cat(out)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ---- tokenisation ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.bos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

    def _encode_specials(self, text: str, add_special_tokens: bool) -> list[int]:
        # lm-eval hands add_bos_token to the tokenizer's from_pretrained, and transformers then rebuilds the
        # post-processor as a "<bos> $A" template: with add_bos_token=true, special tokens mean BOS alone.
        if add_special_tokens and self.add_bos_token:
            return self.tok.encode(text, add_bos=True)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """lm-eval hf's `tok_encode`: `add_special_tokens` when given, else none for a string that already starts
        with the prefix token's text (it would be doubled), else as `add_bos_token` says, else as the tokenizer's
        post-processor does."""
        if add_special_tokens is None:
            add_special_tokens = not text.startswith(self._prefix_text) and self.add_bos_token is not False
        return self._encode_specials(text, add_special_tokens)

    def _encode_prompt(self, text: str) -> list[int]:
        """A generation prompt as lm-eval hf's `tok_batch_encode` encodes it: it checks the BOS token's own
        text, where `tok_encode` checks the prefix token's."""
        starts_with_bos = self._bos_text is not None and text.startswith(self._bos_text)
        return self._encode_specials(text, not starts_with_bos and self.add_bos_token is not False)

    def _encode_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's `loglikelihood` encoding: an empty context becomes the prefix token (unless the continuation
        already starts with it), any other goes through `_encode_pair`."""
        if context:
            return self._encode_pair(context, continuation)
        cont = self.tok_encode(continuation, add_special_tokens=False)
        if not cont:
            raise ExitbenchError(f"continuation {continuation!r} encodes to no tokens")
        if cont[0] == self.prefix_token_id:
            return cont[:1], cont[1:]
        return [self.prefix_token_id], cont

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation, split where the whole string's tokens split (as HF models do)."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        if not ctx:
            # A whitespace-only context, under a tokenizer that adds nothing: lm-eval's hf model asserts here;
            # conditioning on the prefix token is what it does for an empty context.
            return [self.prefix_token_id], whole
        return ctx, whole[len(ctx):]

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        """Left-truncate to the model's context, keeping at least one context token."""
        tokens = (ctx + cont)[-(self.max_length + 1):]
        return tokens, max(1, len(tokens) - len(cont))

    # ---- the three request types -------------------------------------------------------------------
    def _record(self, req, kind: str, results: list[SequenceResult], seconds: float) -> None:
        stats = cells.request_stats([r for res in results for r in res.records], seconds,
                                    prompt=(sum(r.prompt_positions for r in results),
                                            sum(r.prompt_iterations for r in results)))
        # Each exited token's text, log-probability and greedy flag, aligned with stats["exit_steps"], so a
        # sample's exit map can be drawn without the tokenizer (`exitbench report`, exitbench/exitmap.py).
        tokens = [t for res in results for t in res.tokens]
        # Generation runs token by token; teacher-forced requests as the engine schedules them (depth-major
        # wherever that is exact): the same numbers either way, so the schedule is said, not keyed.
        schedule = "token_major" if kind == "generate_until" else self.engine.scoring_schedule
        self.request_stats.append({"task_name": req.task_name, "doc_id": req.doc_id, "idx": req.idx,
                                   "kind": kind, "schedule": schedule, **stats,
                                   "token_text": self.tok.pieces(tokens),
                                   "logprobs": [float(x) for res in results for x in res.logprobs],
                                   "greedy": [bool(g) for res in results for g in res.greedy],
                                   **({"speculation": results[0].speculation}
                                      if len(results) == 1 and results[0].speculation else {})})

    def _run_scoring(self, encoded: list[list[tuple[list[int], int]]], keep_distributions: bool = False
                     ) -> tuple[list[list[SequenceResult]], list[float]]:
        """Score every item's windows in one engine run of `batch_size` rows, longest first; results in item
        order, with the run's wall-clock split over its items by scored tokens."""
        flat = [(i, w) for i, windows in enumerate(encoded) for w in windows]
        order = sorted(range(len(flat)), key=lambda j: -len(flat[j][1][0]))
        self._progress(0, len(order))
        t0 = time.perf_counter()
        results = self.engine.score([flat[j][1] for j in order], keep_distributions=keep_distributions,
                                    batch_size=self.batch_size, on_request=lambda n: self._progress(n, len(order)))
        elapsed = time.perf_counter() - t0
        n_tok = sum(len(r.records) for r in results) or 1
        seconds = [0.0] * len(encoded)
        slots: dict[int, SequenceResult] = {}
        for j, res in zip(order, results):
            slots[j] = res
            seconds[flat[j][0]] += elapsed * len(res.records) / n_tok
        per_item: list[list[SequenceResult]] = [[] for _ in encoded]
        for j, (i, _) in enumerate(flat):
            per_item[i].append(slots[j])
        return per_item, seconds

    def scoring_groups(self, requests) -> tuple[list[tuple[tuple[list[int], int], int]], list[list[int]]]:
        """Each request's (tokens, n_context) and continuation length, and the groups of requests that share
        one pass: those whose inputs agree up to their last token (the options of a multiple-choice question),
        within one task, so each task's cell counts its own tokens and time. Not under the oracle: its exits
        depend on the target token, so each option needs its own pass."""
        pairs = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode_request(context, continuation)
            if not cont:
                raise ExitbenchError(f"continuation {continuation!r} encodes to no tokens")
            pairs.append((self._fit(ctx, cont), len(cont)))
        shareable = not self.exit_config.build_policy().retrospective
        groups: dict[tuple, list[int]] = {}
        for i, ((tokens, n_ctx), _) in enumerate(pairs):
            inputs = tuple(tokens[:-1]) if shareable else tuple(tokens)
            groups.setdefault((requests[i].task_name, inputs, n_ctx), []).append(i)
        return pairs, list(groups.values())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.received["loglikelihood"] = requests
        pairs, members = self.scoring_groups(requests)
        # One pass per group: the engine keeps the distributions and each request reads its own tokens.
        results, seconds = self._run_scoring([[pairs[m[0]][0]] for m in members], keep_distributions=True)
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for group, (res,), sec in zip(members, results, seconds):
            for i in group:
                (tokens, n_ctx), _ = pairs[i]
                targets = tokens[n_ctx:]
                rows = res.distributions
                logprob = sum(float(rows[j][t]) for j, t in enumerate(targets))
                greedy = all(int(rows[j].argmax()) == t for j, t in enumerate(targets))
                out[i] = (logprob, greedy)
                # The shared pass's tokens count once, with the group's first request.
                self._record(requests[i], "loglikelihood", [res] if i == group[0] else [], sec / len(group))
        return out  # type: ignore[return-value]

    def rolling_windows(self, text: str) -> list[tuple[list[int], int]]:
        """lm-eval's disjoint rolling windows of a text, as (tokens, n_context) scoring requests."""
        tokens = self.tok_encode(text)
        windows = get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                            max_seq_len=self.max_length, context_len=1)
        return [(ctx + cont, len(ctx)) for ctx, cont in map(make_disjoint_window, windows)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self.received["loglikelihood_rolling"] = requests
        encoded = [self.rolling_windows(req.args[0]) for req in requests]
        results, seconds = self._run_scoring(encoded)
        for req, res, sec in zip(requests, results, seconds):
            self._record(req, "loglikelihood_rolling", res, sec)
        return [float(sum(sum(r.logprobs) for r in res)) for res in results]

    def generation_inputs(self, requests) -> tuple[list[int], list[list[int]], list[list[str]], list[int]]:
        """Longest prompt first: the order, each prompt's tokens, stop strings and new-token limit."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))
        prompts, untils, limits = [], [], []
        for i in order:
            context, gen_kwargs = requests[i].args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample"):
                raise ExitbenchError(f"task {requests[i].task_name} asks for do_sample=true, but exitbench decodes "
                                     "greedily (do_sample=false: each token's exit is measured on the argmax path); "
                                     "pass --gen-kwargs do_sample=false to run it greedily")
            until = gen_kwargs.get("until") or []
            untils.append([until] if isinstance(until, str) else list(until))
            n_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            n_new = max(1, min(n_new, self.max_length // 2))
            limits.append(n_new)
            # A model needs a token to condition on; lm-eval's hf model cannot generate from none.
            ids = self._encode_prompt(context) or [self.prefix_token_id]
            prompts.append(ids[-(self.max_length - n_new):])
        return order, prompts, untils, limits

    def generation_text(self, tokens: list[int], until: list[str]) -> str:
        """The answer lm-eval receives: the generated text cut at the first stop string."""
        text = self.tok.decode(tokens)
        for s in until:
            if s and s in text:
                text = text[: text.index(s)]
        return text

    def generate(self, requests) -> tuple[list[int], list[list[int]], list[list[str]], list[SequenceResult],
                                          list[float]]:
        """Greedy generation for lm-eval's requests: the order, prompts, stop strings, engine results and
        each request's share of the run's wall-clock."""
        order, prompts, untils, limits = self.generation_inputs(requests)

        def stop(j: int, generated: list[int]) -> bool:
            if len(generated) >= limits[j]:
                return True
            text = self.tok.decode(generated)
            return any(s and s in text for s in untils[j])

        self._progress(0, len(order))
        t0 = time.perf_counter()
        results = self.engine.generate(prompts, max(limits, default=1), stop_ids=[self.eot_token_id], stop=stop,
                                       batch_size=self.batch_size,
                                       on_request=lambda n: self._progress(n, len(order)))
        elapsed = time.perf_counter() - t0
        n_tok = sum(len(r.records) for r in results) or 1
        return order, prompts, untils, results, [elapsed * len(r.records) / n_tok for r in results]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.received["generate_until"] = requests
        order, _, untils, results, seconds = self.generate(requests)
        outputs: list[str | None] = [None] * len(requests)
        for j, (i, res) in enumerate(zip(order, results)):
            outputs[i] = self.generation_text(res.tokens, untils[j])
            self._record(requests[i], "generate_until", [res], seconds[j])
        return outputs  # type: ignore[return-value]

    # ---- reporting ---------------------------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        hub = hub_source(self.ck.path)
        return {"exitbench": {"checkpoint": recorded_path(self.ck.path), **({"hub": hub} if hub else {}),
                              "architecture": self.ck.model.architecture,
                              "exit": self.exit_config.to_dict(), "batch_size": self.batch_size,
                              "add_bos_token": self.add_bos_token}}

    # ---- chat templates (lm-eval's --apply_chat_template, --system_instruction, --fewshot_as_multiturn) ----
    @property
    def tokenizer_name(self) -> str:
        # lm-eval keys its request cache on this; hf's is the tokenizer's name with "/" made "__"
        return str(self.ck.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm-eval records (and its hash): chat_template True for the tokenizer's own (or its
        "default"), a name to pick one of several; False or None: none."""
        if chat_template is False or chat_template is None:
            return None
        self._chat = ChatTemplate(self.ck.path, None if chat_template is True else str(chat_template))
        return self._chat.template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._chat is None:
            self._chat = ChatTemplate(self.ck.path)
        return self._chat.render(chat_history, add_generation_prompt)
