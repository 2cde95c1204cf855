"""Seeded, reproducible request traces: arrival times plus prompt/output lengths (paper §6.1, Table 1).

Lengths come from one of the paper's distributions (`LENGTH_DISTRIBUTIONS`, combined in pairs by
`TRACE_PRESETS`) or from a dataset file (ShareGPT JSON/JSONL, BurstGPT CSV). Arrivals are Poisson or,
for burstiness, Gamma with a given coefficient of variation. The same arguments give the same trace.

Generated distributions (S, M, L) follow the paper's artifact: a Zipf law over ranks 1..2*mean-1,
rescaled to the target mean (rounded up) and capped at 6,144 tokens. The artifact rescales by the
*sample* mean; here the rescaling uses the law's exact mean, so a length's distribution does not depend
on how many lengths are drawn together.

Shared-prefix traces (`SHARED_PREFIX_TRACES`) also say what the tokens are, so that requests can
share a cached prefix: a request's token sequence (prompt, then output) is a list of segments, each
a deterministic stream of token ids named by its seed (`request_token_ids`). "prefix-groups": every
request starts with one of a few long system prompts, then its own question; "prefix-sessions":
multi-turn chats whose next turn's prompt is the previous prompt, its answer and a new message.
The paper's traces carry no segments: no two of their requests share content.

The ShareGPT and BurstGPT datasets cannot be fetched here, so their distributions are smooth fits to
Table 1: the quantile function is piecewise linear in (standard-normal score of p, log length) through
the table's P50/P80/P95/P99 (log-normal between neighbouring percentiles), with straight tails whose
slopes are set so that the mean matches the table too.
"""

from __future__ import annotations

import csv
import functools
import heapq
import json
import math
import os
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtri

MAX_SEQUENCE_TOKENS = 6144
"""Longest request of the paper's traces (prompt + output), and the cap of every generated length."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_time: float
    """Seconds from the trace start; non-decreasing along a trace."""
    prompt_tokens: int
    output_tokens: int
    high_priority: bool = False
    segments: tuple[tuple[int, int], ...] = ()
    """(seed, tokens) pieces of the request's token sequence, prompt then output, covering
    prompt_tokens + output_tokens; empty: content no other request shares."""


LENGTH_DISTRIBUTIONS = (
    "S",
    "M",
    "L",
    "sharegpt-input",
    "sharegpt-output",
    "burstgpt-input",
    "burstgpt-output",
)

TRACE_PRESETS: dict[str, tuple[str, str]] = {
    "S-S": ("S", "S"),
    "M-M": ("M", "M"),
    "L-L": ("L", "L"),
    "S-L": ("S", "L"),
    "L-S": ("L", "S"),
    "sharegpt": ("sharegpt-input", "sharegpt-output"),
    "burstgpt": ("burstgpt-input", "burstgpt-output"),
}
"""Trace name -> (prompt length distribution, output length distribution)."""


@dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    """How a shared-prefix trace is built (lengths in tokens)."""

    system_prompts: int
    """Distinct system prompts; a request picks one with Zipf(1) popularity."""
    system_tokens: tuple[int, int]
    """Range (inclusive) of a system prompt's length."""
    message: str = "S"
    """Distribution of a user message's length (`LENGTH_DISTRIBUTIONS`)."""
    output: str = "S"
    """Distribution of an answer's length."""
    mean_turns: float = 1.0
    """Requests per session (geometric); 1: every request is a session of its own."""
    think_time_s: float = 0.0
    """Mean time (exponential) from one turn of a session to the next."""


SHARED_PREFIX_TRACES: dict[str, SharedPrefixShape] = {
    "prefix-groups": SharedPrefixShape(system_prompts=48, system_tokens=(1024, 3072)),
    "prefix-sessions": SharedPrefixShape(
        system_prompts=8, system_tokens=(256, 1024), mean_turns=6.0, think_time_s=10.0
    ),
}
"""Trace families whose requests share prefixes (see the module's docstring)."""

TOKEN_VOCABULARY = 32000
"""Token ids of generated segments are drawn from 0..TOKEN_VOCABULARY-1 (LLaMA's vocabulary)."""

# Generated power laws (artifact): name -> (target mean, Zipf exponent).
_POWER_LAWS: dict[str, tuple[int, float]] = {"S": (128, 2.0), "M": (256, 1.5), "L": (512, 1.15)}

