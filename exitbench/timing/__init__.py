"""Where the wall-clock lives: every clock, the paired repeats, their estimate and every rule for trusting them.

- `clocks`: the engine's phase clocks (prelude, core, probe, coda, …) and its decode and steady-state seconds.
- `retime`: a cell timed again beside full depth on two clocks (throughput and latency), on documents drawn
  across the task: the paired ratios a speed-up is read from.
- `speedup`: what a cell's timings say as a speed-up (its basis, interval, iteration bound) and how every table
  writes it.
- `trust`: when a timing is not to be read (a busy machine, repeats spread wide, a ratio above its bound), for
  the writer that records it and every reader that shows it.

The package imports nothing above runtime: the engine reads its clocks, the sweep runs its retiming, and the
readers (analysis) read its estimates and rules.
"""
