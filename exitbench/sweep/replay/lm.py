"""lm-eval models over a recording: one that records while answering at full depth, one that replays a policy.

`RecordingLM` answers lm-eval's requests once, at the recording depth, and keeps what each request's tokens did
at every iteration (keyed like the exact model's side table, by (task, doc_id, idx)). `ReplayLM` then answers
the same requests for any exit config from that store: each token's exit from its recorded signals, the
request's answer from the recorded readout at that exit. lm-eval's own evaluator turns the answers into
metrics, so a replay cell's numbers come from the same code as an exact cell's.

Generation cannot be replayed past the first token whose exit prediction differs from the recorded one (every
later token would see a different context). Such an answer ends with that token, and the cell says how many
answers were cut (`replay.generation`); `--verify` reruns the frontier cells exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from lm_eval.api.model import LM

from ...engine import ExitConfig, TokenRecord
from ...engine.flops import FlopModel
from ...engine.recorder import Recorder, Sequence_, Trajectories, variant_key
from ...harness.model import ExitbenchLM
from ...models import Checkpoint
from ...store import cells
from .costs import CostModel


@dataclass
class Entry:
    """One lm-eval request's recording."""

    kind: str
    parts: list[tuple[Trajectories, int]]  # (trajectories, member) per pass (rolling windows: several)
    counted: bool = True                   # a shared pass's tokens count with its group's first request only
    targets: np.ndarray | None = None      # loglikelihood: the continuation's tokens
    text: str | None = None                # generation: the recorded (full-depth) answer
    generated: list[int] = field(default_factory=list)
    until: list[str] = field(default_factory=list)


SAMPLE = 4  # scoring requests the cost model times (a few: its unit costs are per token)


