"""`python -m llumlet ...` = `llumnix llumlet ...` (the sidecar container's entry point)."""

from __future__ import annotations

import argparse
import sys

from llumlet import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llumlet", description=(cli.__doc__ or "").strip())
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
