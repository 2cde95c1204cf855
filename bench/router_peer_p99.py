"""P99 time to first token of a bursty trace through the llumnix router and through the peer router
(vllm-router, each of its load-balancing policies), over the same sim-engine instances, at several
loads; prints the ratio of the peer's best P99 to llumnix's (the target: at least 2x, at no worse mean).

    .venv/bin/python bench/router_peer_p99.py                   # 8 instances, 3 loads, 2 repeats
    .venv/bin/python bench/router_peer_p99.py --rates 10 --requests 12 --repeats 1    # a smoke run
    .venv/bin/python bench/router_peer_p99.py --json out.json --plot out.png

One local service (`llumnix.up.LocalService`: N sim engine + llumlet pairs of 64 KV blocks, the
control loop, the service's router with dispatch policy llumnix) serves every path:

  llumnix             the service's router (client -> router -> llumlet gRPC `Serve` -> engine),
                      migration off
  llumnix+migration   the same router with the control loop's migration pass switched on for the
                      run (`spec.migration.enabled`; off again before the next path runs)
  vllm-router:POLICY  a fresh vllm-router per run with --policy power_of_two, cache_aware or
                      round_robin and --worker-urls the llumlets' HTTP fronts (client -> vllm-router
                      -> llumlet HTTP -> engine): both kinds of path cross the same llumlet

Every llumlet requires the service token: the client sends it as `Authorization: Bearer` to
vllm-router, which forwards the header to the worker (its --api-key is not sent on plain requests).

Each load (--rates, requests per second) replays the same trace (`llumnix.traces.generate_trace`:
--trace lengths capped at --max-total-tokens, Gamma arrivals with --cv) through every path, in an
order that rotates with the load and reverses between repeats. The client is `llumnix.bench`'s
streaming client in its own process (this script re-run with a hidden --client), writing every
request's arrival, first token and finish. Meanwhile this process samples every instance's latest
load (free KV blocks, running, waiting) and the llumnix router's queue every --sample-interval.

Per load it prints one row per path, pooled over the repeats: requests ok / errors, TTFT mean / P50
/ P99 (and each repeat's P99), e2e mean, the slow requests (TTFT over --slow-ttft) and how many of
them waited mostly while another instance had no queue and room for them ("room elsewhere": the
request was placed badly rather than the fleet being full), committed migrations and the machine's
CPU use during the run. Then the ratios: the peer's best P99 over llumnix's P99 and the peer's best
mean TTFT over llumnix's mean (>= 2 and >= 1 meet the target). --json writes all of it with every
request; --plot draws P99 TTFT against load, one line per path.

The defaults keep KV memory, not the 2-core machine, the bottleneck (see
bench/router_policies_p99.py): L-S lengths capped at 600 tokens, so two or three long requests
fill an instance; 8 sim engines at 1.25x the profile's speed leave the 2 cores more than half idle
(the CPU column says so per run). A run lasts as long as the trace's long outputs, 16-23 s whatever
--requests (up to about 15 s of arrivals), so the defaults (3 loads x 5 paths x 2 repeats of 60
requests) take about 11 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from router_peer import start_service
from router_policies_p99 import manifest, wait_until

from llumnix.bench import BenchConfig, BenchResult, RequestResult, run_bench
from llumnix.launch.pair import free_port
from llumnix.load import InstanceLoad
from llumnix.service_spec import ServiceSettings
from llumnix.traces import TraceRequest, generate_trace
from llumnix.up import LocalService

LLUMNIX = "llumnix"
LLUMNIX_MIGRATION = "llumnix+migration"
PEER_POLICIES = ("power_of_two", "cache_aware", "round_robin")
PEER_PREFIX = "vllm-router:"
MODEL = "sim"
BLOCK_SIZE = 16
"""The manifest's (router_policies_p99.manifest): tokens per KV block."""
API_KEY_ENV = "ROUTER_PEER_P99_API_KEY"
"""The client's bearer token travels in its environment, never on its command line."""
P99_TARGET = 2.0


# ---- what one run records -----------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceSample:
    free_blocks: int
    running: int
    waiting: int


@dataclass(frozen=True)
class FleetSample:
    """Every instance's latest load (as its llumlet reported it) and the llumnix router's queue."""

    time: float
    """time.monotonic(), the clock the client stamps its requests with (the same across processes)."""
    router_queue: int
    instances: tuple[InstanceSample, ...]


