"""`llumnix simulate` as a user runs it: the --json keys, the table, clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from llumnix.sim import cli
from llumnix.sim.metrics import SUMMARY_KEYS


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_json_has_every_key_per_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    argv = [
        "--trace",
        "M-M",
        "--rate",
        "7.5",
        "--instances",
        "4",
        "--requests",
        "150",
        "--policies",
        "llumnix,infaas++,round-robin",
        "--seed",
        "0",
        "--json",
        str(out),
    ]
    assert run(argv) == 0
    results = json.loads(out.read_text())
    assert list(results) == ["llumnix", "infaas++", "round-robin"]
    for summary in results.values():
        assert set(SUMMARY_KEYS) <= set(summary)
        assert summary["finished"] == 150 and summary["avg_instances"] == pytest.approx(4.0)
    assert "prefill p99" in capsys.readouterr().out


def test_unknown_policy_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--policies", "llumnix,fastest", "--requests", "10"]) == 2
    assert "unknown policy fastest" in capsys.readouterr().err


def test_experiment_needs_an_output_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--experiment", "fig12"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--chunked-prefill", "256"], ["--watermark", "0.2"],
                                   ["--migration-select", "longest", "--migration-threshold", "1"]])
def test_an_experiment_runs_on_the_engine_asked_for(tmp_path: Path, flags: list[str]) -> None:
    """The preset's engines chunk their prefills or keep another watermark, or its systems migrate by
    another rule (the figures differ from the default's), and the report's command says so, so that it
    reproduces the run."""
    reports = {}
    for engine_flags in ([], flags):
        out = tmp_path / ("asked" if engine_flags else "default")
        assert run(["--experiment", "fig13", "--requests", "100", "--out", str(out), *engine_flags]) == 0
        reports[bool(engine_flags)] = (out / "report.md").read_text().splitlines()
    assert reports[True][2].endswith(f"{' '.join(flags)}`")
    assert flags[0] not in reports[False][2]
    assert reports[True][3:] != reports[False][3:]


@pytest.mark.parametrize("budget", ["-1", "0"])
def test_a_chunked_prefill_budget_below_one_token_is_a_message(budget: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--chunked-prefill", budget, "--requests", "10"]) == 2
    assert "--chunked-prefill takes a positive token budget" in capsys.readouterr().err


@pytest.mark.parametrize("share", ["-0.1", "1"])
def test_a_watermark_outside_the_blocks_is_a_message(share: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--watermark", share, "--requests", "10"]) == 2
    assert "watermark is a share of the blocks, at least 0 and below 1, not" in capsys.readouterr().err


def _migrations(tmp_path: Path, rule: list[str]) -> tuple[int, dict[str, float]]:
    out = tmp_path / "rule.json"
    argv = ["--trace", "L-L", "--rate", "2", "--cv", "4", "--requests", "200", "--instances", "4",
            "--policies", "llumnix", "--json", str(out), *rule]
    assert run(argv) == 0
    summary = json.loads(out.read_text())["llumnix"]
    summary.pop("wall_seconds")
    return summary["migrations"], summary


def test_the_migration_rule_asked_for_is_the_one_simulated(tmp_path: Path) -> None:
    """The default rule moves requests on a bursty trace; with a threshold of 1e9 every instance is a
    source and the destination floor rises to it, so none is a destination and nothing moves; moving
    the longest request instead of the latest changes the run."""
    moved, default = _migrations(tmp_path, [])
    assert moved > 0
    assert _migrations(tmp_path, ["--migration-threshold", "1e9"])[0] == 0
    assert _migrations(tmp_path, ["--migration-select", "longest"])[1] != default


@pytest.mark.parametrize("threshold", ["-1", "nan"])
def test_a_migration_threshold_below_zero_is_a_message(threshold: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--migration-threshold", threshold, "--requests", "10"]) == 2
    assert "--migration-threshold takes a freeness of 0 or more" in capsys.readouterr().err
