"""Tiny models and tokenizers to test on: a random Raven with the full Huginn layer split, a word-level
tokenizer for it, Huginn-0125's published shape, and random token ids.

Everything is built in memory; a test that needs a checkpoint saves one under its tmp_path.
"""
from __future__ import annotations

import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from exitbench.models import Raven, RavenConfig
from exitbench.tokenizer import Tokenizer

# Huginn-0125's published shape (shared/reference/huginn-0125.md §1.1).
HUGINN_CONFIG = dict(n_embd=5280, n_heads=55, vocab_size=65536, intermediate_size=17920,
                     n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
                     block_size=4096, rope_base=50000.0, norm_eps=1e-6, qk_bias=True, tie_embeddings=True,
                     mean_recurrence=32, mean_backprop_depth=8,
                     bos_token_id=65504, eos_token_id=65505, pad_token_id=65509)
HUGINN_PARAMETERS = 3_564_976_800

SPECIAL_TOKENS = ["<|begin_text|>", "<|end_text|>", "<|pad|>", "<unk>"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "fast", "slow", "and", "big", "small", "red"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# A 3-shard split: the tiny model's fp32 checkpoint is about 370 kB.
SHARD_BYTES = 150_000


def tiny_config(**overrides) -> RavenConfig:
    kwargs = dict(n_embd=32, n_heads=2, vocab_size=100, intermediate_size=64,
                  n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
                  block_size=128, init_scale=0.0, mean_recurrence=4,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    kwargs.update(overrides)
    return RavenConfig(**kwargs)


def make_tiny_raven(seed: int = 0, **overrides) -> Raven:
    """A tiny Raven with the full (2, 4, 2) layer split, so all 77 Huginn keys exist."""
    model = Raven(tiny_config(**overrides))
    model.init_weights(torch.Generator().manual_seed(seed))
    # takase init zeroes qk_bias and sets norms to 1; randomise them so tests can see if they are dropped.
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qk_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif ".norm_" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_tiny_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def random_ids(batch: int, length: int, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
