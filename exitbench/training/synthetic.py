"""The synthetic reasoning task the embedded model is trained and judged on: interleaved binding chains.

A program is several chains `a=7 b=a c=b …` whose statements are shuffled together (order kept within a
chain). Each statement is one token; the answer for a statement is the digit its left-hand side ends up
bound to, and its *hop* is its depth in the chain. Resolving hop h takes h − 1 lookups, and one attention
layer can do one lookup per pass, so a model with a one-layer core needs about h − 1 loop iterations: the
hop is the difficulty level (measured in the README, "The embedded default").

As a causal LM the model predicts a statement's value at the statement's own position; values never appear
in the input except as the very last token of a training sequence, after which the model says <eos>. So
`… c=b` → `3`, then `<eos>`, which is what lm-eval's generate_until and loglikelihood ask of it.
"""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from ..errors import ExitbenchError
from ..models.tokenizer import Tokenizer

NAMES = list(string.ascii_lowercase + string.ascii_uppercase)
DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
IGNORE = -100


def build_tokenizer() -> Tokenizer:
    """Word-level vocabulary: specials, the ten digits, then every statement `x=d` and `x=y` (x ≠ y); an encode
    with special tokens puts <bos> first."""
    words = SPECIAL + DIGITS
    words += [f"{x}={d}" for x in NAMES for d in DIGITS]
    words += [f"{x}={y}" for x in NAMES for y in NAMES if x != y]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL)
    # The model is trained with <bos> first; the post-processor makes lm-eval-style encodes put it there too.
    return Tokenizer(backend, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).add_bos_post_processor()


def factored_embedding(tokenizer: Tokenizer, n_embd: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """An embedding table whose statement rows start as lhs-part + rhs-part: wte[x=y] = L[x] + R[y].

    Each of the ~3000 statement tokens is seen rarely, so a free random row would take long to learn which
    variable it binds; with this start the binding is linearly readable from step 0 and attention only has to
    learn to match R[y] against L[y]. The table stays a plain embedding, so the Raven layout is unchanged.
    """
    part = std / 2 ** 0.5
    draw = lambda n: torch.randn(n, n_embd, generator=generator) * part  # noqa: E731
    lhs, rhs, digit = draw(len(NAMES)), draw(len(NAMES)), draw(len(DIGITS))
    table = torch.randn(tokenizer.vocab_size, n_embd, generator=generator) * std
    index = {n: i for i, n in enumerate(NAMES)}
    vocab = tokenizer.backend.get_vocab()
    for word, token_id in vocab.items():
        if "=" in word:
            x, y = word.split("=")
            table[token_id] = lhs[index[x]] + (digit[int(y)] if y.isdigit() else rhs[index[y]])
    return table


@dataclass
class Program:
    statements: list[str]
    values: list[int]
    hops: list[int]

    @property
    def text(self) -> str:
        return " ".join(self.statements)


@dataclass(frozen=True)
class ChainTask:
    """Shape of the programs: `n_chains` interleaved chains of `length` statements (length = hardest hop)."""

    n_chains: int = 4
    length: int = 12

    def __post_init__(self):
        if self.n_chains < 1 or self.length < 1:
            raise ExitbenchError(f"chains task needs n_chains ≥ 1 and length ≥ 1, got {self.n_chains}, {self.length}")
        if self.n_chains * self.length > len(NAMES):
            raise ExitbenchError(f"chains task: {self.n_chains} chains × {self.length} statements need more than "
                                 f"the {len(NAMES)} variable names; lower --chains or --max-hop")

    def sample(self, rng: random.Random) -> Program:
        names = rng.sample(NAMES, self.n_chains * self.length)
        chains = [names[c * self.length:(c + 1) * self.length] for c in range(self.n_chains)]
        roots = [rng.randrange(10) for _ in chains]
        # Interleave: draw which chain speaks next, in proportion to what it has left (uniform over orders).
        order = [c for c in range(self.n_chains) for _ in range(self.length)]
        rng.shuffle(order)
        pos = [0] * self.n_chains
        statements, values, hops = [], [], []
        for c in order:
            i = pos[c]
            pos[c] += 1
            lhs = chains[c][i]
            rhs = str(roots[c]) if i == 0 else chains[c][i - 1]
            statements.append(f"{lhs}={rhs}")
            values.append(roots[c])
            hops.append(i + 1)
        return Program(statements, values, hops)


TASKS = {"chains": ChainTask}


def make_task(name: str, **kwargs) -> ChainTask:
    if name not in TASKS:
        raise ExitbenchError(f"unknown training task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name](**kwargs)


def encode_program(program: Program, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Inputs [<bos>, s_1 … s_n, v_n] and targets [-, v_1 … v_n, <eos>] (see the module docstring)."""
    digit_ids = [tokenizer.encode(d)[0] for d in DIGITS]
    stmt_ids = tokenizer.encode(program.text)
    inputs = [BOS] + stmt_ids + [digit_ids[program.values[-1]]]
    targets = [IGNORE] + [digit_ids[v] for v in program.values] + [EOS]
    return inputs, targets


def batch(task: ChainTask, tokenizer: Tokenizer, size: int, rng: random.Random
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, hops) tensors of shape (size, n+2); hop 0 marks positions with no statement value."""
    rows = [task.sample(rng) for _ in range(size)]
    enc = [encode_program(p, tokenizer) for p in rows]
    inputs = torch.tensor([e[0] for e in enc])
    targets = torch.tensor([e[1] for e in enc])
    hops = torch.tensor([[0] + p.hops + [0] for p in rows])
    return inputs, targets, hops


def items(task: ChainTask, n_programs: int, seed: int) -> Iterator[dict]:
    """Evaluation items: one per (program, hop level), the prompt ending at a statement of that hop."""
    rng = random.Random(seed)
    for doc in range(n_programs):
        program = task.sample(rng)
        by_hop: dict[int, list[int]] = {}
        for i, h in enumerate(program.hops):
            by_hop.setdefault(h, []).append(i)
        for hop in sorted(by_hop):
            i = rng.choice(by_hop[hop])
            yield {"id": f"{seed}-{doc}-{hop}", "hop": hop, "prompt": " ".join(program.statements[: i + 1]),
                   "answer": str(program.values[i]), "choices": DIGITS, "label": program.values[i]}


def write_jsonl(rows: Iterator[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            n += 1
    tmp.replace(path)
    return n


# The shipped lm-eval task data (tasks/chains/test.jsonl): regenerate with `python -m exitbench.training.synthetic`.
TASK_SEED = 20251127
TASK_PROGRAMS = 50


def write_task_data(path: Path) -> int:
    return write_jsonl(items(ChainTask(), TASK_PROGRAMS, TASK_SEED), path)


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "tasks/chains/test.jsonl"
    print(f"wrote {write_task_data(target)} items to {target}")
