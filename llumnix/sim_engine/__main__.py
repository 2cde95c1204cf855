"""`python -m llumnix.sim_engine ...` is `llumnix sim-engine ...`."""

import sys

from llumnix.cli import main

sys.exit(main(["sim-engine", *sys.argv[1:]]))
