"""Chaos under load: a service of sim engines behind two router processes serves a steady load of greedy
streaming completions while a seeded schedule kills -9 engines, llumlets, a router replica, and the
source or the destination of a live migration mid-stage. Every answer is checked token by token
against the sim engine's own next-token function (the unfaulted output), and once the load stops the
engines and llumlets must hold nothing.

    .venv/bin/python bench/chaos.py --seed 1 --duration 120 --json chaos.json
    .venv/bin/python bench/chaos.py --duration 8 --faults engine,llumlet      # the CI test's run

A request ends in exactly one of:
  completed      200, every token equal to the unfaulted output, finish "length", [DONE]
  failed-clean   its router process was killed while it ran, and what it got was a prefix of the output
  failed-other   an error in OpenAI's shape from a router that stayed up (must be 0)
  lost           anything else: a hang past --deadline, a wrong token, a stream cut short with no
                 error (must be 0)
Leaks, read once the load is over and the service idle (up to --idle-timeout): KV blocks held, running
or queued requests, migration reservations and incoming/outgoing migrations (the llumlets' loads),
the engines' own running/waiting gauges and KV usage, the migrations and bytes each engine holds in
its migration staging (the engine's own STAGING_HELD reports, on its llumlet's /metrics), the
routers' in-flight requests and queue, and processes left after shutdown (must all be 0).
Replacement: seconds from a kill to the control loop's new instance serving through every router.

Exit status 0 only when lost, failed-other and every leak are 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from bench_service import (
    RUNTIMES,
    BenchService,
    Expected,
    StreamResult,
    client_session,
    engine_gauges,
    engine_staging,
    migrate_busiest,
    migration_outcome,
    nice_self,
    raise_fd_limit,
    run_cleanly,
    sim_expected,
    stream_completion,
)
from bench_stats import percentile
from tqdm import tqdm

from llumnix.launch.pair import EnginePair
from llumnix.tiny_model import PRESETS, ensure_tiny_model

FAULT_KINDS = ("engine", "llumlet", "router", "migration-source", "migration-destination")
OUTCOMES = ("completed", "failed-clean", "failed-other", "lost")
STAGING_POLL_S = 0.002
# Long enough to be caught mid-stage: stages go on while blocks are left (always at least one), up to
# this many; then the final stage commits the migration.
SIM_VOCABULARY = 32000
TINY_VOCABULARY = 300
"""Token ids below this are in the tiny model's vocabulary (at least 300 entries)."""
LLUMLET_ARGS = ("--migration-max-stages", "16", "--migration-final-delta-blocks", "0")


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    choice: float
    """Seeded draw in [0, 1) that picks the victim and the process killed."""


def schedule(seed: int, kinds: list[str], duration_s: float, interval_s: float | None) -> list[Fault]:
    """The faults of one run: each kind once in a seeded order, then again while time is left, every
    `interval_s` (default: spread over the run), starting after one interval of clean load."""
    rng = random.Random(seed)
    order = rng.sample(kinds, len(kinds))
    gap = interval_s or duration_s / (len(order) + 1)
    count = max(len(order), int(duration_s / gap) - 1) if interval_s else len(order)
    return [Fault(round(gap * (i + 1), 3), order[i % len(order)], rng.random()) for i in range(count)]


@dataclass
class RequestRecord:
    index: int
    router: int
    outcome: str
    tokens_expected: int
    tokens_got: int
    ttft_s: float | None
    e2e_s: float | None
    detail: str = ""


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    target: str = ""
    process: str = ""
    migration: str = ""
    """Migration faults: where the migration was when the kill came and how it ended."""
    recovered_s: float | None = None
    """Kill to fully serving again (replacement READY in every router, or the router restarted)."""
    error: str = ""


@dataclass
class Run:
    args: argparse.Namespace
    service: BenchService
    started: float = field(default_factory=time.monotonic)
    records: list[RequestRecord] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    sending: bool = True
    sent: int = 0
    forced_migrations: Counter[str] = field(default_factory=Counter)
    migrating: asyncio.Lock = field(default_factory=asyncio.Lock)
    pool: list[tuple[list[int], int]] = field(default_factory=list)
    """vllm-cpu: the requests the clients send (sim: each one new)."""
    reference: dict[tuple[tuple[int, ...], int], Expected] = field(default_factory=dict)

    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.records)


