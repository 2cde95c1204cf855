"""A llumlet with an injected migration fault, for the tests of what a fault leaves behind:
`python -m faulty_llumlet [--crash-at POINT] [--hold-commit-answer] <llumlet flags>` (this
directory on PYTHONPATH; `LlumletProcessConfig(module="faulty_llumlet")`). It patches the real migration
code, then runs the llumlet's own CLI.

--crash-at, as a migration source:
- final-stage: the final KV stage was sent, Commit not yet called;
- commit: the destination committed, the caller has not learned of the move.

--hold-commit-answer, as a destination: Commit starts the request as usual, then never answers (until
the caller gives up and the call is cancelled), so a source's commit timeout fires on any machine,
however fast its first token.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from typing import Any

from llumlet import __main__ as llumlet_main
from llumlet.admission import MovedTo, Suspension
from llumlet.migration.destination import Destination
from llumlet.migration.source import Source

logger = logging.getLogger("llumlet.migration")


def _crash(point: str) -> None:
    logger.warning("fault injection: the source llumlet kills itself", extra={"point": point})
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_after_final_stage() -> None:
    sent = Source._stage_sent

    @functools.wraps(sent)
    async def stage_sent(self: Source, progress: Any, events: asyncio.Queue[Any], final: bool) -> Any:
        event = await sent(self, progress, events, final)
        if final:
            _crash("final-stage")
        return event

    Source._stage_sent = stage_sent  # type: ignore[method-assign]


def _crash_after_commit() -> None:
    # The source hands MovedTo to the caller's stream only once Commit answered ok.
    decide = Suspension.decide

    @functools.wraps(decide)
    def decide_or_crash(self: Suspension, decision: Any) -> None:
        if isinstance(decision, MovedTo):
            _crash("commit")
        decide(self, decision)

    Suspension.decide = decide_or_crash  # type: ignore[method-assign]


def _hold_commit_answer() -> None:
    commit = Destination.commit

    @functools.wraps(commit)
    async def commit_then_hold(self: Destination, request: Any) -> Any:
        await commit(self, request)
        logger.warning("fault injection: the destination holds its Commit answer",
                       extra={"migration_id": request.migration_id})
        await asyncio.get_running_loop().create_future()  # only the call's cancellation ends it

    Destination.commit = commit_then_hold  # type: ignore[method-assign]


INJECT = {"final-stage": _crash_after_final_stage, "commit": _crash_after_commit}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--crash-at", choices=sorted(INJECT))
    parser.add_argument("--hold-commit-answer", action="store_true")
    fault, llumlet_argv = parser.parse_known_args(argv)
    if fault.crash_at is not None:
        INJECT[fault.crash_at]()
    if fault.hold_commit_answer:
        _hold_commit_answer()
    return llumlet_main.main(llumlet_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