# Table 1 of the paper: name -> (mean, (P50, P80, P95, P99)).
TABLE1_PERCENTILES = (50.0, 80.0, 95.0, 99.0)
_DATASET_FITS: dict[str, tuple[float, tuple[float, float, float, float]]] = {
    "sharegpt-input": (306, (74, 348, 1484, 3388)),
    "sharegpt-output": (500, (487, 781, 988, 1234)),
    "burstgpt-input": (830, (582, 1427, 2345, 3549)),
    "burstgpt-output": (271, (243, 434, 669, 964)),
}

CHARS_PER_TOKEN = 4
"""Token estimate for dataset text without a tokenizer (about 4 characters per LLaMA token in English)."""


@dataclass(frozen=True)
class _PowerLaw:
    cdf: np.ndarray
    """Cumulative probabilities of ranks 1..len(cdf)."""
    scale: float
    """Token length of rank 1, so that the law's mean equals the target mean."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, rng.random(n), side="right") + 1
        return np.minimum(np.ceil(ranks * self.scale), MAX_SEQUENCE_TOKENS).astype(np.int64)


@dataclass(frozen=True)
class _QuantileFit:
    """Quantile function log x(z), z the standard-normal score of p: linear between knots, straight tails."""

    knots_z: np.ndarray
    knots_log: np.ndarray
    low_slope: float
    high_slope: float

    def lengths(self, z: np.ndarray) -> np.ndarray:
        log_x = np.interp(z, self.knots_z, self.knots_log)
        below, above = z < self.knots_z[0], z > self.knots_z[-1]
        log_x[below] = self.knots_log[0] + self.low_slope * (z[below] - self.knots_z[0])
        log_x[above] = self.knots_log[-1] + self.high_slope * (z[above] - self.knots_z[-1])
        return np.clip(np.exp(log_x), 1.0, MAX_SEQUENCE_TOKENS)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.maximum(np.rint(self.lengths(ndtri(rng.random(n)))), 1).astype(np.int64)


@functools.cache
def _power_law(name: str) -> _PowerLaw:
    mean, exponent = _POWER_LAWS[name]
    ranks = np.arange(1, 2 * mean, dtype=np.float64)
    pmf = ranks**-exponent
    pmf /= pmf.sum()
    cdf = np.cumsum(pmf)
    cdf[-1] = 1.0
    return _PowerLaw(cdf=cdf, scale=mean / float(np.dot(ranks, pmf)))


@functools.cache
def _quantile_fit(name: str) -> _QuantileFit:
    target_mean, percentiles = _DATASET_FITS[name]
    knots_z = ndtri(np.array(TABLE1_PERCENTILES) / 100.0)
    knots_log = np.log(np.array(percentiles, dtype=np.float64))
    slopes = np.diff(knots_log) / np.diff(knots_z)
    # Mean by quadrature over z with the standard-normal density.
    grid = np.linspace(-9.0, 9.0, 36001)
    weights = np.exp(-(grid**2) / 2.0)
    weights /= weights.sum()

    def mean_with(low: float, high: float) -> float:
        return float(np.dot(_QuantileFit(knots_z, knots_log, low, high).lengths(grid), weights))

    # Tails continue the neighbouring segments; the one that must bend to match the mean is steepened:
    # the upper tail when the mean is too low, the lower tail (more short requests) when it is too high.
    low, high = float(slopes[0]), float(slopes[-1])
    if mean_with(low, high) < target_mean:
        high = brentq(lambda s: mean_with(low, s) - target_mean, high, 50.0)
    else:
        low = brentq(lambda s: mean_with(s, high) - target_mean, low, 50.0)
    return _QuantileFit(knots_z, knots_log, low, high)


def sample_lengths(distribution: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` token lengths (int64, each in 1..6144) drawn from one of `LENGTH_DISTRIBUTIONS`."""
    if n < 0:
        raise ValueError(f"cannot draw a negative number of lengths ({n})")
    if distribution in _POWER_LAWS:
        return _power_law(distribution).sample(n, rng)
    if distribution in _DATASET_FITS:
        return _quantile_fit(distribution).sample(n, rng)
    raise ValueError(
        f"unknown length distribution {distribution!r}; choose one of {', '.join(LENGTH_DISTRIBUTIONS)}"
    )


