"""A checkpoint's chat template, rendered as lm-eval's `hf` model renders it: by transformers'
`apply_chat_template` over a tokenizer loaded from the same files (tokenizer.json, tokenizer_config.json's
`chat_template` and special tokens, or a chat_template.jinja beside them).

Why transformers' and not a Jinja render written here: the template language is Hugging Face's (its sandboxed
environment, `raise_exception`, `tojson`, `strftime_now`, the special tokens as variables, generation-prompt
and continue-final-message handling), and the point is that both adapters hand the model the same string.
transformers is imported only when a template is asked for.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ExitbenchError


class ChatTemplate:
    def __init__(self, path: Path, name: str | None = None):
        """`name`: which of several named templates (lm-eval's `--apply_chat_template NAME`); None for the
        tokenizer's only template, or its "default"."""
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ExitbenchError("chat templates are rendered by transformers' apply_chat_template, as lm-eval's hf "
                                 "model renders them: pip install transformers") from None
        try:
            self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises what its parsers raise on a damaged file
            raise ExitbenchError(f"the tokenizer files of {path} cannot be loaded for its chat template: "
                                 f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        template = self.tokenizer.chat_template
        if not template:
            raise ExitbenchError(f"a chat template was asked for (--apply-chat-template, lm-eval's "
                                 f"--apply_chat_template), but {path} has no chat template (tokenizer_config.json's "
                                 "chat_template, or chat_template.jinja); run without it")
        self.name = None
        if isinstance(template, dict):
            self.name = name or "default"
            if self.name not in template:
                raise ExitbenchError(f"--apply-chat-template {self.name}: {path} has the templates "
                                     f"{', '.join(sorted(template))}; name one")
            template = template[self.name]
        elif name not in (None, "default"):
            raise ExitbenchError(f"--apply-chat-template {name}: {path} has one unnamed chat template; give no name")
        if not isinstance(template, str):
            raise ExitbenchError(f"the chat template of {path} must be a Jinja string (or named strings), got "
                                 f"{type(template).__name__} {template!r:.60}")
        self.template: str = template
        self.path = path
        # Rendered once here, before any compute: a template that does not parse, or refuses even a lone user
        # turn, is one line now rather than a traceback from inside lm-eval's first request.
        self.render([{"role": "user", "content": "hello"}])

    def render(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        kwargs: dict[str, Any] = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=not add_generation_prompt)
        if self.name is not None:
            kwargs["chat_template"] = self.name
        try:
            try:
                return self.tokenizer.apply_chat_template(chat_history, **kwargs)
            except jinja2.exceptions.TemplateError:
                # What lm-eval's hf model does when a template refuses a system turn: drop it and render again.
                chat_history = [m for m in chat_history if m["role"] != "system"]
                return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            raise ExitbenchError(f"the chat template of {self.path} cannot render this conversation: "
                                 f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
