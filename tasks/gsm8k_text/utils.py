"""GSM8K text from a local copy (--data-dir reaches here as metadata["data_dir"]): test evaluated, train for fitting."""
import json
from pathlib import Path

import datasets


def load_gsm8k_text(data_dir=None, **kwargs):
    if not data_dir:
        raise ValueError("gsm8k_text reads test.jsonl from --data-dir (a local copy of GSM8K); none was given")
    # The train split is never evaluated: `exitbench fit-exit --task gsm8k_text` fits exit models on it.
    return {split: _split(Path(data_dir) / f"{split}.jsonl") for split in ("train", "test")}


def _split(path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_list([{"text": f"{r['question']}\n{r['answer']}"} for r in rows])