def arrival_times(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds, non-decreasing) of `n` requests at `rate` requests/s.

    cv == 1 gives a Poisson process (exponential gaps); otherwise gaps are Gamma distributed with
    shape 1/cv^2 and scale cv^2/rate (mean 1/rate, coefficient of variation cv).
    """
    if n < 0:
        raise ValueError(f"cannot draw a negative number of arrivals ({n})")
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"request rate must be a positive number of requests per second, got {rate}")
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"coefficient of variation must be positive, got {cv}")
    gaps = rng.exponential(1.0 / rate, n) if cv == 1.0 else rng.gamma(1.0 / cv**2, cv**2 / rate, n)
    return np.cumsum(gaps)


def _tokens_of_text(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _sharegpt_pair(entry: object) -> tuple[int, int] | None:
    """(prompt, output) of a ShareGPT conversation: its first human turn and the gpt turn after it."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list):
        return None
    human = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") == "human"), None)
    if human is None or human + 1 == len(turns):
        return None
    prompt, reply = turns[human].get("value"), turns[human + 1]
    if not (isinstance(reply, dict) and reply.get("from") == "gpt"):
        return None
    output = reply.get("value")
    if not (isinstance(prompt, str) and isinstance(output, str)):
        return None
    return _tokens_of_text(prompt), _tokens_of_text(output)


def _load_sharegpt(path: str, text: str) -> list[object]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not ShareGPT JSON or JSONL (line {number}: {err.msg})") from None
        return entries
    if isinstance(document, dict):
        return [document]
    if not isinstance(document, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, found {type(document).__name__}")
    return document


def _load_burstgpt(path: str, text: str) -> list[tuple[int, int]]:
    reader = csv.DictReader(text.splitlines())
    columns = ("Request tokens", "Response tokens")
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: BurstGPT CSV lacks column(s) {', '.join(repr(c) for c in missing)}")
    pairs = []
    for number, row in enumerate(reader, start=2):
        try:
            prompt, output = int(float(row[columns[0]])), int(float(row[columns[1]]))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: line {number}: token counts must be numbers") from None
        # Failed requests have no response; a prompt of 0 tokens cannot be served.
        if prompt > 0 and output > 0:
            pairs.append((prompt, output))
    return pairs


def load_dataset_lengths(path: str) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) pairs of a ShareGPT (JSON/JSONL) or BurstGPT (CSV) file.

    ShareGPT: each conversation's first human turn is the prompt and the gpt turn right after it the
    output; conversations without that pair are skipped. No tokenizer is used: a text's tokens are
    estimated as max(1, round(characters / 4)). BurstGPT (`.csv`): the "Request tokens" and
    "Response tokens" columns; rows with 0 response tokens (failed requests) or 0 request tokens are
    skipped.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"cannot read dataset file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    if not text.strip():
        raise ValueError(f"{path}: dataset file is empty")
    if path.lower().endswith(".csv"):
        pairs = _load_burstgpt(path, text)
        kind = "BurstGPT rows with request and response tokens"
    else:
        pairs = [pair for entry in _load_sharegpt(path, text) if (pair := _sharegpt_pair(entry))]
        kind = "ShareGPT conversations with a human turn followed by a gpt turn"
    if not pairs:
        raise ValueError(f"{path}: no {kind}")
    return pairs


def segment_token_ids(seed: int, tokens: int) -> np.ndarray:
    """The token ids of one segment: the same for the same seed, in every process."""
    return np.random.default_rng([0x5E6, seed]).integers(0, TOKEN_VOCABULARY, tokens, dtype=np.uint32)


def request_token_ids(request: TraceRequest) -> np.ndarray:
    """A shared-prefix request's whole token sequence (prompt, then output); empty without segments."""
    if not request.segments:
        return np.zeros(0, dtype=np.uint32)
    return np.concatenate([segment_token_ids(seed, tokens) for seed, tokens in request.segments])


