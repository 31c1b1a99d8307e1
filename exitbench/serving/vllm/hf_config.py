"""The transformers config vLLM reads a Raven checkpoint's config.json into (vLLM sizes its engine from it).

Only vLLM's sizing fields are derived here; the model itself is built by exitbench's own loader from the
checkpoint's directory (model.py), so config.json is read by exitbench's rules, not by this class."""
from __future__ import annotations

from transformers import PretrainedConfig


class RavenVllmConfig(PretrainedConfig):
    model_type = "huginn_raven"

    def __init__(self, **kwargs):
        n_embd = kwargs.get("n_embd", 128)
        heads = kwargs.get("n_heads", kwargs.get("num_attention_heads", 4))
        kwargs.setdefault("hidden_size", n_embd)
        kwargs.setdefault("num_attention_heads", heads)
        kwargs.setdefault("num_key_value_heads", heads)
        kwargs.setdefault("head_dim", n_embd // heads)
        kwargs.setdefault("num_hidden_layers", kwargs.get("n_layers", 1))
        kwargs.setdefault("max_position_embeddings", kwargs.get("block_size", 4096))
        kwargs.setdefault("vocab_size", kwargs.get("padded_vocab_size", 32000))
        super().__init__(**kwargs)
