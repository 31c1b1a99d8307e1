"""Tiny models and tokenizers to test on: a random Raven with the full Huginn layer split, a word-level
tokenizer for it, a looped GPT-2, Huginn-0125's published shape, and random token ids.

Everything is built in memory; a test that needs a checkpoint saves one under its tmp_path.
"""
from __future__ import annotations

import copy
import math

import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from exitbench.models import LoopedGPT2, LoopedGPT2Config, Raven, RavenConfig
from exitbench.models.tokenizer import Tokenizer

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


# test_gpt2's looped GPT-2: a 100-word vocabulary, width 32, 4 heads, 6 layers, 64 positions, and three loop
# groups (one layer, two layers, one layer) at default depths 3, 4, 3 and at most 6, 8, 6.
GPT2_SHAPE = dict(vocab_size=100, n_embd=32, n_head=4, n_layer=6, n_positions=64,
                  loop_groups=[[1], [2, 3], [4]], loop_steps=[3, 4, 3], max_loop_steps=[6, 8, 6])


def gpt2_config(**overrides) -> LoopedGPT2Config:
    """GPT2_SHAPE with `overrides`; an override of None gives LoopedGPT2Config's own default (loop_steps=None:
    depth 1 in every group, max_loop_steps=None: twice loop_steps)."""
    kwargs = copy.deepcopy(GPT2_SHAPE)
    kwargs.update(overrides)
    return LoopedGPT2Config(**kwargs)


def make_gpt2(seed: int = 0, *, init: str = "scaled", emb: float = 0.2, w: float = 0.7, proj: float = 0.5,
              **overrides) -> LoopedGPT2:
    """A tiny looped GPT-2 of gpt2_config(**overrides) in eval mode, initialised from `seed` in one of two ways.

    init="scaled": every parameter random (norms and biases too, so none can be silently dropped). Embeddings
    are N(0, emb²) and weights N(0, w²/fan_in): next-token distributions are clearly non-uniform while logits
    stay O(5), so float32 rounding stays well below the 1e-5 tolerances. Residual projections are scaled by
    `proj`, so each iterate moves the state by a fraction of its norm and the exit signals settle over the
    iterations (proj = w = 1 draws every matrix at N(0, 1/fan_in)).

    init="model": the model's own init_weights, what training starts from (emb, w and proj are not used).
    """
    model = LoopedGPT2(gpt2_config(**overrides))
    if init == "model":
        model.init_weights(torch.Generator().manual_seed(seed))
        return model.eval()
    if init != "scaled":
        raise ValueError(f"init must be 'scaled' or 'model', got {init!r}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * proj / math.sqrt(p.shape[0]))
            elif name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * emb)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * w / math.sqrt(p.shape[0]))
            elif name.endswith(".weight"):  # LayerNorm gains
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # every bias
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
