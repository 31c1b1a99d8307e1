"""Held-out GSM8K text (test split) from a local copy: --data-dir reaches here as metadata["data_dir"]."""
import json
from pathlib import Path

import datasets


def load_gsm8k_text(data_dir=None, **kwargs):
    if not data_dir:
        raise ValueError("gsm8k_text reads test.jsonl from --data-dir (a local copy of GSM8K); none was given")
    path = Path(data_dir) / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list([{"text": f"{r['question']}\n{r['answer']}"} for r in rows])}
