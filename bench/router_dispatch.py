"""Router dispatch decision time: `Dispatcher.dispatch` (the instances' latest loads plus the router's
in-flight requests, then the policy) at 16, 256 and 1,024 instances.

    .venv/bin/python bench/router_dispatch.py [--instances 16,256,1024] [--decisions 2000]

Each instance holds a realistic load (8 running requests, 2 queued) and a few requests the router
dispatched that its load does not list yet; every decision is released again so the state stays
the same. Prints mean / p50 / p99 per policy and instance count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.policies.dispatch import POLICY_NAMES, make_dispatch_policy
from llumnix.router.dispatcher import Dispatcher
from llumnix.router.instances import InstanceSet
from llumnix.wire import LoadReport, LoadSource


def _load(instance_id: str, rng: random.Random) -> InstanceLoad:
    running = tuple(RequestLoad(f"{instance_id}-r{i}", rng.randint(50, 800), rng.randint(1, 300),
                                blocks=rng.randint(5, 60)) for i in range(8))
    waiting = tuple(RequestLoad(f"{instance_id}-w{i}", rng.randint(50, 800)) for i in range(2))
    used = sum(r.blocks for r in running)
    return InstanceLoad(instance_id, 4000, 4000 - used, 16, running, waiting, timestamp=time.time())


async def measure(policy: str, instances: int, decisions: int) -> list[float]:
    rng = random.Random(0)
    instance_set = InstanceSet()
    loads = [_load(f"i{i}", rng) for i in range(instances)]

    def refresh(sequence: int) -> None:
        """New loads (same content): what the 1 s heartbeats do, so no instance goes stale."""
        for instance, load in zip(instance_set.all(), loads, strict=True):
            instance.observe(LoadReport(load, 0.0, 0.0, 0.0, LoadSource.CONNECTOR, sequence))

    for i in range(instances):
        instance = instance_set.add(f"10.0.{i // 250}.{i % 250}:50051", watch=False)
        for k in range(2):
            instance.reserve(RequestLoad(f"i{i}-pending{k}", 200))
    dispatcher = Dispatcher(make_dispatch_policy(policy), instance_set)
    times = []
    refreshed = -1.0
    for n in range(decisions):
        if time.monotonic() - refreshed > 1.0:
            refresh(n + 1)
            refreshed = time.monotonic()
        request = RequestLoad(f"new-{n}", rng.randint(50, 800))
        started = time.perf_counter()
        chosen = dispatcher.dispatch(request)
        times.append(time.perf_counter() - started)
        assert chosen is not None
        chosen.release(request.request_id)
    await instance_set.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="16,256,1024")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    args = parser.parse_args()
    print(f"{'policy':<16}{'instances':>10}{'mean':>12}{'p50':>12}{'p99':>12}")
    for policy in args.policies.split(","):
        for count in (int(c) for c in args.instances.split(",")):
            times = asyncio.run(measure(policy, count, args.decisions))
            p99 = statistics.quantiles(times, n=100)[98]
            print(f"{policy:<16}{count:>10}{statistics.mean(times) * 1e3:>10.3f}ms"
                  f"{statistics.median(times) * 1e3:>10.3f}ms{p99 * 1e3:>10.3f}ms", flush=True)


if __name__ == "__main__":
    main()
