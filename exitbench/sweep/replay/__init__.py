"""Replay sweeps: every cell of a sweep from one recording pass, checked against exact runs on the frontier.

Each policy applies its own exit rule to recorded trajectories (`ExitPolicy.recorded_exits`).

lm.py         lm-eval models that record (RecordingLM, over exitbench.engine.recorder) and replay one
              exit config (ReplayLM)
costs.py      the per-iteration costs a replay cell's estimated wall-clock is made of
sweep.py      the replay sweep; verify.py: frontier cells rerun exactly, replay vs exact
"""
from .sweep import ReplaySweep
from .verify import verify_frontier

__all__ = ["ReplaySweep", "verify_frontier"]
