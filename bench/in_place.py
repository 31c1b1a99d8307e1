"""Where a place's keys are best read in place, on this CPU: the crossover behind `cache.IN_PLACE_FROM`.

One attention layer's call as a step of continuous depth batching makes it: `--batch` places, each at its own
row, position and loop iteration (so its own slot), some free (writing to the unread column), every place masked
to the read length the place context gives (twice the mean position, as its doubling leaves it). The two reads
take turns on the same call:
- gather (`write_and_gather`): every place's `length` keys and values copied into one tensor, then one masked
  attention;
- in place (`KVCache.attend_in_place`): one attention per busy place over a view of exactly its keys.
For each key width (KV heads × head_dim) and batch it prints µs per call of each, their ratio, and the bytes per
place and layer the gather copies, which is what the switch reads; the outputs are checked to agree.

    python bench/in_place.py                       # widths 128 … 1024, batch 16 and 64
    python bench/in_place.py --widths 512 --batch-sizes 64 --rounds 20
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exitbench.models import AttnContext, KVCache, attention  # noqa: E402

HEAD_DIM = 64
SLOTS = 16
FREE = 0.08  # the share of free places in steady state (tiny-raven at batch 16: 14.73 of 16 busy)


def call(batch: int, width: int, mean_position: int, seed: int):
    """A cache and one layer's step of `batch` places, as (the call's arguments, its in-place index, bytes)."""
    rng = random.Random(seed)
    heads = width // HEAD_DIM
    capacity = 4 * mean_position
    cache = KVCache(batch, heads, HEAD_DIM, {0: SLOTS}, capacity=capacity)
    for store in (cache.k, cache.v):
        store[0].normal_()
    positions = [rng.randint(1, 2 * mean_position - 1) for _ in range(batch)]
    free = set(rng.sample(range(batch), round(FREE * batch)))
    iterations = [rng.randrange(SLOTS) for _ in range(batch)]
    writes = [capacity - 1 if j in free else p for j, p in enumerate(positions)]
    ctx = AttnContext.tokens(cache, list(range(batch)), positions, iteration=None, writes=writes,
                             length=2 * mean_position)
    ctx.places.fixed = True
    ctx = ctx.at_iteration(torch.tensor(iterations), host=iterations)
    index = cache.in_place(ctx.index, [(j, j, p, i) for j, (p, i) in enumerate(zip(positions, iterations))
                                       if j not in free])
    q, k, v = (torch.randn(batch, heads, 1, HEAD_DIM) for _ in range(3))
    busy = [j for j in range(batch) if j not in free]
    return (q, k, v, ctx), index, busy, 2 * ctx.index.length * width * 4


def timed(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="128,256,384,512,768,1024", help="KV heads × head_dim (64)")
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--mean-position", type=int, default=32, help="a place's mean position (keys it reads)")
    parser.add_argument("--rounds", type=int, default=10, help="turns of the two reads; the median is shown")
    parser.add_argument("--calls", type=int, default=20, help="calls per turn")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'width':>5s} {'batch':>5s} {'KB/place':>8s} {'gather µs':>10s} {'in place µs':>11s} {'ratio':>6s}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for width in [int(w) for w in args.widths.split(",")]:
            (q, k, v, ctx), index, busy, nbytes = call(batch, width, args.mean_position, seed=width + batch)
            placed = AttnContext(cache=ctx.cache, rows=ctx.rows, iteration=ctx.iteration, positions=ctx.positions,
                                 places=ctx.places, index=index)
            gather = lambda: attention._cache_attention(q, k, v, ctx, 0)  # noqa: E731
            in_place = lambda: attention._cache_attention(q, k, v, placed, 0)  # noqa: E731
            # the same keys read both ways: the attention of every busy place agrees to float rounding
            torch.testing.assert_close(in_place()[busy], gather()[busy], rtol=1e-5, atol=1e-5)
            times = {"gather": [], "in place": []}
            for _ in range(args.rounds):
                times["gather"].append(timed(gather, args.calls))
                times["in place"].append(timed(in_place, args.calls))
            g, p = statistics.median(times["gather"]) * 1e6, statistics.median(times["in place"]) * 1e6
            print(f"{width:5d} {batch:5d} {nbytes / 1024:8.0f} {g:10.0f} {p:11.0f} {p / g:6.2f}", flush=True)


if __name__ == "__main__":
    main()
