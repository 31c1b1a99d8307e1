"""What the caller and the model in vLLM's worker tell each other about requests, in one process (the backend
runs vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the uni-process executor).

vLLM's forward sees token ids and positions only, not requests. The caller announces where each prompt's
exits begin (`expect`: a scoring request's context is prefilled at full depth, as exitbench's engine does; a
generation's prompt exits at its last token, the default); the model files each request's exit iterations
(`Trace`), found again by its first KV block for its later tokens, and the caller collects them by prompt."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Trace:
    """One request as the model saw it: its prompt and each computed position's exit iteration."""

    prompt: tuple[int, ...]
    steps: dict[int, int] = field(default_factory=dict)


class Ledger:
    def __init__(self):
        self.first_exit: dict[tuple[int, ...], int] = {}
        self.traces: list[Trace] = []
        self.by_block: dict[int, Trace] = {}

    def expect(self, prompt: list[int], first_exit: int) -> None:
        """Positions of `prompt` from `first_exit` on run with exits (the rest at full depth)."""
        self.first_exit[tuple(prompt)] = first_exit

    def start(self, prompt: tuple[int, ...], block: int) -> tuple[Trace, int]:
        """A request's prefill: its trace, kept by its first KV block, and where its exits begin."""
        trace = Trace(prompt)
        self.traces.append(trace)
        self.by_block[block] = trace
        return trace, self.first_exit.get(prompt, len(prompt) - 1)

    def collect(self) -> dict[tuple[int, ...], list[Trace]]:
        """Every trace filed since the last collect, by prompt in the order they came, and a fresh ledger."""
        out: dict[tuple[int, ...], list[Trace]] = defaultdict(list)
        for trace in self.traces:
            out[trace.prompt].append(trace)
        self.__init__()
        return out


LEDGER = Ledger()