@dataclass
class Run:
    path: str
    rate: float
    repeat: int
    results: list[RequestResult]
    duration_s: float
    samples: list[FleetSample] = field(default_factory=list)
    migrations: int = 0
    cpu_percent: float = 0.0


@dataclass(frozen=True)
class TailReport:
    slow: int
    """Requests whose TTFT exceeded the threshold."""
    slow_with_room: int
    """Of those, the ones that waited over half their TTFT while another instance had no queue and
    free blocks for their prompt."""
    router_held_share: float
    """Of the slow requests' waiting time, the share during which the llumnix router held requests."""


@dataclass(frozen=True)
class PathRow:
    path: str
    rate: float
    summary: dict[str, float | int]
    p99_per_repeat: tuple[float, ...]
    tail: TailReport
    migrations: int
    cpu_percent: float


@dataclass(frozen=True)
class Comparison:
    rate: float
    llumnix_path: str
    peer_best_p99_path: str
    p99_ratio: float
    """The peer's best P99 TTFT over llumnix's (>= P99_TARGET meets the target)."""
    peer_best_mean_path: str
    mean_ratio: float
    """The peer's best mean TTFT over llumnix's (>= 1: llumnix's mean is no worse)."""

    @property
    def met(self) -> bool:
        return self.p99_ratio >= P99_TARGET and self.mean_ratio >= 1.0


# ---- pure parts: order, tail analysis, pooling, ratios, tables ----------------------------------


def path_names(migration: bool = True) -> list[str]:
    return [LLUMNIX, *([LLUMNIX_MIGRATION] if migration else []), *(PEER_PREFIX + p for p in PEER_POLICIES)]


def run_order(paths: Sequence[str], load_index: int, repeat: int) -> list[str]:
    """Rotated by the load, reversed on odd repeats: no path always runs first or right after
    another one's tail."""
    shift = load_index % len(paths)
    order = list(paths[shift:]) + list(paths[:shift])
    return order[::-1] if repeat % 2 else order


