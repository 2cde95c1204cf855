"""Simulate a cluster of LLM instances under a request trace and compare scheduling policies.

Either one comparison (--trace/--rate/--policies ..., a table and optionally --json), or one of the
paper's experiments (--experiment fig11 ... fig15, a markdown report and PNG plots in --out).
Details: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llumnix.policies.autoscaling import AutoscalingConfig
from llumnix.policies.migration import DEFAULT_MIGRATION, SELECT_POLICIES, MigrationConfig
from llumnix.profile import DEFAULT_PROFILE
from llumnix.sim.experiments import EXPERIMENTS, run_experiment
from llumnix.sim.instance import DEFAULT_WATERMARK
from llumnix.sim.metrics import class_summaries
from llumnix.sim.runner import RunSpec, simulate_with_bar
from llumnix.sim.systems import SYSTEMS
from llumnix.traces import SHARED_PREFIX_TRACES, TRACE_PRESETS

TABLE_COLUMNS = (
    ("prefill_mean", "prefill mean"),
    ("prefill_p99", "prefill p99"),
    ("prefill_max", "prefill max"),
    ("decode_mean", "decode mean"),
    ("decode_p99", "decode p99"),
    ("e2e_mean", "e2e mean"),
    ("e2e_p99", "e2e p99"),
    ("preemption_loss", "preempt loss"),
    ("prefix_hit_rate", "prefix hit"),
    ("fragmentation_mean", "frag"),
    ("avg_instances", "instances"),
    ("migrations", "migrations"),
    ("finished", "finished"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        default="M-M",
        help=f"length distribution: one of {', '.join(TRACE_PRESETS)}, or a shared-prefix trace:"
        f" {', '.join(SHARED_PREFIX_TRACES)} (default M-M)",
    )
    parser.add_argument(
        "--dataset",
        metavar="FILE",
        help="take prompt/output lengths from a ShareGPT JSON/JSONL or BurstGPT CSV file instead of --trace",
    )
    parser.add_argument("--rate", type=float, default=7.5, help="requests per second (default 7.5)")
    parser.add_argument("--cv", type=float, default=1.0, help="arrival burstiness; 1 = Poisson (default)")
    parser.add_argument(
        "--requests", type=int, help="requests in the trace (default 2000; presets: their own)"
    )
    parser.add_argument("--instances", type=int, default=16, help="instances (initial ones with --autoscale)")
    parser.add_argument(
        "--policies",
        default="llumnix,infaas++,round-robin",
        help=f"comma-separated systems to compare: {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE, help="bundled profile name or profile JSON file"
    )
    parser.add_argument("--high-priority-fraction", type=float, default=0.0, metavar="F")
    parser.add_argument(
        "--chunked-prefill", type=int, nargs="?", const=512, default=None, metavar="TOKENS",
        help="vLLM's chunked prefill, TOKENS per iteration (default 512, vLLM v0's), instead of the "
        "paper's prefill-first scheduler; applies to --experiment runs too",
    )
    parser.add_argument(
        "--watermark", type=float, default=DEFAULT_WATERMARK, metavar="F",
        help="share of an engine's blocks kept free when admitting a prompt (default %(default)s, vLLM v0's; "
        "vLLM 0.32 keeps none unless started with --watermark); applies to --experiment runs too",
    )
    parser.add_argument(
        "--queue-passing", action="store_true",
        help="a what-if engine (not vLLM): a queued request that fits is admitted past one ahead of it "
        "that does not (vLLM admits from the queue's head only)",
    )
    migration = parser.add_argument_group(
        "migration", "the rule of every system that migrates (docs/simulator.md, \"The migration rule\")")
    migration.add_argument(
        "--migration-threshold", type=float, default=DEFAULT_MIGRATION.freeness_threshold, metavar="F",
        help="an instance whose freeness (free blocks per batched request) is below F is a migration "
        "source (default %(default)s); destinations stay at or above the larger of F and "
        f"{DEFAULT_MIGRATION.destination_freeness:g}; applies to --experiment runs too",
    )
    migration.add_argument(
        "--migration-select", choices=SELECT_POLICIES, default=DEFAULT_MIGRATION.select,
        help="which running request a source moves: the latest admitted, the shortest or the longest "
        "(default %(default)s); applies to --experiment runs too",
    )
    scaling = parser.add_argument_group("autoscaling")
    scaling.add_argument("--autoscale", action="store_true", help="scale by aggregate freeness")
    defaults = AutoscalingConfig()
    scaling.add_argument("--scale-up-below", type=float, default=defaults.scale_up_below)
    scaling.add_argument("--scale-down-above", type=float, default=defaults.scale_down_above)
    scaling.add_argument("--min-instances", type=int, default=defaults.min_instances)
    scaling.add_argument("--max-instances", type=int, default=defaults.max_instances)
    scaling.add_argument(
        "--park-seconds", type=float, default=defaults.park_s,
        help="a drained instance, once empty, is kept this long; a scale-up meanwhile puts it back",
    )
    parser.add_argument("--json", metavar="FILE", help="write the per-policy results as JSON")
    parser.add_argument(
        "--experiment", choices=sorted(EXPERIMENTS), help="run one of the paper's experiments"
    )
    parser.add_argument("--out", metavar="DIR", help="output folder of --experiment (report.md, PNGs)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for --experiment runs")
    parser.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiply every rate of --experiment by this factor (the preset at a lighter or heavier load)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.chunked_prefill is not None and args.chunked_prefill < 1:
            raise ValueError("--chunked-prefill takes a positive token budget")
        if args.experiment:
            return _run_experiment(args)
        return _run_comparison(args)
    except ValueError as err:
        print(f"llumnix simulate: {err}", file=sys.stderr)
        return 2


def _migration(args: argparse.Namespace) -> MigrationConfig:
    if not args.migration_threshold >= 0:  # also refuses nan
        raise ValueError("--migration-threshold takes a freeness of 0 or more")
    return MigrationConfig.with_threshold(args.migration_threshold, args.migration_select)


def _autoscaling(args: argparse.Namespace) -> AutoscalingConfig | None:
    if not args.autoscale:
        return None
    return AutoscalingConfig(
        scale_up_below=args.scale_up_below,
        scale_down_above=args.scale_down_above,
        min_instances=args.min_instances,
        max_instances=args.max_instances,
        park_s=args.park_seconds,
    )


def _run_comparison(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in SYSTEMS]
    if not policies or unknown:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}")
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be at least 1")
    migration, autoscaling = _migration(args), _autoscaling(args)
    results: dict[str, dict] = {}
    for policy in policies:
        spec = RunSpec(
            policy=policy,
            trace=args.dataset or args.trace,
            rate=args.rate,
            cv=args.cv,
            requests=args.requests or 2000,
            instances=args.instances,
            seed=args.seed,
            high_priority_fraction=args.high_priority_fraction,
            profile=args.profile,
            chunked_prefill_tokens=args.chunked_prefill or 0,
            watermark=args.watermark,
            queue_passing=args.queue_passing,
            migration=migration,
            autoscaling=autoscaling,
        )
        result = simulate_with_bar(spec, policy)
        summary = result.summary()
        if args.high_priority_fraction > 0:
            summary.update(
                {f"{cls}_{k}": v for cls, s in class_summaries(result).items() for k, v in s.items()}
            )
        summary["wall_seconds"] = result.wall_seconds
        results[policy] = summary
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def format_table(results: dict[str, dict]) -> str:
    header = ["policy", *(title for _, title in TABLE_COLUMNS)]
    rows = [header]
    for policy, summary in results.items():
        rows.append([policy, *(_cell(summary[key]) for key, _ in TABLE_COLUMNS)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + "\n(times in seconds; frag = mean fragmented fraction of cluster memory)"


def _cell(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def _run_experiment(args: argparse.Namespace) -> int:
    if not args.out:
        raise ValueError("--experiment needs --out DIR")
    report = run_experiment(
        args.experiment,
        Path(args.out),
        requests=args.requests,
        seed=args.seed,
        profile=args.profile,
        jobs=args.jobs,
        rate_scale=args.rate_scale,
        chunked_prefill_tokens=args.chunked_prefill or 0,
        watermark=args.watermark,
        migration=_migration(args),
    )
    print(report.read_text(encoding="utf-8"))
    print(f"wrote {report} and its plots")
    return 0