def classify(result: StreamResult, expected: Expected, router_died: bool) -> tuple[str, str]:
    tokens = expected[0]
    if result.matches(expected):
        return "completed", ""
    if result.timed_out:
        return "lost", f"no end within the deadline after {len(result.tokens)} tokens"
    prefix = result.tokens == tokens[:len(result.tokens)]
    if router_died and prefix and result.error is None:
        return "failed-clean", result.transport_error or "stream ended with its router"
    if result.error is not None and prefix:
        return "failed-other", f"status {result.status}: {result.error}"
    if not prefix:
        first = next((i for i, (a, b) in enumerate(zip(result.tokens, tokens, strict=False)) if a != b),
                     len(tokens))
        return "lost", f"wrong tokens from index {first} ({len(result.tokens)} got, {len(tokens)} expected)"
    if result.complete():
        return "lost", "every token right but the text differs"
    return "lost", (f"cut short at {len(result.tokens)}/{len(tokens)} tokens without an error "
                    f"(status {result.status}, done {result.done}, finish {result.finish_reason}, "
                    f"{result.transport_error or 'no transport error'})")


def new_request(rng: random.Random, args: argparse.Namespace, vocabulary: int) -> tuple[list[int], int]:
    prompt = [rng.randrange(1, vocabulary) for _ in range(rng.randint(8, 64))]
    return prompt, rng.randint(args.min_tokens, args.max_tokens)


async def references(run: Run, session: aiohttp.ClientSession) -> None:
    """vllm-cpu: the pool of requests the clients draw from, each answered once before any fault (the
    unfaulted output: greedy, so every later answer must equal it)."""
    args, service = run.args, run.service
    rng = random.Random(f"{args.seed}-pool")
    pool = [new_request(rng, args, TINY_VOCABULARY) for _ in range(args.prompts)]
    slots = asyncio.Semaphore(args.concurrency)

    async def answer(prompt: list[int], max_tokens: int) -> None:
        async with slots:
            result = await stream_completion(session, service.routers[0].url, service.model, prompt,
                                             max_tokens, args.deadline)
        if not result.complete() or len(result.tokens) != max_tokens:
            raise RuntimeError(f"the unfaulted reference run failed: {result}")
        run.reference[(tuple(prompt), max_tokens)] = (result.tokens, result.text)

    await asyncio.gather(*(answer(*request) for request in pool))
    run.pool = pool


async def client(run: Run, session: aiohttp.ClientSession, index: int) -> None:
    """One closed-loop client: a request, checked, then the next, until the load stops."""
    args = run.args
    rng = random.Random(f"{args.seed}-client-{index}")
    routers = run.service.routers
    home = routers[index % len(routers)]
    while run.sending:
        # Like a Service: a dead replica gets no new connections while another one is up.
        router = home if home.alive else next((r for r in routers if r.alive), home)
        if run.pool:
            prompt, max_tokens = rng.choice(run.pool)
            expected = run.reference[(tuple(prompt), max_tokens)]
        else:
            prompt, max_tokens = new_request(rng, args, SIM_VOCABULARY)
            expected = sim_expected(prompt, max_tokens)
        generation = router.generation
        number = run.sent
        run.sent += 1
        result = await stream_completion(session, router.url, run.service.model, prompt, max_tokens,
                                         args.deadline)
        outcome, detail = classify(result, expected, router.generation != generation)
        run.records.append(RequestRecord(
            number, router.index, outcome, len(expected[0]), len(result.tokens),
            None if result.first_token is None else result.first_token - result.started,
            None if result.finished is None else result.finished - result.started, detail))


def _pick(pairs: dict[str, EnginePair], choice: float) -> tuple[str, EnginePair]:
    ids = sorted(pairs)
    instance_id = ids[int(choice * len(ids)) % len(ids)]
    return instance_id, pairs[instance_id]


def _kill(pair: EnginePair, process: str) -> None:
    if process == "engine":
        pair.kill_engine()
    else:
        pair.llumlet.signal(signal.SIGKILL)


async def _quiet_pair(service: BenchService) -> tuple[str, str] | None:
    """(source, destination) for a migration fault: the instance running most requests and the one
    running fewest, neither in a migration (a lease from an earlier fault may still hold one)."""
    loads = []
    for instance_id, pair in service.ready_pairs().items():
        with contextlib.suppress(grpc.aio.AioRpcError):
            load = await service.load(pair)
            if not (load.migrating_in or load.migrating_out or load.reserved_blocks):
                loads.append((len(load.running), instance_id))
    loads.sort(reverse=True)
    if len(loads) < 2 or loads[0][0] == 0:
        return None
    return loads[0][1], loads[-1][1]


