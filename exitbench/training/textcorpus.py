"""Natural text for the looped GPT-2: GSM8K's question + worked-answer text, a byte-level BPE fitted to it, and
random training windows over the token stream.

The two-scale paper trained on FineWeb; GSM8K's 7.5k training problems are the natural text this project can
reach offline (GSM8K, Cobbe et al. 2021, as the JSONL of github.com/openai/grade-school-math), and its test split is the held-out perplexity task `gsm8k_text`, which
formats each document the same way (`question \\n answer`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import ExitbenchError
from ..models.tokenizer import Tokenizer

END_OF_TEXT = "<|endoftext|>"


def document(row: dict) -> str:
    """One GSM8K problem as text, exactly as tasks/gsm8k_text scores it."""
    return f"{row['question']}\n{row['answer']}"


def gsm8k_texts(split: str, data_dir: str | Path | None = None) -> list[str]:
    """GSM8K documents of `split` from DIR/{split}.jsonl, or from the hub's openai/gsm8k without a directory."""
    if data_dir is None:
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
        return [document(r) for r in rows]
    path = Path(data_dir).expanduser() / f"{split}.jsonl"
    if not path.is_file():
        raise ExitbenchError(f"--gsm8k-dir {data_dir}: no {split}.jsonl there (expected GSM8K's {split} split "
                             "as JSON lines with question and answer)")
    texts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            texts.append(document(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ExitbenchError(f"{path}:{n} is not a GSM8K row with question and answer") from None
    if not texts:
        raise ExitbenchError(f"{path} holds no documents")
    return texts


def fit_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE fitted to `texts`, with <|endoftext|> as id 0 (BOS, EOS and padding)."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    eot = backend.token_to_id(END_OF_TEXT)
    # No post-processor, as GPT-2's own tokenizer: lm-eval's rolling perplexity then conditions a document on one
    # <|endoftext|> (its prefix token), which is how the stream separated documents in training. A tokenizer
    # that added it too would be scored after two.
    return Tokenizer(backend, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)


class TokenStream:
    """Every document's tokens, each followed by <|endoftext|>, as one stream to cut training windows from."""

    def __init__(self, texts: list[str], tokenizer: Tokenizer):
        eot = tokenizer.eos_token_id
        ids: list[int] = []
        for encoding in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eot)
        self.ids = torch.tensor(ids, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rng: random.Random, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, length): random windows and the same windows shifted by one."""
        if len(self.ids) <= length + 1:
            raise ExitbenchError(f"the training text has {len(self.ids)} tokens, too few for windows of {length}")
        starts = [rng.randrange(len(self.ids) - length - 1) for _ in range(batch_size)]
        windows = torch.stack([self.ids[s: s + length + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]
