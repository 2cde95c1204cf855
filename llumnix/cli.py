"""`llumnix` command line. Each subcommand lives in its own module, imported only when that
subcommand runs, and provides `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("llumnix.demo", "run the main job on the embedded default and print a summary"),
    "simulate": ("llumnix.sim.cli", "discrete-event simulation of a cluster under a trace and policies"),
    "llumlet": ("llumlet.cli", "run the llumlet sidecar next to one engine (load, gRPC API, OpenAI front)"),
    "make-tiny-model": ("llumnix.tiny_model", "build a small random LLaMA + tokenizer locally (no hub)"),
    "sim-engine": ("llumnix.sim_engine.cli", "simulated engine: vLLM's OpenAI API + load snapshots, no GPU"),
    "router": ("llumnix.router.cli", "OpenAI-compatible gateway dispatching over llumlets by live load"),
    "bench": ("llumnix.bench", "replay a trace against an OpenAI endpoint; latency report, JSON and PNG"),
    "operator": ("llumnix_operator.cli", "run the Kubernetes operator for LLMService resources (kopf)"),
    "drain-instance": ("llumnix_operator.drain_hook", "preStop hook: drain the local llumlet by migration"),
    "up": ("llumnix.up", "run an LLMService on this machine: engines, router, control loop, admin API"),
    "admin": ("llumnix.admin_cli", "inspect and steer a running service: status, drain, undrain, migrate"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (so `llumnix --help` stays fast)."""
    parser = argparse.ArgumentParser(
        prog="llumnix",
        description="Llumnix on Kubernetes: run-time scheduling and live migration for vLLM instances.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            sp.description = (module.__doc__ or help_text).strip()
            sp.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
