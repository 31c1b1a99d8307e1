"""The exit engine: loop groups iterated token by token, each token exiting on its own.

engine.py   ExitEngine: score / generate, the prefill, rows that advance on their own
loop.py     TokenLoop: one loop group's tokens in flight, their probe and where they leave
hindsight.py  a retrospective rule's (the oracle's) record of each token's trajectory, and its settling
timing.py   phase times shared by the tokens that took part; noise.py: initial states by position
records.py  what a run returns per sequence and per token
config.py   ExitConfig: the exit knobs, defined once
recorder.py the recording pass (every scored position at every iteration, teacher-forced) that replay
            sweeps, calibration and fit-exit read
flops.py    analytic FLOPs per token; memory.py: the memory a run needs, before it runs
"""
from ..timing.clocks import PHASES
from .config import ExitConfig
from .engine import ExitEngine
from .noise import PositionNoise
from .records import SequenceResult, TokenRecord

__all__ = ["PHASES", "ExitConfig", "ExitEngine", "PositionNoise", "SequenceResult", "TokenRecord"]
