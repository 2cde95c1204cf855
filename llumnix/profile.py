"""Per-iteration latency of one engine instance (a model on a GPU), for the simulator and the sim engine.

A profile is a JSON file of one of two kinds (docs/latency-profile.md describes both):
- `"kind": "roofline"`: hardware and model numbers from which the latency is derived. Decode is
  memory-bound (the weights are read once per iteration, plus the KV cache of every context token),
  prefill is compute-bound (2 x parameters FLOPs per token plus causal attention); an iteration takes
  the slower of weight reading and linear-layer compute, plus attention, plus a fixed overhead.
- `"kind": "measured"`: tables of measured prefill time vs tokens and decode time vs (batch size,
  context tokens), linearly interpolated and extrapolated.

`iteration_time` is called about a million times per simulation: both kinds precompute plain-float
coefficients and use no dicts or numpy per call.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILE = "llama-7b-a10"
PROFILES_DIR = Path(__file__).parent / "profiles"


class IterationLatency(ABC):
    """How long one engine iteration takes."""

    @abstractmethod
    def iteration_time(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int, prefill_square_tokens: int
    ) -> float: ...


@dataclass(frozen=True, slots=True)
class RooflineLatency(IterationLatency):
    """Roofline model; every coefficient is in seconds and already divided by the achieved throughput."""

    weights_read_s: float
    """Reading all weights once (a floor for any iteration: every token passes through every layer)."""
    linear_s_per_token: float
    """Compute of the linear layers (2 x parameters FLOPs) per token in the iteration."""
    prefill_attention_s_per_square_token: float
    """Causal attention compute of a prefill, per squared prompt length (2 x layers x hidden FLOPs)."""
    decode_attention_s_per_context_token: float
    """Reading one context token's KV cache during decode."""
    overhead_s: float
    """Fixed cost per iteration (scheduling, sampling, kernel launches)."""

    def iteration_time(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int, prefill_square_tokens: int
    ) -> float:
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        linear = tokens * self.linear_s_per_token
        return (
            self.overhead_s
            + (linear if linear > self.weights_read_s else self.weights_read_s)
            + prefill_square_tokens * self.prefill_attention_s_per_square_token
            + decode_context_tokens * self.decode_attention_s_per_context_token
        )


def _segment(xs: list[float], x: float) -> tuple[int, float]:
    """Index i of the segment [xs[i], xs[i+1]] that interpolates (or, at the ends, extrapolates) x, and
    x's position t along it (t < 0 or t > 1 outside the table)."""
    i = bisect.bisect_right(xs, x) - 1
    last = len(xs) - 2
    i = 0 if i < 0 else (last if i > last else i)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


class _Table1D:
    """Piecewise-linear y(x) through sorted points, extrapolated by the end segments."""

    __slots__ = ("xs", "ys")

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self.xs = [float(x) for x in xs]
        self.ys = [float(y) for y in ys]

    def __call__(self, x: float) -> float:
        i, t = _segment(self.xs, x)
        return self.ys[i] + t * (self.ys[i + 1] - self.ys[i])


class MeasuredLatency(IterationLatency):
    """Measured tables: prefill seconds vs tokens; decode seconds on a (batch size, context tokens) grid.

    A mixed iteration (prefill and decode together) costs the sum of both parts, which is conservative:
    the weights are read once for both in reality. The prefill table already holds the attention cost of
    one prompt of each length, so `prefill_square_tokens` is not used.
    """

    def __init__(
        self,
        prefill_tokens: Sequence[float],
        prefill_seconds: Sequence[float],
        batch_sizes: Sequence[float],
        context_tokens: Sequence[float],
        decode_seconds: Sequence[Sequence[float]],
    ) -> None:
        _check_axis("prefill 'tokens'", prefill_tokens, len(prefill_seconds), "prefill 'seconds'")
        _check_axis("decode 'batch_sizes'", batch_sizes, len(decode_seconds), "decode 'seconds' (rows)")
        for row in decode_seconds:
            _check_axis("decode 'context_tokens'", context_tokens, len(row), "each row of decode 'seconds'")
        self._prefill = _Table1D(prefill_tokens, prefill_seconds)
        self._batch_sizes = [float(b) for b in batch_sizes]
        self._decode_rows = [_Table1D(context_tokens, row) for row in decode_seconds]

    def iteration_time(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int, prefill_square_tokens: int
    ) -> float:
        seconds = 0.0
        if prefill_tokens > 0:
            seconds += max(0.0, self._prefill(prefill_tokens))
        if decode_seqs > 0:
            i, t = _segment(self._batch_sizes, decode_seqs)
            low = self._decode_rows[i](decode_context_tokens)
            high = self._decode_rows[i + 1](decode_context_tokens)
            seconds += max(0.0, low + t * (high - low))
        return seconds


