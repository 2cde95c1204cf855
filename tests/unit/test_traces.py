import csv
import json

import numpy as np
import pytest

from llumnix.traces import (
    LENGTH_DISTRIBUTIONS,
    MAX_SEQUENCE_TOKENS,
    TRACE_PRESETS,
    arrival_times,
    generate_trace,
    load_dataset_lengths,
    sample_lengths,
)

# Table 1 of the paper: mean, (P50, P80, P95, P99).
TABLE1 = {
    "sharegpt-input": (306, (74, 348, 1484, 3388)),
    "sharegpt-output": (500, (487, 781, 988, 1234)),
    "burstgpt-input": (830, (582, 1427, 2345, 3549)),
    "burstgpt-output": (271, (243, 434, 669, 964)),
    "S": (128, (38, 113, 413, 1464)),
    "M": (256, (32, 173, 1288, 4208)),
    "L": (512, (55, 582, 3113, 5166)),
}


def _relative_errors(distribution: str) -> tuple[float, np.ndarray]:
    lengths = sample_lengths(distribution, 100_000, np.random.default_rng(7))
    mean, percentiles = TABLE1[distribution]
    got = np.percentile(lengths, [50, 80, 95, 99])
    return lengths.mean() / mean - 1, got / np.array(percentiles) - 1


@pytest.mark.parametrize("distribution", [d for d in LENGTH_DISTRIBUTIONS if "gpt" in d])
def test_dataset_fits_match_table1(distribution: str) -> None:
    mean_error, percentile_errors = _relative_errors(distribution)
    assert abs(mean_error) < 0.03
    assert np.all(np.abs(percentile_errors) < 0.05), percentile_errors


@pytest.mark.parametrize("distribution", ["S", "M", "L"])
def test_power_laws_follow_table1(distribution: str) -> None:
    # The artifact's recipe lands within ~13% of Table 1 (its lengths are multiples of the rank-1 length).
    mean_error, percentile_errors = _relative_errors(distribution)
    assert abs(mean_error) < 0.02
    assert np.all(np.abs(percentile_errors) < 0.15), percentile_errors


def test_power_law_lengths_are_ranks_times_the_rescaling() -> None:
    lengths = sample_lengths("S", 50_000, np.random.default_rng(0))
    # Zipf(2) over ranks 1..255 has mean H(255, 1) / H(255, 2); rank 1 is rescaled to 128 / that mean.
    ranks = np.arange(1, 256)
    rank1 = 128 / ((1 / ranks).sum() / (1 / ranks**2).sum())
    assert lengths.min() == np.ceil(rank1)
    assert abs(np.mean(lengths == np.ceil(rank1)) - 1 / (1 / ranks**2).sum()) < 0.01
    assert lengths.max() <= MAX_SEQUENCE_TOKENS


@pytest.mark.parametrize("distribution", LENGTH_DISTRIBUTIONS)
def test_lengths_are_positive_capped_ints(distribution: str) -> None:
    lengths = sample_lengths(distribution, 20_000, np.random.default_rng(3))
    assert lengths.dtype.kind == "i"
    assert lengths.min() >= 1
    assert lengths.max() <= MAX_SEQUENCE_TOKENS


def test_unknown_distribution_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown length distribution 'XL'.*sharegpt-input"):
        sample_lengths("XL", 3, np.random.default_rng(0))


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_arrivals_reach_rate_and_cv(cv: float) -> None:
    times = arrival_times(200_000, rate=8.0, cv=cv, rng=np.random.default_rng(11))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    assert abs(gaps.mean() * 8.0 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() / cv - 1) < 0.10


