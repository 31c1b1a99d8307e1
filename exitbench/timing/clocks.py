"""Timing the engine's phases, each span shared equally by the tokens that took part in it.

A loop step is shared by every token in flight, so a loop keeps a running sum of (step time / tokens in the
step) per phase, and a token's share is the difference of that sum between its joining and its leaving: O(1)
per step and per token, however many tokens a step holds. Other spans (entering, handing over, finishing)
name their tokens. On a CPU a span is two clock reads; on a GPU kernels run asynchronously, so a span
records two CUDA events that are read after the run (`settle`): one synchronisation per run, not per phase.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

PHASES = ("prefill", "prelude", "core", "probe", "coda")


class PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._spans: list[tuple[str, Any, Any, list[int]]] = []         # phase, start, end, tokens
        self._steps: dict[tuple[int, str], list[tuple[Any, Any, int]]] = defaultdict(list)  # (loop, phase)
        self._charges: list[tuple[int, int, int, int]] = []              # uid, loop, first step, end step
        self.per_token: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES[1:], 0.0))
        # Moments of the run (`mark`), and after `settle` their wall-clock without the prefill: seconds from the
        # first mark, less the prefill spans before each (the clocks a run reports, docs/engine.md).
        self._marks: list[Any] = []
        self.marks_s: list[float] = []

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _end(self) -> Any:
        return self.start()

    def stop(self, started: Any, phase: str, tokens: list[int]) -> None:
        """End a span begun at `started`: `phase` time, shared by `tokens` (ids; none for the prefill)."""
        self._spans.append((phase, started, self._end(), tokens))

    def step(self, started: Any, phase: str, loop: int, tokens: int) -> None:
        """End a step of loop `loop` begun at `started`, shared by the `tokens` in flight."""
        self._steps[(loop, phase)].append((started, self._end(), tokens))

    def mark(self) -> int:
        """A moment of the run; its index into `marks_s`."""
        self._marks.append(self.start())
        return len(self._marks) - 1

    def steps_so_far(self, loop: int) -> int:
        return len(self._steps[(loop, "core")])

    def charge(self, uid: int, loop: int, first: int, end: int) -> None:
        """Token `uid` took part in steps first … end − 1 of loop `loop`."""
        self._charges.append((uid, loop, first, end))

    def settle(self) -> None:
        """Turn the recorded spans into seconds (one synchronisation on a GPU) and share them out."""
        if self.cuda:
            torch.cuda.synchronize()
        seconds = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)  # noqa: E731
        if self._marks:
            first = self._marks[0]
            prefills = [(seconds(first, a), seconds(first, b)) for phase, a, b, _ in self._spans if phase == "prefill"]
            for m in self._marks:
                at = seconds(first, m)
                self.marks_s.append(at - sum(min(b, at) - a for a, b in prefills if a < at))
            self._marks.clear()
        for phase, a, b, tokens in self._spans:
            dt = seconds(a, b)
            self.totals[phase] += dt
            for uid in tokens:
                self.per_token[uid][phase] += dt / len(tokens)
        running: dict[tuple[int, str], list[float]] = {}
        for (loop, phase), steps in self._steps.items():
            total, sums = 0.0, [0.0]
            for a, b, n in steps:
                dt = seconds(a, b)
                self.totals[phase] += dt
                total += dt / n
                sums.append(total)
            running[(loop, phase)] = sums
        for uid, loop, first, end in self._charges:
            for phase in ("core", "probe"):
                sums = running.get((loop, phase))
                if sums is not None:
                    self.per_token[uid][phase] += sums[end] - sums[first]
        self._spans.clear()
        self._steps.clear()
        self._charges.clear()

    def take(self, uid: int) -> dict[str, float]:
        """A finished token's phase times (after `settle`), forgetting them."""
        return self.per_token.pop(uid)
