"""How fast a live migration ends when its destination dies mid-stage, on CPU vLLM engines with llumlets.

The source llumlet stages without end (`--migration-max-stages 1000 --migration-final-delta-blocks 0`:
a tail block is always left, so no final stage starts), so the destination is provably mid-migration
when it dies. Each trial starts a fresh destination (engine + llumlet), starts a request on the source,
asks MigrateOut once 16 tokens are out, waits until the destination reports the migration staging
(`migrating_in`), kills -9 the destination's engine or its llumlet, and times kill -> MigrateOut's
answer. It checks that the request kept decoding on the source (its tokens keep coming after the
answer) and waits until the source runs no request and no migration.

    .venv/bin/python bench/migration_abort.py --trials 3
    .venv/bin/python bench/migration_abort.py --trials 3 --kill llumlet

Prints one line per trial and the median and maximum per kind; writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_service import run_cleanly
from migration_downtime import MODELS, REPO, Node, completion_body, prompt_ids
from tqdm import tqdm

from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.tiny_model import PRESETS, ensure_tiny_model
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb

PROMPT_TOKENS = 1000
MAX_TOKENS = 2800
"""Far more than a trial takes at any speed: the request is still decoding when the destination dies."""
STAGING_FOREVER = ("--migration-max-stages", "1000", "--migration-final-delta-blocks", "0")
WAIT_S = 120.0


@dataclasses.dataclass
class Trial:
    kill: str
    outcome: str
    reason: str
    kill_to_answer_ms: float
    tokens_after_answer: int


async def _wait(predicate: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.002)


async def _trial(source: Node, config: dict[str, Any], work: Path, index: int, kill: str,
                 vocab: int) -> Trial:
    pair = EnginePair(PairConfig(instance_id=f"doomed-{index}", work_dir=work / f"doomed-{index}", **config))
    await pair.start()
    destination = Node(pair)
    request_id = f"abort-{index}-{time.monotonic_ns()}"
    body = completion_body(prompt_ids(index, PROMPT_TOKENS, vocab), MAX_TOKENS)
    call = source.api.Generate(pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                                                  body_json=json.dumps(body)))
    tokens = 0
    answered_at: float | None = None
    after = 0
    migration: asyncio.Future[mpb.MigrateOutResponse] | None = None
    killed_at = 0.0
    try:
        async for message in call:
            tokens += len(message.chunk.token_ids)
            if answered_at is not None:
                after += len(message.chunk.token_ids)
                if after >= 16:
                    break
            elif migration is None and tokens >= 16:
                migration = asyncio.ensure_future(source.migration.MigrateOut(mpb.MigrateOutRequest(
                    destination_instance_id=pair.config.instance_id, destination_address=pair.grpc_address,
                    request_id=request_id), timeout=600))

                async def staging(node: Node = destination) -> bool:
                    return bool((await node.api.GetLoad(pb.GetLoadRequest())).migrating_in)

                await _wait(staging, "the destination to report the migration staging")
                killed_at = time.perf_counter()
                if kill == "engine":
                    pair.kill_engine()
                else:
                    pair.llumlet.signal(signal.SIGKILL)
                result = await migration
                answered_at = time.perf_counter()
    finally:
        await source.api.Abort(pb.AbortRequest(request_id=request_id))
        call.cancel()
        await destination.channel.close()
        await pair.stop()
    assert migration is not None and answered_at is not None

    async def idle() -> bool:
        load = await source.api.GetLoad(pb.GetLoadRequest())
        return not load.running and not load.migrating_out

    await _wait(idle, "the source to be idle")
    outcome = mpb.MigrationOutcome.Name(result.outcome).removeprefix("MIGRATION_OUTCOME_")
    return Trial(kill=kill, outcome=outcome, reason=result.reason,
                 kill_to_answer_ms=round((answered_at - killed_at) * 1e3, 1), tokens_after_answer=after)


async def measure(args: argparse.Namespace, work: Path) -> list[Trial]:
    recipe = PRESETS[MODELS["tiny"]]
    recipe = dataclasses.replace(recipe, max_position_embeddings=PROMPT_TOKENS + MAX_TOKENS + 128)
    model_dir = ensure_tiny_model(REPO / ".cache" / "models", recipe)
    config = {"model_dir": model_dir, "max_model_len": PROMPT_TOKENS + MAX_TOKENS + 64, "kv_cache_gib": 1.0,
              "shutdown_grace_s": 5.0, "engine_start_timeout_s": 600.0}
    source_pair = EnginePair(PairConfig(instance_id="source", work_dir=work / "source",
                                        llumlet_args=STAGING_FOREVER, **config))
    await source_pair.start()
    source = Node(source_pair)
    kinds = ["engine", "llumlet"] if args.kill == "both" else [args.kill]
    trials: list[Trial] = []
    try:
        for index in tqdm(range(args.trials * len(kinds)), desc="trials", unit="trial"):
            trial = await _trial(source, config, work, index, kinds[index % len(kinds)], recipe.vocab_size)
            tqdm.write(f"kill {trial.kill}: {trial.outcome} after {trial.kill_to_answer_ms:.0f} ms "
                       f"({trial.reason}); {trial.tokens_after_answer} tokens on the source after")
            trials.append(trial)
    finally:
        await source.channel.close()
        await source_pair.stop()
    return trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per kind of kill (default: 3)")
    parser.add_argument("--kill", choices=("engine", "llumlet", "both"), default="both",
                        help="what of the destination dies (default: both, alternating)")
    parser.add_argument("--json", type=Path, help="write the trials here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llumnix-migration-abort-") as tmp:
        trials = run_cleanly(measure(args, Path(tmp)))
    for kind in sorted({t.kill for t in trials}):
        times = [t.kill_to_answer_ms for t in trials if t.kill == kind]
        outcomes = sorted({t.outcome for t in trials if t.kill == kind})
        print(f"destination {kind} killed mid-stage: {len(times)} trials, outcomes {', '.join(outcomes)}; "
              f"kill -> MigrateOut answer median {statistics.median(times):.0f} ms, max {max(times):.0f} ms")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(t) for t in trials], indent=2) + "\n")
    ok = all(t.outcome == "ABORTED" and t.tokens_after_answer > 0 for t in trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