class RecordingLM(ExitbenchLM):
    """Answers at the recording depth (fixed depth K, exact) and records every request's trajectories."""

    @classmethod
    def over(cls, ck: Checkpoint, recorder: Recorder, batch_size: int, add_bos_token: bool | None,
             seed: int, on_progress: Callable[[int, int], None] | None = None) -> "RecordingLM":
        self = cls(ck, exit_config=ExitConfig("fixed", threshold=recorder.K, seed=seed), batch_size=batch_size,
                   add_bos_token=add_bos_token, on_progress=on_progress)
        self.recorder = recorder
        self.store: dict[tuple, Entry] = {}
        self.sample: list[tuple[list[int], int]] = []  # scoring requests the cost model times
        return self

    def _record_passes(self, seqs: list[Sequence_]) -> list[Trajectories]:
        for seq in seqs[:max(0, SAMPLE - len(self.sample))]:
            self.sample.append((seq.inputs + seq.members[0][-1:], seq.first + 1))
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].inputs))
        out: list[Trajectories | None] = [None] * len(seqs)
        for a in range(0, len(order), self.batch_size):
            batch = order[a:a + self.batch_size]
            for i, traj in zip(batch, self.recorder.record([seqs[i] for i in batch])):
                out[i] = traj
            self._progress(min(a + self.batch_size, len(order)), len(order))
        return out  # type: ignore[return-value]

    @staticmethod
    def _key(req) -> tuple:
        return (req.task_name, req.doc_id, req.idx)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs, groups = self.scoring_groups(requests)
        seqs = []
        for group in groups:
            (tokens, n_ctx), _ = pairs[group[0]]
            seqs.append(Sequence_(tokens[:-1], n_ctx - 1, [pairs[i][0][0][n_ctx:] for i in group]))
        out = [None] * len(requests)
        for group, seq, traj in zip(groups, seqs, self._record_passes(seqs)):
            for m, i in enumerate(group):
                targets = np.asarray(seq.members[m])
                self.store[self._key(requests[i])] = Entry("loglikelihood", [(traj, m)], counted=m == 0,
                                                           targets=targets)
                out[i] = (float(traj.quality[m][:, -1].sum()), bool(np.all(traj.top[-1][:, -1] == targets)))
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = [self.rolling_windows(req.args[0]) for req in requests]
        flat = [(tokens[:-1], n_ctx - 1, tokens[n_ctx:]) for ws in windows for tokens, n_ctx in ws]
        trajs = iter(self._record_passes([Sequence_(i, f, [t]) for i, f, t in flat]))
        out = []
        targets = iter(t for _, _, t in flat)
        for req, ws in zip(requests, windows):
            parts = [(next(trajs), 0) for _ in ws]
            self.store[self._key(req)] = Entry("loglikelihood_rolling", parts,
                                               targets=np.asarray([t for _ in ws for t in next(targets)]))
            out.append(float(sum(t.quality[0][:, -1].sum() for t, _ in parts)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # The recording depth's own generation (exact), then its tokens teacher-forced through the recorder.
        order, prompts, untils, results, _ = self.generate(requests)
        seqs = [Sequence_(p + r.tokens[:-1], len(p) - 1, [r.tokens]) for p, r in zip(prompts, results)]
        outputs: list[str | None] = [None] * len(requests)
        for j, (i, res, traj) in enumerate(zip(order, results, self._record_passes(seqs))):
            text = self.generation_text(res.tokens, untils[j])
            self.store[self._key(requests[i])] = Entry("generate_until", [(traj, 0)], text=text,
                                                       generated=list(res.tokens), until=untils[j])
            outputs[i] = text
        return outputs  # type: ignore[return-value]


class ReplayLM(LM):
    """lm-eval's requests answered from a recording under one exit config."""

    def __init__(self, recording: RecordingLM, config: ExitConfig, costs: CostModel, tokens: bool = False):
        """`tokens`: also keep each exited token's text, log-probability and greedy flag (for samples)."""
        super().__init__()
        self.recording, self.config, self.costs, self.tokens = recording, config, costs, tokens
        model = recording.ck.model
        self.policies = config.bound_policies(model.loop_groups())
        self.K = recording.recorder.K
        self.flops = FlopModel(model, [min(g.default_steps, p.max_steps)
                                       for g, p in zip(model.loop_groups(), self.policies)])
        self.request_stats: list[dict[str, Any]] = []
        self._exits: dict[tuple[int, int, bool], np.ndarray] = {}
        self.generation: dict[str, dict[str, int]] = {}  # task → documents, and those generated again exactly

    # ---- exits and outputs of one pass ------------------------------------------------------------------------
    def exits(self, traj: Trajectories, member: int, by_target: bool = True) -> np.ndarray:
        """Exit step per scored token and loop group, (n, G). The oracle agrees with full depth by the target's
        log-probability where a target is given (scoring), by the argmax where the model chose it (generation)."""
        # The options of a question share a pass and, but for the oracle, its exits.
        key = (id(traj), member if self.policies[-1].retrospective else 0, by_target)
        if key not in self._exits:
            self._exits[key] = traj.exits(self.policies, member, by_target)
        return self._exits[key]

    def outputs(self, traj: Trajectories, member: int, exits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The target's log-probability and the argmax at each token's exit."""
        policy = self.policies[-1]
        if policy.signal_free and policy.max_steps in traj.fixed_picked:
            return traj.fixed_picked[policy.max_steps][member], traj.fixed_top[policy.max_steps]
        at = exits[:, -1] - 1
        rows = np.arange(len(at))
        return traj.quality[member][rows, at], traj.top[-1][rows, at]

    def records(self, traj: Trajectories, exits: np.ndarray) -> list[TokenRecord]:
        out = []
        for j, (position, steps) in enumerate(zip(traj.positions, exits.tolist())):
            probes = [k if p.needs_logits else 0 for k, p in zip(steps, self.policies)]
            out.append(TokenRecord(position, steps, self.costs.token(steps, self.policies),
                                   self.flops.token(position + 1, steps, probes),
                                   nonfinite=not bool(traj.finite[j, steps[-1] - 1]),
                                   stalled=self._stalled(traj, j, steps)))
        return out

    def _stalled(self, traj: Trajectories, j: int, steps: list[int]) -> bool | None:
        """As the engine counts it: some group's token ran to its cap with the rule's last signal stalled."""
        if not any(p.counts_stalls for p in self.policies):
            return None
        return any(p.counts_stalls and k >= max(p.max_steps, p.defined_from)
                   and p.stalled(traj.signals[g][variant_key(p)][j, k - 1].tolist())
                   for g, (p, k) in enumerate(zip(self.policies, steps)))

    def _record(self, req, kind: str, records: list[TokenRecord], tokens=(), logprobs=(), greedy=()) -> None:
        stats = cells.request_stats(records, 0.0)
        stats["seconds"] = stats["token_seconds"]  # an estimate, like every time in a replay cell
        if self.tokens:  # as the exact model keeps them, for exit maps drawn from samples
            stats.update(token_text=self.recording.tok.pieces([int(t) for t in tokens]),
                         logprobs=[None if x is None else float(x) for x in logprobs],
                         greedy=[bool(g) for g in greedy])
        self.request_stats.append({"task_name": req.task_name, "doc_id": req.doc_id, "idx": req.idx, "kind": kind,
                                   **stats})

    def _entry(self, req) -> Entry:
        return self.recording.store[RecordingLM._key(req)]

    # ---- lm-eval's three request types -----------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            entry = self._entry(req)
            (traj, m), = entry.parts
            exits = self.exits(traj, m)
            picked, top = self.outputs(traj, m, exits)
            out.append((float(picked.sum()), bool(np.all(top == entry.targets))))
            # The exact run shares one pass among a question's options, except under the oracle (its exits
            # depend on each option's target): count tokens as it does.
            counted = entry.counted or self.policies[-1].retrospective
            if counted:
                self._record(req, "loglikelihood", self.records(traj, exits), entry.targets, picked,
                             top == entry.targets)
            else:
                self._record(req, "loglikelihood", [])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            entry = self._entry(req)
            records, picked, top = [], [], []
            for traj, m in entry.parts:
                exits = self.exits(traj, m)
                p, t = self.outputs(traj, m, exits)
                picked.append(p)
                top.append(t)
                records += self.records(traj, exits)
            picked, top = np.concatenate(picked), np.concatenate(top)
            self._record(req, "loglikelihood_rolling", records, entry.targets, picked, top == entry.targets)
            out.append(float(picked.sum()))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            entry = self._entry(req)
            (traj, m), = entry.parts
            exits = self.exits(traj, m, by_target=False)
            picked, top = self.outputs(traj, m, exits)
            counts = self.generation.setdefault(req.task_name, {"documents": 0, "diverged": 0})
            counts["documents"] += 1
            differs = np.flatnonzero(top != np.asarray(entry.generated))
            if differs.size == 0:
                out.append(entry.text)
                self._record(req, "generate_until", self.records(traj, exits), entry.generated, picked,
                             [True] * len(picked))
                continue
            # The policy's token differs from the recorded one here, and everything the policy would generate
            # after it is unknown: the answer is cut after that token, and the cell says how many were.
            counts["diverged"] += 1
            cut = int(differs[0]) + 1
            tokens = entry.generated[:cut - 1] + [int(top[cut - 1])]
            out.append(self.recording.generation_text(tokens, entry.until))
            # (the cut token's log-probability is not recorded: the recording scored the full-depth token there)
            self._record(req, "generate_until", self.records(traj, exits)[:cut], tokens,
                         list(picked[:cut - 1]) + [None], [True] * cut)
        return out