def _check_axis(name: str, axis: Sequence[float], values: int, values_name: str) -> None:
    if len(axis) < 2:
        raise ValueError(f"{name} needs at least 2 points to interpolate, got {len(axis)}")
    if any(b <= a for a, b in itertools.pairwise(axis)):
        raise ValueError(f"{name} must be strictly increasing")
    if len(axis) != values:
        raise ValueError(f"{values_name} must have {len(axis)} values (one per {name}), got {values}")


@dataclass(frozen=True)
class LatencyProfile:
    """One instance's engine: its KV-cache geometry, batching limits and iteration latency."""

    name: str
    block_size: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    migration_bandwidth: float
    """Bytes/s of a KV copy between instances."""
    max_num_seqs: int
    """Continuous-batching limit on running sequences."""
    max_num_batched_tokens: int
    """Tokens one iteration may process (prefill tokens + one per decoding sequence)."""
    latency: IterationLatency
    kv_transfer_latency_s: float = 0.0
    """Fixed cost of one KV copy (handshake and launch), added to the bandwidth term."""

    def iteration_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        decode_context_tokens: int,
        prefill_square_tokens: int = -1,
    ) -> float:
        """Seconds for one iteration that prefills `prefill_tokens` prompt tokens and decodes one token for
        each of `decode_seqs` sequences whose contexts total `decode_context_tokens`.

        `prefill_square_tokens` measures the prefill's causal attention, which is quadratic: the sum over
        the prefilled chunks of (o + c)^2 - o^2 for c tokens after o already computed (c^2 for a whole
        prompt). By default the prefill is taken as one prompt (prefill_tokens^2), an upper bound when
        several prompts are batched.
        """
        if prefill_square_tokens < 0:
            prefill_square_tokens = prefill_tokens * prefill_tokens
        return self.latency.iteration_time(
            prefill_tokens, decode_seqs, decode_context_tokens, prefill_square_tokens
        )

    def prefill_time(self, tokens: int) -> float:
        return self.iteration_time(tokens, 0, 0)

    def decode_time(self, seqs: int, context_tokens: int) -> float:
        return self.iteration_time(0, seqs, context_tokens)

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens' KV cache to another instance."""
        return self.kv_transfer_latency_s + tokens * self.kv_bytes_per_token / self.migration_bandwidth

    @property
    def total_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


def _number(section: Mapping[str, Any], key: str, where: str, positive: bool = True) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{where}: {key!r} must be positive, got {value}")
    if not positive and value < 0:
        raise ValueError(f"{where}: {key!r} must not be negative, got {value}")
    return float(value)


