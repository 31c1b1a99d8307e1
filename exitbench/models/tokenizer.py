"""A `tokenizers` tokenizer plus the special-token ids the model's config names."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from ..errors import CheckpointError, ExitbenchError

TOKENIZER_FILE = "tokenizer.json"


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _tokenizer_config_tokens(path: Path) -> dict[str, str]:
    """The special tokens tokenizer_config.json names by text ("<s>", or {"content": "<s>", ...}), by role."""
    file = path / TOKENIZER_CONFIG_FILE
    if not file.exists():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None
    out = {}
    for name in ("bos", "eos", "pad"):
        value = raw.get(f"{name}_token") if isinstance(raw, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class Tokenizer:
    def __init__(self, backend: HFTokenizer, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None):
        self.backend = backend
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id

    @classmethod
    def from_dir(cls, path: Path, config: dict) -> "Tokenizer | None":
        file = Path(path) / TOKENIZER_FILE
        if not file.exists():
            return None
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise CheckpointError(f"cannot read {file}: {str(exc).splitlines()[0]}") from None
        # config.json's ids come first; one it does not name, the tokenizer's own config may (Hugging Face
        # tokenizers name their special tokens by text in tokenizer_config.json).
        named = _tokenizer_config_tokens(Path(path))
        ids = {}
        for name in ("bos", "eos", "pad"):
            ids[name] = config.get(f"{name}_token_id")
            if ids[name] is None and name in named:
                ids[name] = backend.token_to_id(named[name])
                if ids[name] is None:
                    raise CheckpointError(f"{Path(path) / TOKENIZER_CONFIG_FILE}: {name}_token {named[name]!r} is "
                                          f"not a token of {file}; name one the tokenizer has")
        for name, token_id in ids.items():
            # config.json's schema has checked the ids against the model's vocab_size; the tokenizer may be
            # smaller (or have holes), and an id it cannot decode is an <eos> generation never sees.
            if token_id is not None and backend.id_to_token(token_id) is None:
                size = backend.get_vocab_size(with_added_tokens=True)
                raise CheckpointError(f"{Path(path) / 'config.json'}: {name}_token_id {token_id} is not a token of "
                                      f"{file} (vocabulary of {size}); name an id the tokenizer has")
        return cls(backend, ids["bos"], ids["eos"], ids["pad"])

    def save(self, path: Path) -> None:
        self.backend.save(str(Path(path) / TOKENIZER_FILE))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. By default no special tokens, and BOS only when `add_bos` asks for it (what
        training, calibration and tracing were written against). `add_special_tokens=True` is Hugging Face's
        default instead: the tokenizer's own post-processor decides which special tokens to add, as lm-eval's
        `hf` model encodes."""
        if add_bos and add_special_tokens:
            raise ExitbenchError("encode takes add_bos (prepend BOS here) or add_special_tokens (let the "
                                 "tokenizer's post-processor add its tokens), not both")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_as_hf(self, text: str, add_bos_token: bool | None = None) -> list[int]:
        """`text` as lm-eval's hf model encodes a request: None lets the tokenizer's post-processor decide the
        special tokens (an Ouro or GPT-2 tokenizer adds no BOS, a Llama one does); True forces BOS (lm-eval hands
        add_bos_token to from_pretrained, which rebuilds the post-processor as "<bos> $A"); False adds none."""
        if add_bos_token and self.bos_token_id is None:
            raise ExitbenchError("--add-bos-token: the tokenizer names no BOS token to add; leave the option out")
        if add_bos_token:
            return self.encode(text, add_bos=True)
        return self.encode(text, add_special_tokens=add_bos_token is None)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: list[int], previous: int | None = None) -> list[str]:
        """Each token's own text, with the space the decoder puts before it: token i is read off the decode of
        (token i−1, token i), since a word-level decoder joins tokens with spaces that no single token holds.
        `previous` is the token before ids[0], when there is one. Linear in len(ids), so fine for long texts."""
        out = []
        for i, t in enumerate(ids):
            before = ids[i - 1] if i else previous
            alone = self.decode([t], skip_special_tokens=False)
            if before is not None:
                head = self.decode([before], skip_special_tokens=False)
                pair = self.decode([before, t], skip_special_tokens=False)
                if pair.startswith(head) and pair[len(head):].endswith(alone):
                    alone = pair[len(head):]
            out.append(alone)
        return out

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def special_tokens(self) -> dict[str, tuple[int, str | None]]:
        named = {"bos": self.bos_token_id, "eos": self.eos_token_id, "pad": self.pad_token_id}
        return {k: (v, self.token(v)) for k, v in named.items() if v is not None}

    def add_bos_post_processor(self) -> "Tokenizer":
        """Make the tokenizer put BOS first by itself (a "<bos> $A" template), so an encode with special tokens,
        as Hugging Face and lm-eval do by default, conditions on BOS the way exitbench trains."""
        if self.bos_token_id is None:
            raise ExitbenchError("a BOS post-processor needs a bos_token_id; name one in the tokenizer")
        bos = self.token(self.bos_token_id)
        if bos is None:
            raise ExitbenchError(f"bos_token_id {self.bos_token_id} is not in the vocabulary "
                                 f"(size {self.vocab_size}); name a token the tokenizer has")
        # Pairs are Llama's template: each segment opens with BOS.
        self.backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, self.bos_token_id)])
        return self

    def describe(self) -> str:
        return json.dumps({"vocab_size": self.vocab_size, "special": self.special_tokens()})