async def _migration_fault(run: Run, fault: Fault, record: FaultRecord) -> None:
    """Start a migration from the busiest instance and kill its source or destination once the
    destination shows it staging (tries again while a request finishes first, up to --recovery-timeout)."""
    service = run.service
    kill_source = fault.kind == "migration-source"
    record.process = "engine" if fault.choice < 0.5 else "llumlet"
    deadline = time.monotonic() + run.args.recovery_timeout
    while time.monotonic() < deadline:
        chosen = await _quiet_pair(service)
        if chosen is None:
            await asyncio.sleep(0.2)
            continue
        source, destination = chosen
        destination_pair = service.backend.pair(destination)
        migration = asyncio.create_task(service.loop.migrate(None, source, destination))
        staging = False
        while not migration.done():
            with contextlib.suppress(grpc.aio.AioRpcError):
                load = await service.load(destination_pair)
                if load.migrating_in > 0 and load.reserved_blocks > 0:
                    staging = True
                    break
            await asyncio.sleep(STAGING_POLL_S)
        if not staging:
            record.migration += f"missed ({await migration_outcome(migration)}); "
            continue
        victim = source if kill_source else destination
        record.target = victim
        _kill(service.backend.pair(victim), record.process)
        record.migration += f"killed mid-stage: {await migration_outcome(migration)}"
        return
    record.error = "no migration could be caught mid-stage"


async def inject(run: Run, session: aiohttp.ClientSession, fault: Fault) -> FaultRecord:
    service = run.service
    record = FaultRecord(fault.kind, round(time.monotonic() - run.started, 2))
    killed = time.monotonic()
    if fault.kind in ("engine", "llumlet"):
        record.target, pair = _pick(service.ready_pairs(), fault.choice)
        record.process = fault.kind
        _kill(pair, fault.kind)
    elif fault.kind == "router":
        router = service.routers[int(fault.choice * len(service.routers)) % len(service.routers)]
        record.target, record.process = f"router-{router.index}", "router"
        router.kill()
        if router.process is not None:
            await router.process.terminate(0)  # reaps the killed process
        await router.start()  # the Deployment's new pod
    else:
        await _migration_fault(run, fault, record)
        killed = time.monotonic()
    if record.error:
        return record
    try:
        await asyncio.sleep(1.0)  # the control loop notices within a reconcile (0.5 s)
        await service.wait_serving(session, run.args.recovery_timeout)
        record.recovered_s = round(time.monotonic() - killed, 2)
    except TimeoutError as exc:
        record.error = str(exc)[:300]
    return record


async def faults(run: Run, session: aiohttp.ClientSession, plan: list[Fault]) -> None:
    for fault in plan:
        delay = run.started + fault.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        async with run.migrating:  # no forced migration overlaps a fault (its staging is the fault's)
            run.faults.append(await inject(run, session, fault))


async def forced_migrations(run: Run) -> None:
    """A migration every --migrate-every seconds (busiest to freest), so streams move under load."""
    while run.sending:
        await asyncio.sleep(run.args.migrate_every)
        async with run.migrating:
            outcome = await migrate_busiest(run.service.loop)
        if outcome is not None:
            run.forced_migrations[outcome.split(" (", 1)[0]] += 1


