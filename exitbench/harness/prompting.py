"""How prompts are put to the model, as lm-eval's own options say it: a chat template, a system instruction,
few-shot examples as turns, and generation settings. Papers' numbers depend on these (Huginn-0125's GSM8K:
`gsm8k_cot` with the chat template, multi-turn few-shot and a system prompt), so a cell keys on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ExitbenchError

TOKENIZERS_OWN = True  # --apply-chat-template without --chat-template: the tokenizer's template (or its default)


@dataclass(frozen=True)
class Prompting:
    apply_chat_template: bool | str = False  # True: the tokenizer's template; a name: one of several
    system_instruction: str | None = None
    fewshot_as_multiturn: bool | None = None  # None: lm-eval's default
    gen_kwargs: str | None = None  # lm-eval's "k=v,k=v", updating each generation task's settings

    def __post_init__(self):
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ExitbenchError("--fewshot-as-multiturn puts the few-shot examples in chat turns; it needs "
                                 "--apply-chat-template")
        if self.gen_kwargs is not None:
            parsed = self.parsed_gen_kwargs()
            if parsed.get("do_sample") is True:
                raise ExitbenchError("--gen-kwargs do_sample=true: exitbench decodes greedily (each token's exit "
                                     "is measured on the argmax path); sampling is not implemented")

    def parsed_gen_kwargs(self) -> dict[str, Any]:
        """lm-eval's parse of "k=v,k=v", checked before any compute: every key named, and the settings exitbench's
        greedy decoding reads (max_gen_toks, until, do_sample) of a type it can use. Sampling settings
        (temperature, top_p, …) are accepted and, decoding being greedy, change nothing."""
        from lm_eval.utils import simple_parse_args_string

        try:
            parsed = simple_parse_args_string(self.gen_kwargs)
        except Exception as exc:  # lm-eval raises bare ValueErrors and IndexErrors on a malformed string
            raise ExitbenchError(f"--gen-kwargs {self.gen_kwargs!r} is not k=v,k=v ({exc})") from None
        if not parsed or any(not str(k).strip() for k in parsed):
            raise ExitbenchError(f"--gen-kwargs {self.gen_kwargs!r} names no setting (want k=v,k=v, e.g. "
                                 "max_gen_toks=512)")
        tokens = parsed.get("max_gen_toks")
        if "max_gen_toks" in parsed and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ExitbenchError(f"--gen-kwargs max_gen_toks={tokens!r}: the tokens to generate must be a whole "
                                 "number ≥ 1")
        if parsed.get("do_sample") not in (None, True, False):
            raise ExitbenchError(f"--gen-kwargs do_sample={parsed['do_sample']!r} must be true or false")
        return parsed

    def key_dict(self) -> dict[str, Any]:
        """What a cell's key holds: only what was set, so cells run without these keep their ids."""
        out: dict[str, Any] = {}
        if self.apply_chat_template:
            out["apply_chat_template"] = self.apply_chat_template
        if self.system_instruction is not None:
            out["system_instruction"] = self.system_instruction
        if self.fewshot_as_multiturn is not None:
            out["fewshot_as_multiturn"] = self.fewshot_as_multiturn
        if self.gen_kwargs is not None:
            out["gen_kwargs"] = self.parsed_gen_kwargs()
        return out

    def check_for(self, path) -> None:
        """Refuse a chat template the checkpoint at `path` does not have, before any compute."""
        if self.apply_chat_template:
            from .chat import ChatTemplate

            ChatTemplate(path, None if self.apply_chat_template is True else self.apply_chat_template)

    def evaluate_kwargs(self) -> dict[str, Any]:
        """simple_evaluate's arguments for these settings (none when nothing is set: lm-eval's defaults)."""
        out = dict(self.key_dict())
        if "gen_kwargs" in out:
            out["gen_kwargs"] = self.gen_kwargs
        return out