def _section(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: missing section {key!r}")
    return value


def _numbers(value: object, what: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        raise ValueError(f"{what} must be a list of numbers")
    return [float(v) for v in value]


def roofline_from_hardware(data: Mapping[str, Any], where: str) -> tuple[RooflineLatency, int]:
    """The roofline coefficients and the KV bytes per token derived from a roofline profile's numbers."""
    model = _section(data, "model", where)
    hw = _section(data, "hardware", where)
    eff = _section(data, "efficiency", where)
    layers = _number(model, "layers", where)
    hidden = _number(model, "hidden_size", where)
    dtype_bytes = _number(model, "dtype_bytes", where)
    bandwidth = _number(hw, "memory_bandwidth", where)
    flops = _number(hw, "peak_flops", where)
    linear_flops = flops * _number(eff, "linear_compute", where)
    attention_flops = flops * _number(eff, "attention_compute", where)
    # Keys and values, every layer; grouped-query models store fewer KV heads than query heads.
    kv_hidden = _number(model, "kv_hidden_size", where) if "kv_hidden_size" in model else hidden
    kv_bytes_per_token = int(2 * layers * kv_hidden * dtype_bytes)
    latency = RooflineLatency(
        weights_read_s=_number(model, "weight_bytes", where)
        / (bandwidth * _number(eff, "weight_read", where)),
        linear_s_per_token=2.0 * _number(model, "params", where) / linear_flops,
        # Causal attention of an n-token prompt: QK^T and AV, 2*n^2*hidden FLOPs each, half masked.
        prefill_attention_s_per_square_token=2.0 * layers * hidden / attention_flops,
        decode_attention_s_per_context_token=kv_bytes_per_token
        / (bandwidth * _number(eff, "attention_read", where)),
        overhead_s=_number(data, "iteration_overhead_s", where, positive=False),
    )
    return latency, kv_bytes_per_token


def _measured(data: Mapping[str, Any], where: str) -> MeasuredLatency:
    prefill = _section(data, "prefill", where)
    decode = _section(data, "decode", where)
    rows = decode.get("seconds")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: decode 'seconds' must be a list of rows, one per batch size")
    try:
        return MeasuredLatency(
            prefill_tokens=_numbers(prefill.get("tokens"), "prefill 'tokens'"),
            prefill_seconds=_numbers(prefill.get("seconds"), "prefill 'seconds'"),
            batch_sizes=_numbers(decode.get("batch_sizes"), "decode 'batch_sizes'"),
            context_tokens=_numbers(decode.get("context_tokens"), "decode 'context_tokens'"),
            decode_seconds=[_numbers(row, "each row of decode 'seconds'") for row in rows],
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def profile_from_dict(data: Mapping[str, Any], where: str = "profile") -> LatencyProfile:
    """A profile from the parsed JSON of a profile file (`where` names it in error messages)."""
    kind = data.get("kind")
    engine = _section(data, "engine", where)
    if kind == "roofline":
        latency, kv_bytes_per_token = roofline_from_hardware(data, where)
    elif kind == "measured":
        latency = _measured(data, where)
        kv_bytes_per_token = int(_number(engine, "kv_bytes_per_token", where))
    else:
        raise ValueError(f"{where}: 'kind' must be 'roofline' or 'measured', got {kind!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    return LatencyProfile(
        name=name,
        block_size=int(_number(engine, "block_size", where)),
        kv_capacity_tokens=int(_number(engine, "kv_capacity_tokens", where)),
        kv_bytes_per_token=kv_bytes_per_token,
        migration_bandwidth=_number(engine, "migration_bandwidth", where),
        max_num_seqs=int(_number(engine, "max_num_seqs", where)),
        max_num_batched_tokens=int(_number(engine, "max_num_batched_tokens", where)),
        latency=latency,
        kv_transfer_latency_s=_number(engine, "kv_transfer_latency_s", where, positive=False),
    )


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped in `llumnix/profiles/`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> LatencyProfile:
    """A bundled profile by name (see `bundled_profiles()`) or a profile JSON file by path."""
    bundled = PROFILES_DIR / f"{name_or_path}.json"
    path = bundled if bundled.is_file() else Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"no latency profile {name_or_path!r}: not a file and not one of {', '.join(bundled_profiles())}"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read latency profile {path}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"latency profile {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"latency profile {path}: expected a JSON object")
    return profile_from_dict(data, where=str(path))
