"""Router dispatch decision time: `Dispatcher.dispatch` (the instances' latest loads plus the router's
in-flight requests, then the policy) at 16, 256 and 1,024 instances.

    .venv/bin/python bench/router_dispatch.py [--instances 16,256,1024] [--decisions 2000]
        [--loads-per-decision 4] [--in-flight 64]

Each instance holds a realistic load (8 running requests, 2 queued, at random sizes). Before every
decision `--loads-per-decision` instances (in turn) report a new load of that kind, which also lists
the requests the router has in flight there. Every decision reserves its request on the chosen
instance (pending there until its next load lists it), and the request dispatched `--in-flight`
decisions earlier is released (ended: its instance's load still lists it until the next one).
Prints mean / p50 / p99 of the decisions per policy and instance count, and the mean time
`Instance.observe` takes per load (the router re-ranks the instance then), after `--warmup`
decisions that are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import random
import statistics
import time

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.policies.dispatch import POLICY_NAMES, make_dispatch_policy
from llumnix.router.dispatcher import Dispatcher
from llumnix.router.instances import Instance, InstanceSet
from llumnix.wire import LoadReport, LoadSource


def _load(instance_id: str, rng: random.Random, dispatched: tuple[RequestLoad, ...] = ()) -> InstanceLoad:
    running = tuple(RequestLoad(f"{instance_id}-r{i}", rng.randint(50, 800), rng.randint(1, 300),
                                blocks=rng.randint(5, 60)) for i in range(8))
    waiting = tuple(RequestLoad(f"{instance_id}-w{i}", rng.randint(50, 800)) for i in range(2))
    used = sum(r.blocks for r in running)
    return InstanceLoad(instance_id, 4000, 4000 - used, 16, running, waiting + dispatched,
                        timestamp=time.time())


async def measure(policy: str, instances: int, decisions: int, warmup: int, loads_per_decision: int,
                  in_flight: int) -> tuple[list[float], list[float]]:
    """Seconds per decision, and per load taken in."""
    rng = random.Random(0)
    instance_set = InstanceSet()
    sequence = itertools.count(1)
    requests: dict[str, RequestLoad] = {}

    def report(instance: Instance, instance_id: str) -> float:
        dispatched = tuple(requests[request_id] for request_id in sorted(instance.in_flight))
        load_report = LoadReport(_load(instance_id, rng, dispatched), 0.0, 0.0, 0.0, LoadSource.CONNECTOR,
                                 next(sequence))
        started = time.perf_counter()
        instance.observe(load_report)
        return time.perf_counter() - started

    for i in range(instances):
        report(instance_set.add(f"10.0.{i // 250}.{i % 250}:50051", watch=False), f"i{i}")
    dispatcher = Dispatcher(make_dispatch_policy(policy), instance_set)
    reporting = itertools.cycle(enumerate(instance_set.all()))
    dispatched: collections.deque[tuple[Instance, str]] = collections.deque()
    times: list[float] = []
    load_times: list[float] = []
    for n in range(warmup + decisions):
        for _ in range(loads_per_decision):
            i, instance = next(reporting)
            elapsed = report(instance, f"i{i}")
            if n >= warmup:
                load_times.append(elapsed)
        request = requests[f"new-{n}"] = RequestLoad(f"new-{n}", rng.randint(50, 800))
        started = time.perf_counter()
        chosen = dispatcher.dispatch(request)
        elapsed = time.perf_counter() - started
        if n >= warmup:
            times.append(elapsed)
        assert chosen is not None
        dispatched.append((chosen, request.request_id))
        if len(dispatched) > in_flight:
            done, request_id = dispatched.popleft()
            done.release(request_id)
            del requests[request_id]
    await instance_set.close()
    return times, load_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="16,256,1024")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--loads-per-decision", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    args = parser.parse_args()
    print(f"{'policy':<16}{'instances':>10}{'mean':>12}{'p50':>12}{'p99':>12}{'per load':>12}")
    for policy in args.policies.split(","):
        for count in (int(c) for c in args.instances.split(",")):
            times, load_times = asyncio.run(measure(policy, count, args.decisions, args.warmup,
                                                    args.loads_per_decision, args.in_flight))
            p99 = statistics.quantiles(times, n=100)[98]
            per_load = f"{statistics.mean(load_times) * 1e3:>10.3f}ms" if load_times else f"{'-':>12}"
            print(f"{policy:<16}{count:>10}{statistics.mean(times) * 1e3:>10.3f}ms"
                  f"{statistics.median(times) * 1e3:>10.3f}ms{p99 * 1e3:>10.3f}ms{per_load}", flush=True)


if __name__ == "__main__":
    main()
