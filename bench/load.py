"""Load: many concurrent streams through one router, and a bounded soak, over sim engines (the
product's router process, llumlets and control loop; bench/sim_service.py).

    .venv/bin/python bench/load.py streams --streams 1000 --json streams.json
    .venv/bin/python bench/load.py soak --duration 600 --json soak.json

streams: N greedy streaming completions started at once through one router; every token is checked
against the sim engine's own output. Figures: errors (anything but the exact output: must be 0), the
router's peak in-flight requests (that they were concurrent), TTFT p50/p99, end-to-end p50/p99, tokens/s,
router RSS before and at the peak.

soak: a steady closed-loop load (--concurrency streams) for --duration seconds, with a migration through
the control loop every --migrate-every seconds; the RSS of the router and of every llumlet is sampled
every --sample-every seconds. Growth = last samples over the first samples after --warmup, per process
(the mean of --window samples at each end): must be under 10%. Errors must be 0.

Exit status 0 only when the run's figures meet those bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from bench_service import (
    BenchService,
    Expected,
    StreamResult,
    client_session,
    migrate_busiest,
    nice_self,
    raise_fd_limit,
    rss_mib,
    run_cleanly,
    sim_expected,
    stream_completion,
)
from bench_stats import percentile
from tqdm import tqdm

GROWTH_LIMIT = 0.10


@dataclass
class Tally:
    """Outcomes of the requests of a run."""

    results: list[StreamResult] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, result: StreamResult, expected: Expected) -> None:
        self.results.append(result)
        if result.matches(expected):
            return
        kind = ("timeout" if result.timed_out else "transport" if result.transport_error else
                f"status {result.status}" if result.status != 200 else "error event" if result.error else
                "wrong or short output")
        self.errors[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {result.error or result.transport_error or ''} "
                                 f"({len(result.tokens)}/{len(expected[0])} tokens)")

    def figures(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.first_token is not None and r.finished is not None]
        ttft = [r.first_token - r.started for r in ok if r.first_token is not None]
        e2e = [r.finished - r.started for r in ok if r.finished is not None]
        return {"requests": len(self.results), "errors": sum(self.errors.values()),
                "errors_by_kind": dict(self.errors), "error_examples": self.examples,
                "tokens": sum(len(r.tokens) for r in self.results),
                "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
                "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99)}


def engine_args(args: argparse.Namespace) -> list[str]:
    return ["--time-scale", str(args.time_scale), "--num-blocks", str(args.num_blocks),
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048"]


def request(rng: random.Random, args: argparse.Namespace) -> tuple[list[int], int, Expected]:
    prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(16, 64))]
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    return prompt, max_tokens, sim_expected(prompt, max_tokens)


async def watch_router(service: BenchService, session: aiohttp.ClientSession, stop: asyncio.Event,
                       peak: dict[str, float]) -> None:
    """The router's in-flight requests and RSS, at their highest while `stop` is unset."""
    router = service.routers[0]
    while not stop.is_set():
        health = await router.health(session) or {}
        peak["in_flight"] = max(peak.get("in_flight", 0), health.get("in_flight", 0))
        rss = rss_mib(router.process.pid if router.process else None) or 0.0
        peak["rss_mib"] = max(peak.get("rss_mib", 0.0), rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def streams(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    service = BenchService(work, name="load", instances=args.instances, routers=1,
                         engine_args=engine_args(args))
    tally = Tally()
    async with client_session() as session:
        try:
            await service.start(session)
            router = service.routers[0]
            idle_rss = rss_mib(router.process.pid if router.process else None)
            rng = random.Random(args.seed)
            work_items = [request(rng, args) for _ in range(args.streams)]
            stop, peak = asyncio.Event(), {}
            watcher = asyncio.create_task(watch_router(service, session, stop, peak))
            bar = tqdm(total=args.streams, desc="streams", unit="req", file=sys.stderr, disable=args.quiet)

            async def one(prompt: list[int], max_tokens: int, expected: Expected) -> None:
                result = await stream_completion(session, router.url, service.model, prompt, max_tokens,
                                                 args.deadline)
                tally.add(result, expected)
                bar.update()

            started = time.monotonic()
            await asyncio.gather(*(one(*item) for item in work_items))
            elapsed = time.monotonic() - started
            stop.set()
            await watcher
            bar.close()
        finally:
            await service.close()
    figures = tally.figures()
    return {"mode": "streams", "config": _config(args), **figures, "elapsed_s": elapsed,
            "tokens_per_s": figures["tokens"] / elapsed, "router_peak_in_flight": peak.get("in_flight"),
            "router_rss_idle_mib": idle_rss, "router_rss_peak_mib": peak.get("rss_mib"),
            "ok": figures["errors"] == 0 and figures["requests"] == args.streams}


@dataclass
class Sample:
    at_s: float
    rss_mib: dict[str, float]
    requests: int


def growth(samples: list[Sample], warmup_s: float, window: int) -> dict[str, dict[str, float]]:
    """Per process: mean RSS of the first `window` samples after warm-up, of the last `window`, and the
    relative growth between them."""
    steady = [s for s in samples if s.at_s >= warmup_s]
    if len(steady) < 2 * window:
        return {}
    names = set.intersection(*(set(s.rss_mib) for s in steady))
    out = {}
    for name in sorted(names):
        first = statistics.mean(s.rss_mib[name] for s in steady[:window])
        last = statistics.mean(s.rss_mib[name] for s in steady[-window:])
        out[name] = {"after_warmup_mib": first, "end_mib": last, "growth": last / first - 1}
    return out


async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    service = BenchService(work, name="soak", instances=args.instances, routers=1,
                         engine_args=engine_args(args), router_args=("--log-level", args.router_log_level))
    tally, samples, migrations = Tally(), [], Counter[str]()
    async with client_session() as session:
        try:
            await service.start(session)
            router = service.routers[0]
            started = time.monotonic()
            running = True

            async def client(index: int) -> None:
                rng = random.Random(f"{args.seed}-{index}")
                while running:
                    prompt, max_tokens, expected = request(rng, args)
                    tally.add(await stream_completion(session, router.url, service.model, prompt, max_tokens,
                                                      args.deadline), expected)

            async def migrate() -> None:
                while running:
                    await asyncio.sleep(args.migrate_every)
                    outcome = await migrate_busiest(service.loop)
                    if outcome is not None:
                        migrations[outcome.split(" (", 1)[0]] += 1

            def sample() -> Sample:
                rss = {"router": rss_mib(router.process.pid if router.process else None)}
                for instance_id, pair in service.ready_pairs().items():
                    rss[f"llumlet {instance_id}"] = rss_mib(pair.llumlet.pid)
                return Sample(round(time.monotonic() - started, 1), {k: v for k, v in rss.items() if v},
                              len(tally.results))

            clients = [asyncio.create_task(client(i)) for i in range(args.concurrency)]
            movers = [asyncio.create_task(migrate())] if args.migrate_every else []
            with tqdm(total=int(args.duration), desc="soak", unit="s", file=sys.stderr,
                      disable=args.quiet) as bar:
                while (now := time.monotonic() - started) < args.duration:
                    samples.append(sample())
                    bar.n = int(now)
                    bar.set_postfix_str(f"requests {len(tally.results)} errors {sum(tally.errors.values())} "
                                        f"router {samples[-1].rss_mib.get('router', 0):.1f} MiB")
                    await asyncio.sleep(min(args.sample_every, max(0.0, args.duration - now)))
            samples.append(sample())
            running = False
            await asyncio.gather(*clients, *movers)
        finally:
            await service.close()
    figures = tally.figures()
    grown = growth(samples, args.warmup, args.window)
    worst = max((g["growth"] for g in grown.values()), default=float("nan"))
    return {"mode": "soak", "config": _config(args), **figures, "migrations": dict(migrations),
            "growth": grown, "worst_growth": worst,
            "samples": [{"at_s": s.at_s, "requests": s.requests, **s.rss_mib} for s in samples],
            "ok": figures["errors"] == 0 and bool(grown) and worst < GROWTH_LIMIT}


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("json", "work_dir")}


def print_streams(result: dict[str, Any]) -> None:
    print(f"\n{result['requests']} streams through one router over {result['config']['instances']} sim "
          f"engines: {result['errors']} errors {result['errors_by_kind'] or ''}")
    print(f"  router peak in-flight {result['router_peak_in_flight']}, RSS idle "
          f"{result['router_rss_idle_mib']:.1f} MiB, peak {result['router_rss_peak_mib']:.1f} MiB")
    print(f"  TTFT p50 {result['ttft_p50_s']:.3f} s p99 {result['ttft_p99_s']:.3f} s; end-to-end p50 "
          f"{result['e2e_p50_s']:.2f} s p99 {result['e2e_p99_s']:.2f} s; {result['tokens']} tokens in "
          f"{result['elapsed_s']:.1f} s ({result['tokens_per_s']:.0f}/s)")
    for example in result["error_examples"]:
        print(f"  {example}")


def print_soak(result: dict[str, Any]) -> None:
    config = result["config"]
    moves = f"a migration every {config['migrate_every']:g} s" if config["migrate_every"] else "no migrations"
    print(f"\nsoak: {config['duration']:.0f} s, {config['concurrency']} streams, {moves}: "
          f"{result['requests']} requests, {result['errors']} errors "
          f"{result['errors_by_kind'] or ''}; migrations {result['migrations'] or 'none'}")
    print(f"  TTFT p50 {result['ttft_p50_s']:.3f} s p99 {result['ttft_p99_s']:.3f} s")
    print(f"  RSS growth after {config['warmup']:.0f} s warm-up (mean of {config['window']} samples at "
          "each end):")
    for name, g in result["growth"].items():
        print(f"    {name:<24}{g['after_warmup_mib']:8.1f} -> {g['end_mib']:8.1f} MiB  "
              f"{100 * g['growth']:+6.1f}%")
    print(f"  worst {100 * result['worst_growth']:+.1f}% (limit {100 * GROWTH_LIMIT:.0f}%)")
    for example in result["error_examples"]:
        print(f"  {example}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    for name, doc in (("streams", "N concurrent streams at once"), ("soak", "steady load over time")):
        mode = modes.add_parser(name, help=doc)
        mode.add_argument("--instances", type=int, default=4, help="sim engines (default: %(default)s)")
        mode.add_argument("--time-scale", type=float, default=1.0,
                          help="sim engines' speed-up over the latency profile (default: %(default)s)")
        mode.add_argument("--num-blocks", type=int, default=4000, help="default: %(default)s")
        mode.add_argument("--max-num-seqs", type=int, default=512, help="default: %(default)s")
        mode.add_argument("--min-tokens", type=int, default=32, help="default: %(default)s")
        mode.add_argument("--max-tokens", type=int, default=96, help="default: %(default)s")
        mode.add_argument("--deadline", type=float, default=600.0,
                          help="seconds before a request counts as hung (default: %(default)s)")
        mode.add_argument("--seed", type=int, default=1)
        mode.add_argument("--nice", type=int, default=10, help="default: %(default)s")
        mode.add_argument("--json", type=Path, help="write the result here")
        mode.add_argument("--work-dir", type=Path, help="logs (default: a temporary directory, removed)")
        mode.add_argument("--quiet", action="store_true", help="no progress bar")
        if name == "streams":
            mode.add_argument("--streams", type=int, default=1000, help="default: %(default)s")
        else:
            mode.add_argument("--duration", type=float, default=600.0, help="seconds (default: %(default)s)")
            mode.add_argument("--concurrency", type=int, default=32, help="default: %(default)s")
            mode.add_argument("--migrate-every", type=float, default=2.0,
                              help="seconds between migrations, 0: none (default: %(default)s)")
            mode.add_argument("--sample-every", type=float, default=10.0, help="default: %(default)s")
            mode.add_argument("--warmup", type=float, default=60.0, help="default: %(default)s")
            mode.add_argument("--window", type=int, default=3, help="default: %(default)s")
            mode.add_argument("--router-log-level", default="warning",
                              help="info logs every move the router follows (in --work-dir; default: "
                              "%(default)s)")
    args = parser.parse_args()
    nice_self(args.nice)
    limit = raise_fd_limit()
    if args.mode == "streams" and limit < 2 * args.streams + 1000:
        parser.error(f"open-files limit {limit} is too low for {args.streams} streams (ulimit -Hn)")
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="load-")))
        run = streams if args.mode == "streams" else soak
        result = run_cleanly(run(args, work.resolve()))
    (print_streams if args.mode == "streams" else print_soak)(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
