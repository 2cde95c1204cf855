"""Summary statistics shared by the benchmark scripts (run as `python bench/NAME.py`, so this module is
imported from the scripts' own directory)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (0 <= q <= 1) by nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