async def idle_state(service: BenchService, session: aiohttp.ClientSession, timeout_s: float
                     ) -> list[dict[str, Any]]:
    """Per instance and router, what is still held once the load is over; polled until everything is 0
    or `timeout_s` passes (aborts of killed requests take a moment to reach the engines)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows: list[dict[str, Any]] = []
        for instance_id, pair in sorted(service.ready_pairs().items()):
            load = await service.load(pair)
            gauges = await engine_gauges(session, pair.engine_url)
            staging = await engine_staging(session, pair)
            rows.append({
                "instance": instance_id,
                "blocks_held": load.total_blocks - load.free_blocks,
                "running": len(load.running), "waiting": len(load.waiting),
                "reserved_blocks": load.reserved_blocks,
                "migrating_in": load.migrating_in, "migrating_out": load.migrating_out,
                "engine_running": int(gauges.get("num_requests_running", -1)),
                "engine_waiting": int(gauges.get("num_requests_waiting", -1)),
                "engine_kv_usage": gauges.get("kv_cache_usage_perc", -1.0),
                # -1: the engine has not reported its staging (counts as a leak).
                "engine_staged_migrations": int(staging.get("staged_migrations", -1)),
                "engine_staging_bytes": int(staging.get("staging_bytes", -1)),
            })
        for router in service.routers:
            health = await router.health(session) or {}
            rows.append({"instance": f"router-{router.index}", "in_flight": health.get("in_flight", -1),
                         "queue_length": health.get("queue_length", -1)})
        if sum(leaked(row) for row in rows) == 0 or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.5)


def leaked(row: dict[str, Any]) -> float:
    return sum(abs(value) for key, value in row.items() if key != "instance")


def processes_left(service: BenchService) -> list[int]:
    """Engines, llumlets and routers of this run still alive after shutdown: their command lines name
    the instances' directory (snapshot sockets) or the run's manifest."""
    marks = (str(service.backend.work_dir).encode(), str(service.manifest).encode())
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes()
                if any(mark in cmdline for mark in marks):
                    found.append(int(proc.name))
    return found


async def progress(run: Run) -> None:
    with tqdm(total=int(run.args.duration), desc="chaos", unit="s", file=sys.stderr,
              disable=run.args.quiet) as bar:
        while run.sending:
            await asyncio.sleep(0.5)
            bar.n = min(int(time.monotonic() - run.started), bar.total)
            counts = run.counts()
            bar.set_postfix_str(f"sent {run.sent} ok {counts['completed']} clean {counts['failed-clean']} "
                                f"other {counts['failed-other']} lost {counts['lost']} "
                                f"faults {len(run.faults)}")


async def chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    plan = schedule(args.seed, args.faults, args.duration, args.fault_interval)
    if args.runtime == "sim":
        model_dir = None
        engine_args = ["--time-scale", str(args.time_scale), "--num-blocks", str(args.num_blocks),
                       "--max-model-len", "2048"]
    else:
        print(f"building the tiny model under {args.model_cache} (once)...", file=sys.stderr, flush=True)
        engine_args, model_dir = [], ensure_tiny_model(args.model_cache, PRESETS["test"])
    service = BenchService(work, name="chaos", instances=args.instances, routers=args.routers,
                           engine_args=engine_args, runtime=args.runtime, model_dir=model_dir,
                           llumlet_args=LLUMLET_ARGS)
    async with client_session() as session:
        try:
            print(f"starting {args.instances} {args.runtime} instances and {args.routers} routers "
                  f"(logs under {work})", file=sys.stderr, flush=True)
            await service.start(session, max(300.0, args.recovery_timeout))
            run = Run(args, service)
            if args.runtime != "sim":
                await references(run, session)
                run.started = time.monotonic()  # the schedule runs from here
            tasks = [asyncio.create_task(client(run, session, i)) for i in range(args.concurrency)]
            helpers = [asyncio.create_task(faults(run, session, plan)),
                       asyncio.create_task(progress(run))]
            if args.migrate_every:
                helpers.append(asyncio.create_task(forced_migrations(run)))
            # The load runs for --duration, and on until every scheduled fault has run and recovered.
            await asyncio.sleep(args.duration)
            await helpers[0]
            run.sending = False
            await asyncio.gather(*tasks)
            for helper in helpers[1:]:
                helper.cancel()
            await asyncio.gather(*helpers[1:], return_exceptions=True)
            await service.wait_serving(session, args.recovery_timeout)
            idle = await idle_state(service, session, args.idle_timeout)
        finally:
            await service.close()
    left = processes_left(service)
    return report(run, plan, idle, left)


def report(run: Run, plan: list[Fault], idle: list[dict[str, Any]], left: list[int]) -> dict[str, Any]:
    counts = run.counts()
    ttfts = [r.ttft_s for r in run.records if r.outcome == "completed" and r.ttft_s is not None]
    recovered = {kind: [f.recovered_s for f in run.faults if f.kind == kind and f.recovered_s is not None]
                 for kind in FAULT_KINDS}
    instance_kills = [s for kind in FAULT_KINDS if kind != "router" for s in recovered[kind]]
    return {
        "config": {k: v for k, v in vars(run.args).items() if k != "json" and k != "work_dir"},
        "schedule": [asdict(f) for f in plan],
        "requests": {"sent": len(run.records), **{o: counts[o] for o in OUTCOMES}},
        "tokens_checked": sum(r.tokens_got for r in run.records if r.outcome == "completed"),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "faults": [asdict(f) for f in run.faults],
        "replacement_s": {"instances_p50": percentile(instance_kills, 0.5),
                          "instances_max": max(instance_kills, default=float("nan")),
                          "router_restart_max": max(recovered["router"], default=float("nan"))},
        "forced_migrations": dict(run.forced_migrations),
        "control_events": dict(Counter(e.reason for _, e in run.service.events)),
        "idle": idle,
        "leaks": {"total": sum(leaked(row) for row in idle), "processes_left": len(left),
                  "staging": {"migrations": sum(row.get("engine_staged_migrations", 0) for row in idle),
                              "bytes": sum(row.get("engine_staging_bytes", 0) for row in idle)}},
        "not_completed": [asdict(r) for r in run.records if r.outcome != "completed"][:50],
    }


def print_summary(result: dict[str, Any]) -> None:
    requests = result["requests"]
    print("\nrequests")
    for key in ("sent", *OUTCOMES):
        print(f"  {key:<14}{requests[key]:>8}")
    print(f"  tokens checked {result['tokens_checked']}, TTFT p50 {result['ttft_p50_s']:.3f} s "
          f"p99 {result['ttft_p99_s']:.3f} s")
    print("faults")
    print(f"  {'at s':>7}  {'kind':<22}{'target':<14}{'process':<9}{'recovered s':>12}  migration / error")
    for f in result["faults"]:
        recovered = "-" if f["recovered_s"] is None else f"{f['recovered_s']:.2f}"
        print(f"  {f['at_s']:>7.1f}  {f['kind']:<22}{f['target']:<14}{f['process']:<9}{recovered:>12}  "
              f"{f['migration']}{f['error']}")
    replacement = result["replacement_s"]
    print(f"time to replace a killed instance: p50 {replacement['instances_p50']:.2f} s, max "
          f"{replacement['instances_max']:.2f} s; router restart max "
          f"{replacement['router_restart_max']:.2f} s")
    print(f"forced migrations: {result['forced_migrations'] or 'none'}")
    print(f"control loop events: {result['control_events']}")
    leaks = result["leaks"]
    print(f"leaks once idle: {leaks['total']:g} (blocks, requests, reservations, migrations, engine "
          f"staging, router in-flight/queue); processes left after shutdown: {leaks['processes_left']}")
    staging = leaks["staging"]
    print(f"engine staging once idle: {staging['migrations']} migrations, {staging['bytes']} bytes "
          f"(-1 per engine that did not report it)")
    for row in result["idle"]:
        if leaked(row):
            print(f"  {row}")
    for r in result["not_completed"][:10]:
        print(f"  request {r['index']} via router-{r['router']}: {r['outcome']}: {r['detail']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1,
                        help="schedule, victims and prompts (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of load at least; it goes on until every fault has run (default: "
                        "%(default)s)")
    parser.add_argument("--faults", type=lambda s: [k for k in s.split(",") if k], default=list(FAULT_KINDS),
                        help="fault kinds, comma-separated, each at least once (default: "
                        f"{','.join(FAULT_KINDS)})")
    parser.add_argument("--fault-interval", type=float,
                        help="seconds between faults, repeating the kinds (default: each kind once, spread)")
    parser.add_argument("--instances", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--routers", type=int, default=2, help="router processes (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="closed-loop clients, spread over the routers (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    parser.add_argument("--runtime", choices=RUNTIMES, default="sim",
                        help="sim engines, or CPU vLLM serving the tiny random model (default: %(default)s)")
    parser.add_argument("--model-cache", type=Path, default=Path(".cache/models"),
                        help="vllm-cpu: where the tiny model is built (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=24,
                        help="vllm-cpu: distinct requests, each answered once before the faults as the "
                        "reference (default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="sim engines' speed-up over the latency profile (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=2000,
                        help="KV blocks per engine (default: %(default)s)")
    parser.add_argument("--migrate-every", type=float, default=2.0,
                        help="seconds between forced migrations, 0: none (default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="a request not ended after this many seconds is lost (default: %(default)s)")
    parser.add_argument("--recovery-timeout", type=float, default=120.0, help="default: %(default)s")
    parser.add_argument("--idle-timeout", type=float, default=30.0,
                        help="how long the idle service may take to release everything (default: "
                        "%(default)s)")
    parser.add_argument("--nice", type=int, default=10,
                        help="niceness of the whole run (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--work-dir", type=Path, help="logs (default: a temporary directory, removed)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    unknown = set(args.faults) - set(FAULT_KINDS)
    if unknown or not args.faults:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(FAULT_KINDS)}")
    if len(set(args.faults) & {"migration-source", "migration-destination"}) and args.instances < 2:
        parser.error("migration faults need at least 2 instances")
    nice_self(args.nice)
    raise_fd_limit()
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-")))
        result = run_cleanly(chaos(args, work.resolve()))
    print_summary(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    requests = result["requests"]
    ok = requests["lost"] == 0 and requests["failed-other"] == 0 and result["leaks"]["total"] == 0 \
        and result["leaks"]["processes_left"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
