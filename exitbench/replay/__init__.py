"""Replay sweeps: every cell of a sweep from one recording pass, checked against exact runs on the frontier.

recording.py  the recording pass: every scored position at every iteration, teacher-forced
exits.py      a policy's exit rule over whole recorded trajectories
lm.py         lm-eval models that record (RecordingLM) and replay one exit config (ReplayLM)
costs.py      the per-iteration costs a replay cell's estimated wall-clock is made of
sweep.py      the replay sweep; verify.py: frontier cells rerun exactly, replay vs exact
"""
from .sweep import ReplaySweep, run_replay
from .verify import check_named, parse_named, verify_frontier

__all__ = ["ReplaySweep", "check_named", "parse_named", "run_replay", "verify_frontier"]
