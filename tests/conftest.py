"""Shared fixtures: a tiny random Raven, its checkpoint directory and a tiny word-level tokenizer.

Only pytest fixtures and session settings live here; the builders are in tests/helpers/models.py. Everything is
built in tmp_path; nothing is written into the repository.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exitbench.models import Raven, save_checkpoint
from exitbench.models.tokenizer import Tokenizer

from helpers.models import SHARD_BYTES, make_tiny_raven, make_tiny_tokenizer

# Tiny models gain nothing from intra-op threads, and with a busy core the thread pool's barriers can make
# a millisecond forward take a second; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)


@pytest.fixture
def tiny_raven() -> Raven:
    return make_tiny_raven()


@pytest.fixture
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_raven, tiny_tokenizer) -> Path:
    """A sharded (3 shards + index) fp32 checkpoint directory of `tiny_raven` with a tokenizer.json."""
    return save_checkpoint(tiny_raven, tmp_path / "tiny-ck", tokenizer=tiny_tokenizer,
                           max_shard_bytes=SHARD_BYTES)