def blocks_for(prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks an engine needs free to start a prompt (its tokens plus the first output token)."""
    return math.ceil((prompt_tokens + 1) / block_size)


def has_room_elsewhere(sample: FleetSample, blocks: int) -> bool:
    """Some instance had no queue and `blocks` free blocks: a request needing them would start there."""
    return any(i.waiting == 0 and i.free_blocks >= blocks for i in sample.instances)


def window(samples: Sequence[FleetSample], start: float, end: float) -> list[FleetSample]:
    return [s for s in samples if start <= s.time <= end]


def tail_report(results: Sequence[RequestResult], prompts: dict[int, int], samples: Sequence[FleetSample],
                slow_ttft_s: float) -> TailReport:
    """How the slow requests (TTFT above `slow_ttft_s`) spent their wait: with a place to go elsewhere
    (misplaced) or with the fleet full; and how much of it the llumnix router held requests."""
    slow = [r for r in results if r.error is None and r.first_token is not None and r.ttft > slow_ttft_s]
    with_room = 0
    held = total = 0
    for request in slow:
        seen = window(samples, request.arrival, request.first_token or request.arrival)
        if not seen:
            continue
        blocks = blocks_for(prompts[request.request_id])
        if sum(has_room_elsewhere(s, blocks) for s in seen) > len(seen) / 2:
            with_room += 1
        held += sum(s.router_queue > 0 for s in seen)
        total += len(seen)
    return TailReport(len(slow), with_room, held / total if total else 0.0)


def pooled_row(runs: Sequence[Run], prompts: dict[int, int], slow_ttft_s: float) -> PathRow:
    """One path at one load, its repeats' requests pooled (the same trace each time)."""
    results = [r for run in runs for r in run.results]
    summary = BenchResult(results, sum(run.duration_s for run in runs)).summary()
    tails = [tail_report(run.results, prompts, run.samples, slow_ttft_s) for run in runs]
    held = [t.router_held_share for t in tails if t.slow]
    tail = TailReport(sum(t.slow for t in tails), sum(t.slow_with_room for t in tails),
                      statistics.fmean(held) if held else 0.0)
    p99s = tuple(float(BenchResult(run.results, run.duration_s).summary()["prefill_p99"]) for run in runs)
    return PathRow(runs[0].path, runs[0].rate, summary, p99s, tail, sum(run.migrations for run in runs),
                   statistics.fmean(run.cpu_percent for run in runs))


def compare(rows: Sequence[PathRow], llumnix_path: str) -> Comparison | None:
    """`llumnix_path` against the peer's best policy at the same load (None: a side is missing)."""
    mine = next((r for r in rows if r.path == llumnix_path and r.summary["finished"]), None)
    peers = [r for r in rows if r.path.startswith(PEER_PREFIX) and r.summary["finished"]]
    if mine is None or not peers:
        return None
    best_p99 = min(peers, key=lambda r: float(r.summary["prefill_p99"]))
    best_mean = min(peers, key=lambda r: float(r.summary["prefill_mean"]))
    return Comparison(mine.rate, llumnix_path, best_p99.path, ratio(best_p99, mine, "prefill_p99"),
                      best_mean.path, ratio(best_mean, mine, "prefill_mean"))


def ratio(peer: PathRow, mine: PathRow, key: str) -> float:
    return float(peer.summary[key]) / max(float(mine.summary[key]), 1e-9)


def format_rows(rows: Sequence[PathRow], slow_ttft_s: float) -> str:
    lines = [f"| path | ok / errors | TTFT mean s | P50 s | P99 s | P99 per repeat s | e2e mean s | "
             f"slow (> {slow_ttft_s:g} s) / room elsewhere | migrations | CPU % |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        s = row.summary
        repeats = " / ".join(f"{p:.2f}" for p in row.p99_per_repeat)
        lines.append(f"| {row.path} | {s['finished']} / {s['errors']} | {s['prefill_mean']:.3f} | "
                     f"{s['prefill_p50']:.3f} | **{s['prefill_p99']:.3f}** | {repeats} | "
                     f"{s['e2e_mean']:.2f} | {row.tail.slow} / {row.tail.slow_with_room} | "
                     f"{row.migrations} | {row.cpu_percent:.0f} |")
    return "\n".join(lines)


def format_comparison(comparison: Comparison) -> str:
    verdict = "meets the target" if comparison.met else "does not meet the target"
    return (f"{comparison.llumnix_path}: P99 ratio {comparison.p99_ratio:.2f}x against "
            f"{comparison.peer_best_p99_path} (target >= {P99_TARGET:g}x), mean ratio "
            f"{comparison.mean_ratio:.2f}x against {comparison.peer_best_mean_path} (>= 1: no worse) — "
            f"{verdict}")


# ---- the client process -------------------------------------------------------------------------


def make_trace(args: argparse.Namespace, rate: float) -> list[TraceRequest]:
    return generate_trace(args.trace, args.requests, rate, args.cv, args.seed, 0.0, args.max_total_tokens)


def client_main(spec_path: Path, out_path: Path) -> None:
    """Replay the trace `spec_path` describes against its URL; write every request's times."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    trace = make_trace(argparse.Namespace(**spec["trace"]), spec["rate"])
    config = BenchConfig(url=spec["url"], model=MODEL, api_key=os.environ.get(API_KEY_ENV) or None,
                         show_progress=False)
    result = asyncio.run(run_bench(config, trace))
    out_path.write_text(json.dumps({"duration_s": result.duration_s,
                                    "results": [dataclasses.asdict(r) for r in result.results]}),
                        encoding="utf-8")


async def run_client(url: str, rate: float, args: argparse.Namespace, work: Path, tag: str,
                     api_key: str | None) -> tuple[list[RequestResult], float]:
    spec, out, log = work / f"{tag}.spec.json", work / f"{tag}.json", work / f"{tag}.client.log"
    trace_args = {k: getattr(args, k) for k in ("trace", "requests", "cv", "seed", "max_total_tokens")}
    spec.write_text(json.dumps({"url": url, "rate": rate, "trace": trace_args}), encoding="utf-8")
    env = {**os.environ, **({API_KEY_ENV: api_key} if api_key else {})}
    with log.open("wb") as log_file:
        client = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--client", str(spec), str(out),
            env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT)
        code = await client.wait()
    if code != 0:
        raise RuntimeError(f"the client against {url} failed ({code}):\n{log.read_text()[-3000:]}")
    data = json.loads(out.read_text(encoding="utf-8"))
    return [RequestResult(**r) for r in data["results"]], float(data["duration_s"])


# ---- the service and the paths ------------------------------------------------------------------


def sample_fleet(service: LocalService) -> FleetSample:
    loads: list[InstanceLoad] = [i.report.load for i in sorted(service.router.instances.all(),
                                                               key=lambda i: i.address)
                                 if i.report is not None]
    return FleetSample(time.monotonic(), len(service.router.queue),
                       tuple(InstanceSample(load.free_blocks, len(load.running), len(load.waiting))
                             for load in loads))


async def sample_until(service: LocalService, samples: list[FleetSample], interval_s: float,
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(sample_fleet(service))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def with_migration(settings: ServiceSettings, enabled: bool) -> ServiceSettings:
    spec = settings.spec
    return dataclasses.replace(settings, spec=dataclasses.replace(
        spec, migration=dataclasses.replace(spec.migration, enabled=enabled)))


def committed_migrations(service: LocalService) -> int:
    return int(service.loop.migration_outcomes.get("committed", 0))


async def wait_all_idle(service: LocalService, instances: int) -> None:
    """Every instance serving through the router with nothing in flight (the previous run's tail and
    any migration done)."""
    await wait_until(lambda: len(service.router.instances.dispatchable()) == instances, 60)
    await wait_until(lambda: all(i.is_idle() for i in service.router.instances.dispatchable()), 180)


async def run_path(service: LocalService, path: str, rate: float, repeat: int, worker_urls: list[str],
                   args: argparse.Namespace, work: Path) -> Run:
    await wait_all_idle(service, args.instances)
    tag = f"{path.replace(':', '-').replace('+', '-')}-r{rate:g}-{repeat}"
    peer = None
    url, api_key = service.router.url, None
    if path.startswith(PEER_PREFIX):
        port = free_port()
        peer = await start_service(f"vllm-router {tag}", [
            args.peer_binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", path.removeprefix(PEER_PREFIX), "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())], port, work)
        url, api_key = f"http://127.0.0.1:{port}", service.token.value
    if path == LLUMNIX_MIGRATION:
        service.loop.update_settings(with_migration(service.settings, True))
    migrations_before = committed_migrations(service)
    samples: list[FleetSample] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_until(service, samples, args.sample_interval, stop))
    psutil.cpu_percent(None)
    try:
        results, duration = await run_client(url, rate, args, work, tag, api_key)
    finally:
        cpu = psutil.cpu_percent(None)
        stop.set()
        await sampler
        service.loop.update_settings(with_migration(service.settings, False))
        if peer is not None:
            await peer.terminate()
    migrations = committed_migrations(service) - migrations_before
    run = Run(path, rate, repeat, results, duration, samples, migrations, cpu)
    summary = BenchResult(results, duration).summary()
    print(f"  rate {rate:g} repeat {repeat} {path:<26} TTFT mean {summary['prefill_mean']:.3f} s "
          f"P99 {summary['prefill_p99']:.3f} s  errors {summary['errors']}  CPU {cpu:.0f}%", flush=True)
    return run


async def llumlet_urls(service: LocalService) -> list[str]:
    infos = await service.backend.list_instances()
    return [service.backend.pair(info.instance_id).llumlet.http_url for info in infos if info.address]


async def bench(args: argparse.Namespace, work: Path) -> list[Run]:
    # SIGTERM cancels the run, so that the service's processes and a peer router are stopped too.
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    service_file = work / "service.yaml"
    service_file.write_text(yaml.safe_dump(manifest(args.instances, args.time_scale)), encoding="utf-8")
    service = LocalService(str(service_file), work / "service", None, port=0, dispatch_policy=LLUMNIX,
                           on_event=lambda _: None)
    paths = [p for p in path_names(not args.no_migration) if p in args.paths]
    runs: list[Run] = []
    await service.start()
    try:
        if not await asyncio.wait_for(service.wait_serving(asyncio.Event()), 300):
            raise RuntimeError(f"the service did not come up; logs under {work / 'service'}")
        worker_urls = await llumlet_urls(service)
        for load_index, rate in enumerate(args.rates):
            for repeat in range(args.repeats):
                for path in run_order(paths, load_index, repeat):
                    runs.append(await run_path(service, path, rate, repeat, worker_urls, args, work))
            report_load(runs, rate, args)
    finally:
        await service.shutdown()
    return runs


# ---- reports ------------------------------------------------------------------------------------


def rows_at(runs: Sequence[Run], rate: float, args: argparse.Namespace) -> list[PathRow]:
    prompts = {r.request_id: r.prompt_tokens for r in make_trace(args, rate)}
    paths = list(dict.fromkeys(run.path for run in runs if run.rate == rate))
    ordered = [p for p in path_names() if p in paths]
    return [pooled_row([run for run in runs if run.rate == rate and run.path == p], prompts, args.slow_ttft)
            for p in ordered]


def report_load(runs: Sequence[Run], rate: float, args: argparse.Namespace) -> None:
    rows = rows_at(runs, rate, args)
    print(f"\n{args.trace}, CV {args.cv:g}, {rate:g} requests/s, {args.requests} requests x {args.repeats} "
          f"repeats, {args.instances} instances of 64 KV blocks, time scale {args.time_scale:g}\n")
    print(format_rows(rows, args.slow_ttft))
    for llumnix_path in (LLUMNIX, LLUMNIX_MIGRATION):
        comparison = compare(rows, llumnix_path)
        if comparison is not None:
            print(format_comparison(comparison))
    print(flush=True)


def write_json(runs: Sequence[Run], args: argparse.Namespace, path: Path) -> None:
    loads: list[dict[str, Any]] = []
    for rate in args.rates:
        rows = rows_at(runs, rate, args)
        comparisons = [c for c in (compare(rows, p) for p in (LLUMNIX, LLUMNIX_MIGRATION)) if c is not None]
        loads.append({"rate": rate, "rows": [dataclasses.asdict(r) for r in rows],
                      "comparisons": [{**dataclasses.asdict(c), "met": c.met} for c in comparisons]})
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "client")},
        "loads": loads,
        "runs": [{"path": run.path, "rate": run.rate, "repeat": run.repeat, "duration_s": run.duration_s,
                  "migrations": run.migrations, "cpu_percent": run.cpu_percent,
                  "requests": [dataclasses.asdict(r) for r in run.results],
                  # [time, router queue, [[free blocks, running, waiting] per instance]]
                  "samples": [[s.time, s.router_queue, [dataclasses.astuple(i) for i in s.instances]]
                              for s in run.samples]} for run in runs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def plot(runs: Sequence[Run], args: argparse.Namespace, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_path: dict[str, list[tuple[float, float]]] = {}
    for rate in args.rates:
        for row in rows_at(runs, rate, args):
            by_path.setdefault(row.path, []).append((rate, float(row.summary["prefill_p99"])))
    fig, axis = plt.subplots(figsize=(6.5, 4))
    for name, points in by_path.items():
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name,
                  linewidth=2.5 if not name.startswith(PEER_PREFIX) else 1.5)
    axis.set_xlabel("load (requests/s)")
    axis.set_ylabel("P99 TTFT (s)")
    axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title(f"{args.instances} sim instances, {args.trace} CV {args.cv:g}, {args.requests} requests "
                   f"x {args.repeats}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[5.0, 10.0, 20.0],
                        help="comma-separated loads in requests per second, light to heavy "
                        "(default: 5,10,20)")
    parser.add_argument("--requests", type=int, default=60, help="requests per run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per path and load, pooled (default: %(default)s)")
    parser.add_argument("--trace", default="L-S", help="length distribution (see llumnix bench --help)")
    parser.add_argument("--cv", type=float, default=3.0, help="arrival burstiness; 1 = Poisson")
    parser.add_argument("--max-total-tokens", type=int, default=600,
                        help="cap of prompt + output tokens (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=1.25,
                        help="sim engine speed against the profile's real time (default: %(default)s)")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=path_names(),
                        help=f"comma-separated subset of {','.join(path_names())} (default: all)")
    parser.add_argument("--no-migration", action="store_true", help=f"leave {LLUMNIX_MIGRATION} out")
    parser.add_argument("--slow-ttft", type=float, default=0.5, metavar="S",
                        help="a request whose TTFT exceeds S seconds counts as slow (default: %(default)s)")
    parser.add_argument("--sample-interval", type=float, default=0.1, metavar="S",
                        help="how often the instances' loads are sampled (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the rows, the ratios and every request here")
    parser.add_argument("--plot", type=Path, help="write a PNG of P99 TTFT against load here")
    parser.add_argument("--client", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.paths) - set(path_names())
    if unknown:
        parser.error(f"unknown paths {', '.join(sorted(unknown))}; choose from {', '.join(path_names())}")
    args.peer_binary = (shutil.which("vllm-router", path=str(Path(sys.executable).parent))
                        or shutil.which("vllm-router"))
    peers = any(p.startswith(PEER_PREFIX) for p in args.paths)
    if args.client is None and args.peer_binary is None and peers:
        parser.error("vllm-router is not installed (pip install '.[bench]')")
    return args


def main() -> None:
    args = parse_args()
    if args.client is not None:
        client_main(*args.client)
        return
    with tempfile.TemporaryDirectory(prefix="router-peer-p99-") as tmp:
        runs = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        write_json(runs, args, args.json)
    if args.plot:
        plot(runs, args, args.plot)


if __name__ == "__main__":
    main()
