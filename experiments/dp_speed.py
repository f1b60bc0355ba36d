"""How long the recompute DP takes per chain length (target: 100 stages, 500 slots, 2 s).

Usage: python experiments/dp_speed.py [--slots 500] [--lengths 10 25 50 100 150] [--repeats 3]
Prints one line per length: the median solve time over the repeats, at a budget midway between
the least feasible one and keep-all, beside the estimate that solvers.dp warns and refuses by
and the memory of its tables.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from solvers.chain import Chain, Stage
from solvers.dp import estimated_seconds, memory_need, solve_dp, table_bytes


def transformer_like_chain(length: int, seed: int = 0) -> Chain:
    """A chain with mildly varying stage sizes and times, like a transformer's blocks."""
    rng = random.Random(seed)
    stages = []
    for i in range(1, length + 1):
        out = rng.randint(90, 110) * 2**20
        stages.append(
            Stage(
                name=f"block{i}",
                fwd_s=rng.uniform(0.9, 1.1) * 1e-3,
                bwd_s=rng.uniform(1.8, 2.2) * 1e-3,
                out_bytes=out,
                saved_bytes=out * rng.randint(6, 12),
                fwd_tmp_bytes=out,
                bwd_tmp_bytes=2 * out,
            )
        )
    return Chain(f"bench{length}", 100 * 2**20, tuple(stages))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 25, 50, 100, 150])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'stages':>6} {'slots':>6} {'median solve (s)':>17} {'estimate (s)':>13} "
        f"{'tables (GiB)':>13} {'overhead':>9}"
    )
    for length in args.lengths:
        chain = transformer_like_chain(length)
        keep_all = chain.input_bytes + sum(s.saved_bytes for s in chain.stages)
        budget = (memory_need(chain) + keep_all) // 2
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = solve_dp(chain, budget, slots=args.slots)
            times.append(time.perf_counter() - start)
        overhead = plan.predicted_time_s / chain.compute_time_s - 1
        print(
            f"{length:>6} {args.slots:>6} {statistics.median(times):>17.3f} "
            f"{estimated_seconds(length, args.slots):>13.1f} "
            f"{table_bytes(length, args.slots) / 2**30:>13.2f} {overhead:>8.1%}"
        )


if __name__ == "__main__":
    main()