def _shared_prefix_trace(
    shape: SharedPrefixShape, num_requests: int, rate: float, cv: float, rng: np.random.Generator,
    max_total_tokens: int,
) -> list[tuple[float, tuple[tuple[int, int], ...], int]]:
    """(arrival, segments, prompt tokens) of the first `num_requests` requests, in arrival order.
    Sessions start at `rate` / mean turns (so requests arrive at `rate` once sessions overlap) until
    there are enough requests; a session ends early where its next turn would be too long."""
    low, high = shape.system_tokens
    system = rng.integers(low, high + 1, shape.system_prompts)
    popularity = 1.0 / np.arange(1, shape.system_prompts + 1)
    popularity /= popularity.sum()
    start = 0.0
    next_seed = shape.system_prompts
    requests: list[tuple[float, tuple[tuple[int, int], ...], int]] = []
    cutoff = math.inf
    """Arrival of the num_requests-th request so far: a session starting later adds none before it."""
    while num_requests:
        start += float(arrival_times(1, rate / shape.mean_turns, cv, rng)[0])
        if start > cutoff:
            break
        prompt = int(rng.choice(shape.system_prompts, p=popularity))
        history: list[tuple[int, int]] = [(prompt, int(system[prompt]))]
        at = float(start)
        turns = int(rng.geometric(1.0 / shape.mean_turns)) if shape.mean_turns > 1 else 1
        for _ in range(turns):
            message = int(sample_lengths(shape.message, 1, rng)[0])
            answer = int(sample_lengths(shape.output, 1, rng)[0])
            prompt_tokens = sum(tokens for _, tokens in history) + message
            if prompt_tokens + answer > max_total_tokens:
                break
            history.append((next_seed, message))
            requests.append((at, (*history, (next_seed + 1, answer)), prompt_tokens))
            history.append((next_seed + 1, answer))
            next_seed += 2
            at += float(rng.exponential(shape.think_time_s)) if shape.think_time_s > 0 else 0.0
        if len(requests) >= num_requests:
            cutoff = heapq.nsmallest(num_requests, (r[0] for r in requests))[-1]
    requests.sort(key=lambda r: r[0])
    return requests[:num_requests]


def generate_trace(
    lengths: str,
    num_requests: int,
    rate: float,
    cv: float = 1.0,
    seed: int = 0,
    high_priority_fraction: float = 0.0,
    max_total_tokens: int = MAX_SEQUENCE_TOKENS,
) -> list[TraceRequest]:
    """A trace of `num_requests` requests arriving at `rate` requests/s (burstiness `cv`).

    `lengths` is a `TRACE_PRESETS` name, a `SHARED_PREFIX_TRACES` name or the path of a dataset file
    (see `load_dataset_lengths`), whose (prompt, output) pairs are drawn uniformly with replacement.
    prompt + output is capped at `max_total_tokens` (the prompt first, keeping at least one output
    token). `high_priority_fraction` of the requests (rounded), chosen at random, are high priority.
    Same arguments, same trace.
    """
    if num_requests < 0:
        raise ValueError(f"number of requests must be >= 0, got {num_requests}")
    if not 0.0 <= high_priority_fraction <= 1.0:
        raise ValueError(f"high-priority fraction must be within [0, 1], got {high_priority_fraction}")
    if max_total_tokens < 2:
        raise ValueError(f"max_total_tokens must be >= 2 (prompt + output token), got {max_total_tokens}")
    rng = np.random.default_rng(seed)
    if lengths in SHARED_PREFIX_TRACES:
        shared = _shared_prefix_trace(SHARED_PREFIX_TRACES[lengths], num_requests, rate, cv, rng,
                                      max_total_tokens)
        flags = np.zeros(len(shared), dtype=bool)
        flags[rng.permutation(len(shared))[: round(high_priority_fraction * len(shared))]] = True
        return [
            TraceRequest(i, at, prompt, segments[-1][1], bool(flags[i]), segments)
            for i, (at, segments, prompt) in enumerate(shared)
        ]
    arrivals = arrival_times(num_requests, rate, cv, rng)
    if lengths in TRACE_PRESETS:
        input_dist, output_dist = TRACE_PRESETS[lengths]
        prompts = sample_lengths(input_dist, num_requests, rng)
        outputs = sample_lengths(output_dist, num_requests, rng)
    elif os.path.isfile(lengths):
        pairs = np.array(load_dataset_lengths(lengths), dtype=np.int64)
        chosen = pairs[rng.integers(0, len(pairs), num_requests)]
        prompts, outputs = chosen[:, 0], chosen[:, 1]
    else:
        raise ValueError(
            f"unknown trace {lengths!r}: not a dataset file and not one of"
            f" {', '.join([*TRACE_PRESETS, *SHARED_PREFIX_TRACES])}"
        )
    prompts = np.minimum(prompts, max_total_tokens - 1)
    outputs = np.minimum(outputs, max_total_tokens - prompts)
    high_priority = np.zeros(num_requests, dtype=bool)
    high_priority[rng.permutation(num_requests)[: round(high_priority_fraction * num_requests)]] = True
    return [
        TraceRequest(
            request_id=i,
            arrival_time=float(arrivals[i]),
            prompt_tokens=int(prompts[i]),
            output_tokens=int(outputs[i]),
            high_priority=bool(high_priority[i]),
        )
        for i in range(num_requests)
    ]
