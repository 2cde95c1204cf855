"""The robustness preset's report (`llumnix simulate --experiment robustness`): per point the three
systems' P99 and slowest prefill, their e2e means, and the verdict against the issue's targets."""

from __future__ import annotations

from pathlib import Path

from llumnix.sim.experiments import ROBUSTNESS_SYSTEMS, _robustness_report
from llumnix.sim.runner import RunSpec, simulate


def test_each_point_shows_the_slowest_prefill_beside_the_p99_and_its_verdict(tmp_path: Path) -> None:
    specs = [RunSpec(policy, "L-L", 3.0, cv=4, requests=150, instances=4, label="1")
             for policy in ROBUSTNESS_SYSTEMS]
    results = [(spec, simulate(spec)) for spec in specs]
    summaries = {spec.policy: result.summary() for spec, result in results}
    lines = _robustness_report(results, tmp_path)
    table = next(line for line in lines if line.startswith("| trace"))
    header, _, row = table.splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in row.strip("|").split("|")], strict=True))
    assert float(cells["max llumnix"]) == float(f"{summaries['llumnix']['prefill_max']:.3g}")
    assert float(cells["max nomig"]) == float(f"{summaries['llumnix-nomig']['prefill_max']:.3g}")
    assert cells["verdict"] == "holds" or set(cells["verdict"].split(", ")) <= {
        "p99>infaas++", "p99>nomig", "e2e>infaas++"}
    assert (tmp_path / "robustness.png").exists()
