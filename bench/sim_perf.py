"""Simulator speed: an M-M trace at 7.5 req/s on 16 instances, Llumnix policy (dispatch, migration).

Target (issue 2): 10,000 requests in at most 60 s on one core. Prints run time and events/second for
1k, 2k, 5k and 10k requests; `--cprofile` prints the hottest functions of the largest run.

    .venv/bin/python bench/sim_perf.py [--sizes 1000,2000,5000,10000] [--policy llumnix] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from llumnix.sim.runner import RunSpec, simulate

TARGET_SECONDS = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,2000,5000,10000")
    parser.add_argument("--policy", default="llumnix")
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'requests':>8} {'events':>9} {'wall s':>7} {'events/s':>9} {'virtual s':>9}")
    wall = 0.0
    for size in sizes:
        spec = RunSpec(args.policy, "M-M", 7.5, requests=size, instances=16, seed=0)
        profiler = cProfile.Profile() if args.cprofile and size == sizes[-1] else None
        if profiler:
            profiler.enable()
        result = simulate(spec)
        if profiler:
            profiler.disable()
        wall = result.wall_seconds
        print(
            f"{size:>8} {result.events:>9} {wall:>7.2f} {result.events / wall:>9.0f} {result.duration:>9.0f}"
        )
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    verdict = "meets" if wall <= TARGET_SECONDS else "misses"
    print(f"largest run: {wall:.1f} s, {verdict} the {TARGET_SECONDS:.0f} s target (profiling adds overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
