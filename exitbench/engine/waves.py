"""Depth-major scoring: a teacher-forced sequence's positions iterate together, one wave per iteration.

Under Huginn's `latest` rule a token t at iteration k reads, for every earlier token j of its row, j's entry
at iteration min(k, e_j), e_j being j's exit; and t's own exit depends only on its own trajectory. So when
every input is known (scoring), all positions of a sequence can run wave by wave: wave k runs iteration k of
every position still iterating, and a position that exits leaves the wave with its entry carried into the
slots above (as the token-major schedule carries it when the token leaves). Every read a token makes exists
when it makes it, so exits and log-probabilities are those of the token-major schedule, to float rounding,
at one batched step per iteration instead of one per (position, iteration).

`depth_major_blocker` says where this is not so, and the engine keeps its token-major schedule there:
- the oracle: every token runs to max_steps and settles afterwards, so a later token at iteration k > e_j
  would read j's entry of iteration k rather than of e_j;
- a KV window shorter than a loop's depth: a token decoded after j reads what j's *last lap* left in a
  reused slot, which does not exist while j still iterates;
- `warm_start`: a token starts from the previous token's final state.
A decoding rule whose readout attends to other tokens (a coda, a later loop group) reads them in its probe's own
world (probe_cache.py), which holds each earlier position at its exit or at the wave's iteration: exact too.

Loop groups run one after another: a row's positions enter group g+1 together once all of them have left
group g (the plain layers between groups attend to earlier positions' entries of their own, written in the
same call). A long sequence is cut into blocks of positions (`block_positions`): a block's wave reads earlier
blocks' entries at their exit slots, and the row moves to its next block when this one has left the model.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..models import LoopedLM
from .loop import Leaving
from .records import Token

# A wave's token-mode attention gathers each token's row of keys and values: rows × block positions × context ×
# heads × head_dim × 2 per layer. Blocks are sized to keep that gather under this many bytes.
WAVE_GATHER_BYTES = 256 * 2**20


def depth_major_blocker(engine: Any) -> str | None:
    """Why a teacher-forced run of this ExitEngine cannot run depth-major exactly (None: it can). (Typed Any:
    the engine imports this module, not the other way round.)"""
    config = engine.config
    if any(stage.state_layers for stage in engine.model.stages()):
        return "the model keeps per-position states beside its keys (short convolutions), which waves do not gather"
    if config.warm_start:
        return "warm_start: each token starts from the previous token's final state"
    for group, policy in zip(engine.groups, engine.policies):
        if policy.retrospective:
            return f"{policy.name}: it settles each token's exit after running it to max_steps"
        window, private = config.cache_layout()
        if window and private + window < policy.max_steps and group.attn_layers:
            shared = f"kv_window {window}" if not private else f"kv_layout {config.kv_layout}"
            return (f"{shared} keeps fewer slots than {policy.max_steps} iterations: later tokens read an earlier "
                    "token's last lap")
    return None


def gather_bytes(model: LoopedLM, rows: int, capacity: int, dtype: torch.dtype | None = None) -> int:
    """What one position of each of `rows` rows adds to a wave's key and value gather over `capacity`: the
    cached heads, and under grouped-query attention their copies repeated to every query head as well."""
    heads, head_dim = model.cache_geometry()
    query_heads = model.attention_width // head_dim
    read = heads + (query_heads if query_heads != heads else 0)
    return rows * capacity * read * head_dim * 2 * (dtype or model.dtype).itemsize


def block_positions(model: LoopedLM, rows: int, capacity: int, dtype: torch.dtype | None = None) -> int:
    """Positions of a row that enter a wave together: as many as keep the wave's key gather under
    WAVE_GATHER_BYTES (at least one; a tiny model takes whole sequences)."""
    return max(1, WAVE_GATHER_BYTES // max(gather_bytes(model, rows, capacity, dtype), 1))


class DepthMajor:
    """The admission side of a depth-major run: a row enters a block of positions at once, and a block moves
    on to the next loop group, or out of the model, when all of its positions have left the current one."""

    def __init__(self, run: Any, block: int):  # the engine's Run
        self.run, self.block = run, block
        self.size = [0] * run.B                                    # positions in each row's current block
        self.last = [-1] * run.B                                   # each block's last position
        self.held: list[dict[int, list[Leaving]]] = [defaultdict(list) for _ in run.loops]

    def tokens(self, rows: list[int]) -> list[Token]:
        """Each row's next block of positions, as tokens entering the first loop group."""
        run, tokens = self.run, []
        for b in rows:
            req, first = run.serving[b], run.next_pos[b]
            last = min(req.end, first + self.block - 1)
            for pos in range(first, last + 1):
                tokens.append(Token(next(run.uids), b, pos, req.tokens[pos + 1], pos >= req.start,
                                    request=req.index))
            self.size[b], self.last[b] = last - first + 1, last
            run.idle[b] = False
        return tokens

    def complete(self, g: int, out: Leaving) -> Leaving | None:
        """Hold what left group g until each row's block has left it whole; the blocks now whole, in (row,
        position) order, or None."""
        by_row: dict[int, list[int]] = defaultdict(list)
        for i, t in enumerate(out.tokens):
            by_row[t.row].append(i)
        whole = []
        for b, idx in by_row.items():
            at = torch.tensor(idx, device=out.states.device)
            self.held[g][b].append(Leaving([out.tokens[i] for i in idx], out.states[at],
                                           None if out.logits is None else out.logits[at]))
            if sum(len(part.tokens) for part in self.held[g][b]) == self.size[b]:
                whole += self.held[g].pop(b)
        if not whole:
            return None
        tokens = [t for part in whole for t in part.tokens]
        order = sorted(range(len(tokens)), key=lambda i: (tokens[i].row, tokens[i].position))
        at = torch.tensor(order, device=out.states.device)
        states = torch.cat([part.states for part in whole])[at]
        logits = None if whole[0].logits is None else torch.cat([part.logits for part in whole])[at]
        return Leaving([tokens[i] for i in order], states, logits)

    def block_done(self, row: int, position: int) -> bool:
        """Whether `position` closes its row's block (the row then moves on, as after a token token-major)."""
        return position == self.last[row]
