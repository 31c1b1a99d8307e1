"""The documents to measure on: a text file's paragraphs, an lm-eval task's documents, or, for a checkpoint
trained on the synthetic chains, held-out programs of its own task. `exitbench geometry`, `calibrate` and the
depth report all read their tokens from here.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ExitbenchError
from ..models import Checkpoint
from ..training import synthetic
from ..training.config import CHAINS_ARCHS


def synthetic_training(ck: Checkpoint) -> dict[str, Any] | None:
    """The training config of a checkpoint `exitbench train` made on a synthetic task (None for text models)."""
    training = ck.provenance.get("training", {}).get("train_config")
    if not training or training.get("arch", "huginn_raven") not in CHAINS_ARCHS or not training.get("task"):
        return None
    return training


def heldout_batch(ck: Checkpoint, n_programs: int, seed: int):
    """(inputs, targets, hops) of `n_programs` held-out programs of the checkpoint's synthetic task, and the task."""
    training = synthetic_training(ck)
    if not training:
        raise ExitbenchError(f"{ck.path} records no synthetic training task; the depth report needs a checkpoint "
                             "made by `exitbench train` on chains (for a text model, compare the fixed-depth "
                             "baselines of `exitbench run --tasks gsm8k_text`)")
    task = synthetic.make_task(training["task"], n_chains=training["n_chains"], length=training["max_hop"])
    if ck.tokenizer is None:
        raise ExitbenchError(f"{ck.path} has no tokenizer.json")
    # A string seed keeps held-out programs on a stream the trainer's integer-keyed streams never use.
    return synthetic.batch(task, ck.tokenizer, n_programs, random.Random(f"heldout-{seed}")), task


def text_documents(path: str | Path) -> list[str]:
    """Documents of a text file: paragraphs separated by blank lines (one document if there are none)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ExitbenchError(f"--text {path} is not a readable file")
    docs = [d.strip() for d in path.read_text(errors="replace").split("\n\n") if d.strip()]
    if not docs:
        raise ExitbenchError(f"--text {path} holds no text")
    return docs


def task_documents(task: str, data_dir: str | None = None, *, split: str = "evaluation",
                   contexts: bool = False) -> list[str]:
    """An lm-eval task's documents as plain text (context followed by the gold target; with `contexts`, the
    context alone where there is one): its evaluation split, or with split="fitting" the split that is not
    evaluated (training, else validation), for fitting things to the model without touching the evaluation."""
    from lm_eval.tasks import get_task_dict

    from .task_set import resolve_tasks

    taskset = resolve_tasks([task], data_dir)
    docs = []
    for obj in get_task_dict(taskset.specs, taskset.manager).values():
        for doc in obj.eval_docs if split == "evaluation" else _fitting_docs(task, obj):
            target = obj.doc_to_target(doc)
            text = obj.doc_to_text(doc)
            if contexts and text:
                docs.append(text)
                continue
            if isinstance(target, str):
                text = f"{text}{obj.config.target_delimiter if text else ''}{target}"
            docs.append(text)
    return docs


def _fitting_docs(task: str, obj):
    """The training, else validation, documents of a task whose evaluation reads another split."""
    eval_split = obj.config.test_split or obj.config.validation_split
    for has, docs, split in ((obj.has_training_docs, obj.training_docs, obj.config.training_split),
                             (obj.has_validation_docs, obj.validation_docs, obj.config.validation_split)):
        if has() and split != eval_split:
            return docs()
    raise ExitbenchError(f"task {task} has no training or validation split apart from the one it evaluates on; "
                         "fit on --text FILE of held-out text instead")


def encode_documents(ck: Checkpoint, docs: Sequence[str], max_tokens: int) -> list[torch.Tensor]:
    """Token ids of documents (BOS first, cut at the context), up to `max_tokens` tokens in all."""
    tok = ck.tokenizer
    if tok is None:
        raise ExitbenchError(f"{ck.path} has no tokenizer.json; geometry on text needs one")
    block = ck.model.config.block_size
    out, total = [], 0
    for doc in docs:
        ids = tok.encode(doc, add_bos=True)[:block]
        if len(ids) < 2:
            continue
        ids = ids[: max_tokens - total]
        out.append(torch.tensor(ids))
        total += len(ids)
        if total >= max_tokens:
            break
    if not out:
        raise ExitbenchError("no document had a token to measure")
    return out


def heldout_programs(ck: Checkpoint, n_programs: int, seed: int) -> list[torch.Tensor]:
    """Held-out programs of the synthetic task a chains-trained checkpoint learned (the depth report's)."""
    (inputs, _, _), _ = heldout_batch(ck, n_programs, seed)
    return [inputs]


def document_source(task: str | None, text: str | None, data_dir: str | None, programs: int, seed: int | str,
                    split: str = "evaluation") -> tuple[list[str] | None, dict[str, Any]]:
    """The documents of --task (its `split`) or --text (None: the checkpoint's held-out programs), and how to
    name them."""
    if task and text:
        raise ExitbenchError("give --task or --text, not both")
    if text:
        return text_documents(text), {"text": str(text)}
    if task:
        return task_documents(task, data_dir, split=split), {"task": task, "split": split, "data_dir": data_dir}
    return None, {"heldout_programs": programs, "seed": seed}


def token_batches(ck: Checkpoint, docs: Sequence[str] | None, max_tokens: int, programs: int, seed: int,
                  purpose: str) -> list[torch.Tensor]:
    """Token ids of `docs` for this checkpoint, or its held-out programs when there are no documents."""
    if docs is not None:
        return encode_documents(ck, docs, max_tokens)
    if synthetic_training(ck) is None:
        raise ExitbenchError(f"{ck.path} was not trained on a synthetic task; pass --task T or --text FILE for the "
                             f"tokens to {purpose}")
    return heldout_programs(ck, programs, seed)


def token_lists(ck: Checkpoint, *, task: str | None = None, text: str | None = None, data_dir: str | None = None,
                max_tokens: int = 8192, programs: int = 128, seed: int | str = 0, purpose: str = "measure on",
                split: str = "evaluation") -> tuple[list[list[int]], dict[str, Any]]:
    """Token lists of --task, --text or the held-out programs (each at least two tokens long), and how to name
    their source."""
    if max_tokens < 2:
        raise ExitbenchError(f"--tokens must be ≥ 2 (a token and the one it predicts), got {max_tokens}")
    if programs < 1:
        raise ExitbenchError(f"--programs must be ≥ 1, got {programs}")
    docs, source = document_source(task, text, data_dir, programs, seed, split)
    batches = token_batches(ck, docs, max_tokens, programs, seed, purpose)
    rows = [row.tolist() for b in batches for row in (b if b.dim() == 2 else b.unsqueeze(0))]
    return [r for r in rows if len(r) >= 2], source
