"""`python -m llumnix.sim_engine ...` is `llumnix sim-engine ...` (the launcher starts it this way)."""

import argparse
import sys

from llumnix.sim_engine import cli

parser = argparse.ArgumentParser(prog="llumnix sim-engine", description=(cli.__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
cli.add_arguments(parser)
sys.exit(cli.run(parser.parse_args()))
