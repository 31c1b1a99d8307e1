"""Shared fixtures: a tiny random Raven, its checkpoint directory and a tiny word-level tokenizer; an editable copy
of the embedded tiny-raven; the smallest sweeps (exact and replay) as library inputs; and the session settings every
test runs under.

Only pytest fixtures and session settings live here; the builders are in tests/helpers/models.py. Everything is
built in tmp_path; nothing is written into the repository or the user's home.

The suites run in parallel (pytest-xdist, one worker per core): each worker is its own process with its own
hash cache, and every test sees an idle machine's load, so no output a test asserts on depends on what else the
machine is doing (a test that wants a busy machine patches `os.getloadavg` itself).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from exitbench.models import Raven, save_checkpoint
from exitbench.models.embedded import EMBEDDED_DIR
from exitbench.models.tokenizer import Tokenizer
from exitbench.store.identity import CACHE_DIR_ENV

from helpers.files import model_copy
from helpers.models import SHARD_BYTES, make_tiny_raven, make_tiny_tokenizer
from helpers.sweeps import SharedSweep, build_once

# Tiny models gain nothing from intra-op threads, and with a busy core the thread pool's barriers can make
# a millisecond forward take a second; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)

IDLE_LOAD = (0.0, 0.0, 0.0)


@pytest.fixture(scope="session", autouse=True)
def worker_state(tmp_path_factory):
    """Per worker: the file-digest cache in the worker's own temporary folder (not ~/.cache/exitbench, which
    two workers, or a user's own runs, would share), and an idle machine's load average. Subprocesses inherit
    the cache folder through the environment."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("hash-cache")))
        patch.setattr(os, "getloadavg", lambda: IDLE_LOAD)
        yield


@pytest.fixture(autouse=True)
def lm_eval_logs_to_a_live_stream():
    """lm-eval configures its logger once per process, on the stderr of that moment: inside typer's CliRunner
    that is a stream the runner closes when the command ends, and every later lm-eval warning would then print
    a "Logging error" traceback into whatever test runs next. Such handlers are dropped after each test, so lm-eval
    configures itself again on the next test's stderr, as a fresh process would."""
    yield
    lm_eval_utils = sys.modules.get("lm_eval.utils")
    logger = logging.getLogger("lm_eval")
    dead = [h for h in logger.handlers
            if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False)]
    for handler in dead:
        logger.removeHandler(handler)
    if dead and lm_eval_utils is not None:
        lm_eval_utils._LOGGING_CONFIGURED = False


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


@pytest.fixture
def raven_copy(tmp_path) -> Path:
    """A copy of the embedded tiny-raven (weights, config, tokenizer) that a test may edit."""
    return model_copy(EMBEDDED_DIR / "tiny-raven", tmp_path / "raven-copy")


@pytest.fixture(scope="module")
def small_sweep():
    """(checkpoint, tasks, config) of the smallest exact sweep (helpers/sweeps.py's SMALL), for run_cells and plan."""
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import SweepConfig

    ck = open_checkpoint(None)
    tasks = resolve_tasks(["chains_lambada"])
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16], limit=4)
    return ck, tasks, cfg


@pytest.fixture(scope="module")
def replay_sweep():
    """The same sweep as `small_sweep`, replayed (--replay) and quiet."""
    from exitbench.harness.task_set import resolve_tasks
    from exitbench.models.checkpoint import open_checkpoint
    from exitbench.sweep.config import SweepConfig

    ck = open_checkpoint(None)
    tasks = resolve_tasks(["chains_lambada"])
    cfg = SweepConfig(tasks=["chains_lambada"], policies=["second_order"], thresholds=[0.1], baselines=[16], limit=4,
                      replay=True, quiet=True)
    return ck, tasks, cfg


@pytest.fixture(scope="session")
def shared_sweep(tmp_path_factory, worker_state) -> SharedSweep:
    """The small real sweep of tests/helpers/sweeps.py, run once for the whole session: under pytest-xdist the
    workers' temporary folders share a parent, where the first worker to ask builds it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return build_once(shared / "shared-sweep")


# The files that take longest (measured 2026-12-03: the slow suite's Huginn- and Ouro-size checkpoints, torch.compile,
# the end-to-end runs; the fast suite's engine matrices and checkpoint-header properties), run first. pytest-xdist
# hands whole files to workers in collection order (--dist loadfile), so a long file that starts last keeps one
# worker busy after the other has finished; longest first is the classic remedy. Order only: a stale list costs
# balance, never a result.
LONGEST_FIRST = ("test_full_size.py", "test_compile.py", "test_docs.py", "test_run.py", "test_gpt2.py",
                 "test_engine.py", "test_depth_major.py", "test_checkpoint_headers.py")
# test_full_size.py is one table of families, each row minutes of writing and loading multi-GB checkpoints. Its rows
# run on one worker, one after another, while the other worker takes the rest: spread over both, two rows at once
# could hold two models beside their files' pages (Huginn's and Dory's: about 31 GB on a 24 GB machine). What that
# cost was within CI's run-to-run noise (bench/RESULTS.md, CI under 20 minutes); one at a time it cannot happen.
# The file, first in LONGEST_FIRST, goes to one worker whole, as --dist loadfile hands any.


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