@pytest.mark.parametrize(
    ("rate", "cv", "message"), [(0.0, 1.0, "request rate"), (1.0, -2.0, "coefficient of variation")]
)
def test_arrivals_reject_bad_parameters(rate: float, cv: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arrival_times(10, rate=rate, cv=cv, rng=np.random.default_rng(0))


def test_same_arguments_same_trace_and_seed_matters() -> None:
    first = generate_trace("M-M", 500, rate=7.5, cv=2.0, seed=5, high_priority_fraction=0.1)
    again = generate_trace("M-M", 500, rate=7.5, cv=2.0, seed=5, high_priority_fraction=0.1)
    other = generate_trace("M-M", 500, rate=7.5, cv=2.0, seed=6, high_priority_fraction=0.1)
    assert first == again
    assert first != other


@pytest.mark.parametrize("preset", list(TRACE_PRESETS))
def test_trace_shape(preset: str) -> None:
    trace = generate_trace(preset, 2000, rate=10.0, seed=1, max_total_tokens=4096)
    assert [r.request_id for r in trace] == list(range(2000))
    arrivals = [r.arrival_time for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in trace)
    assert all(r.prompt_tokens + r.output_tokens <= 4096 for r in trace)
    assert not any(r.high_priority for r in trace)


def test_cap_cuts_the_prompt_first_and_keeps_one_output_token() -> None:
    trace = generate_trace("L-L", 5000, rate=3.0, seed=2, max_total_tokens=600)
    assert max(r.prompt_tokens for r in trace) == 599
    assert all(r.output_tokens >= 1 and r.prompt_tokens + r.output_tokens <= 600 for r in trace)
    assert any(r.prompt_tokens == 599 and r.output_tokens == 1 for r in trace)


def test_high_priority_fraction_is_exact_and_random() -> None:
    trace = generate_trace("S-S", 1000, rate=26.0, cv=4.0, seed=3, high_priority_fraction=0.1)
    chosen = [r.request_id for r in trace if r.high_priority]
    assert len(chosen) == 100
    assert chosen != list(range(100))
    assert max(chosen) > 500


def test_trace_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown trace 'X-X'.*S-S"):
        generate_trace("X-X", 10, rate=1.0)
    with pytest.raises(ValueError, match="high-priority fraction"):
        generate_trace("S-S", 10, rate=1.0, high_priority_fraction=1.5)
    with pytest.raises(ValueError, match="max_total_tokens"):
        generate_trace("S-S", 10, rate=1.0, max_total_tokens=1)


def _conversation(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_json_pairs_first_human_with_following_gpt(tmp_path) -> None:
    path = tmp_path / "sharegpt.json"
    data = [
        _conversation(("human", "a" * 40), ("gpt", "b" * 400), ("human", "c" * 4000), ("gpt", "d")),
        _conversation(("system", "ignored"), ("human", "x" * 10), ("gpt", "y" * 2)),
        _conversation(("human", "no answer")),
        _conversation(("gpt", "answer without question")),
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(data))
    # 40 chars -> 10 tokens; 400 -> 100; 10 chars -> round(2.5) = 2; 2 chars -> max(1, 0) = 1.
    assert load_dataset_lengths(str(path)) == [(10, 100), (2, 1)]


def test_sharegpt_jsonl(tmp_path) -> None:
    path = tmp_path / "sharegpt.jsonl"
    lines = [
        _conversation(("human", "q" * 8), ("gpt", "r" * 80)),
        _conversation(("human", "q" * 4), ("gpt", "r")),
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert load_dataset_lengths(str(path)) == [(2, 20), (1, 1)]


def test_burstgpt_csv_skips_failed_requests(tmp_path) -> None:
    path = tmp_path / "burstgpt.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        header = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
        writer.writerow(header)
        writer.writerow([5, "ChatGPT", 472, 18, 490, "Conversation log"])
        writer.writerow([45, "ChatGPT", 1087, 0, 1087, "Conversation log"])
        writer.writerow([118, "GPT-4", 417, 276, 693, "API log"])
    assert load_dataset_lengths(str(path)) == [(472, 18), (417, 276)]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.json", "  \n", "dataset file is empty"),
        ("bad.json", "{not json", r"not ShareGPT JSON or JSONL \(line 1"),
        ("scalar.json", "42", "expected a JSON list of conversations"),
        ("nopairs.json", json.dumps([_conversation(("gpt", "hi"))]), "no ShareGPT conversations"),
        ("cols.csv", "a,b\n1,2\n", "lacks column\\(s\\) 'Request tokens', 'Response tokens'"),
        ("zeros.csv", "Request tokens,Response tokens\n5,0\n", "no BurstGPT rows"),
        ("text.csv", "Request tokens,Response tokens\nmany,3\n", "line 2: token counts must be numbers"),
    ],
)
def test_dataset_errors_are_clear(tmp_path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_dataset_lengths(str(path))


def test_missing_dataset_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read dataset file"):
        load_dataset_lengths(str(tmp_path / "absent.json"))


def test_trace_from_dataset_draws_its_pairs_reproducibly(tmp_path) -> None:
    path = tmp_path / "burstgpt.csv"
    path.write_text("Request tokens,Response tokens\n100,10\n200,20\n7000,30\n")
    trace = generate_trace(str(path), 300, rate=2.0, cv=3.0, seed=9)
    assert trace == generate_trace(str(path), 300, rate=2.0, cv=3.0, seed=9)
    pairs = {(r.prompt_tokens, r.output_tokens) for r in trace}
    # The 7000-token prompt is cut to 6143 so that one output token fits under 6144.
    assert pairs == {(100, 10), (200, 20), (6143, 1)}
    gaps = np.diff([0.0] + [r.arrival_time for r in trace])
    assert abs(gaps.mean() * 2.0 - 1) < 0.5
