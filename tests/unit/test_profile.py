import json

import pytest

from llumnix.profile import DEFAULT_PROFILE, PROFILES_DIR, bundled_profiles, load_profile


@pytest.fixture(scope="module")
def a10():
    return load_profile()


def test_bundled_profiles_load_by_name() -> None:
    assert DEFAULT_PROFILE in bundled_profiles()
    assert "example-measured" in bundled_profiles()
    assert load_profile("example-measured").name == "example-measured"


def test_engine_geometry(a10) -> None:
    assert a10.name == "llama-7b-a10"
    assert a10.block_size == 16
    assert a10.kv_capacity_tokens == 13616
    assert a10.total_blocks == 851
    # K and V, 32 layers, 4096 fp16 values each.
    assert a10.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 524288
    assert a10.migration_bandwidth == 8e9
    assert a10.max_num_seqs == 256
    assert a10.max_num_batched_tokens == 6144


def test_documented_anchor_values(a10) -> None:
    # docs/latency-profile.md: decode step at batch 1 ~26 ms (weight read + launch floor), 74 ms with a
    # full KV cache (the calibration's target: 8.0 req/s of M-M fills 16 instances), 1k-token prefill
    # ~164 ms, KV copy of 1k tokens at 8 GB/s ~66 ms.
    assert a10.decode_time(1, 128) == pytest.approx(0.0264, abs=0.0005)
    assert a10.decode_time(32, 13616) == pytest.approx(0.0735, abs=0.001)
    assert a10.prefill_time(1024) == pytest.approx(0.164, abs=0.002)
    assert a10.kv_transfer_time(1000) == pytest.approx(0.001 + 1000 * 524288 / 8e9)
    assert a10.kv_transfer_time(1000) == pytest.approx(0.0665, abs=0.0005)


def test_decode_is_memory_bound_until_compute_takes_over(a10) -> None:
    # Up to ~150 sequences the weights' read time dominates: more sequences cost nothing but their KV reads.
    assert a10.decode_time(64, 8192) == pytest.approx(a10.decode_time(1, 8192))
    assert a10.decode_time(256, 8192) > a10.decode_time(128, 8192) * 1.2
    # A full KV cache adds its read time (~48 ms for 13,616 tokens at the calibrated 25% of peak).
    assert a10.decode_time(32, 13616) - a10.decode_time(32, 0) == pytest.approx(0.0476, abs=0.0005)


def test_monotone_in_every_argument(a10) -> None:
    for profile in (a10, load_profile("example-measured")):
        prefill = [profile.prefill_time(n) for n in (1, 64, 512, 1024, 2048, 4096, 6144, 8192)]
        assert prefill == sorted(prefill)
        for seqs in (1, 16, 64, 200, 256):
            contexts = [profile.decode_time(seqs, c) for c in (seqs, 2000, 8000, 13616)]
            assert contexts == sorted(contexts)
        batches = [profile.decode_time(b, 4096) for b in (1, 8, 32, 100, 256)]
        assert batches == sorted(batches)
        mixed = profile.iteration_time(512, 32, 4096)
        assert mixed >= max(profile.prefill_time(512), profile.decode_time(32, 4096))


def test_empty_iteration_takes_no_time(a10) -> None:
    assert a10.iteration_time(0, 0, 0) == 0.0
    assert load_profile("example-measured").iteration_time(0, 0, 0) == 0.0


def test_batched_prompts_pay_less_attention_than_one_long_prompt(a10) -> None:
    one_long = a10.iteration_time(4096, 0, 0)
    four_short = a10.iteration_time(4096, 0, 0, prefill_square_tokens=4 * 1024**2)
    assert one_long == a10.iteration_time(4096, 0, 0, prefill_square_tokens=4096**2)
    assert 0 < one_long - four_short < 0.1 * one_long


def test_mixed_iteration_shares_the_weight_read(a10) -> None:
    # A prefill of 64 tokens plus 32 decodes is still memory-bound: one weight read, not two.
    mixed = a10.iteration_time(64, 32, 2048, prefill_square_tokens=64**2)
    assert mixed < a10.prefill_time(64) + a10.decode_time(32, 2048) - 0.02


def _measured(tmp_path, **overrides) -> str:
    data = {
        "kind": "measured",
        "name": "tiny",
        "prefill": {"tokens": [100, 1100], "seconds": [0.02, 0.12]},
        "decode": {
            "batch_sizes": [1, 11],
            "context_tokens": [0, 1000],
            "seconds": [[0.010, 0.020], [0.030, 0.050]],
        },
        "engine": {
            "block_size": 32,
            "kv_capacity_tokens": 3200,
            "kv_bytes_per_token": 1000,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "migration_bandwidth": 1e6,
            "kv_transfer_latency_s": 0.5,
        },
    }
    data.update(overrides)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_measured_profile_interpolates_and_extrapolates(tmp_path) -> None:
    profile = load_profile(_measured(tmp_path))
    assert profile.total_blocks == 100
    assert profile.kv_transfer_time(2000) == pytest.approx(0.5 + 2.0)
    assert profile.prefill_time(600) == pytest.approx(0.07)
    assert profile.prefill_time(2100) == pytest.approx(0.22)  # beyond the table: last segment's slope
    assert profile.prefill_time(50) == pytest.approx(0.015)
    # Bilinear on the decode grid.
    assert profile.decode_time(1, 500) == pytest.approx(0.015)
    assert profile.decode_time(6, 500) == pytest.approx((0.015 + 0.040) / 2)
    # Beyond both axes: context 2000 gives 0.030 (batch 1) and 0.070 (batch 11); batch 21 extends that line.
    assert profile.decode_time(21, 2000) == pytest.approx(0.030 + 2 * (0.070 - 0.030))
    # A mixed iteration adds both parts.
    assert profile.iteration_time(600, 6, 500) == pytest.approx(0.07 + 0.0275)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "guess"}, "'kind' must be 'roofline' or 'measured'"),
        ({"prefill": {"tokens": [100], "seconds": [0.1]}}, "prefill 'tokens' needs at least 2 points"),
        ({"prefill": {"tokens": [200, 100], "seconds": [0.1, 0.2]}}, "must be strictly increasing"),
        ({"prefill": {"tokens": [1, 2], "seconds": [0.1]}}, "prefill 'seconds' must have 2 values"),
        ({"prefill": {"tokens": [1, "x"], "seconds": [0.1, 0.2]}}, "prefill 'tokens' must be a list of num"),
        ({"decode": {"batch_sizes": [1, 2], "context_tokens": [0, 1], "seconds": [[1, 2]]}}, "per decode"),
        ({"engine": {"block_size": 16}}, "'kv_bytes_per_token' must be a number, got None"),
        ({"name": ""}, "'name' must be a non-empty string"),
    ],
)
def test_measured_profile_errors(tmp_path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_profile(_measured(tmp_path, **overrides))


def test_unknown_profile_and_bad_json(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no latency profile 'h100'.*llama-7b-a10"):
        load_profile("h100")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_profile(str(bad))


def test_roofline_file_missing_section(tmp_path) -> None:
    path = tmp_path / "roof.json"
    path.write_text(json.dumps({"kind": "roofline", "name": "x", "engine": {}}))
    with pytest.raises(ValueError, match="missing section 'model'"):
        load_profile(str(path))


def test_roofline_kv_bytes_follow_kv_heads(tmp_path) -> None:
    data = json.loads((PROFILES_DIR / "llama-7b-a10.json").read_text())
    data["model"]["kv_hidden_size"] = 1024  # 8 KV heads of 128, as in grouped-query models
    path = tmp_path / "gqa.json"
    path.write_text(json.dumps(data))
    gqa, mha = load_profile(str(path)), load_profile()
    assert gqa.kv_bytes_per_token == mha.kv_bytes_per_token // 4
    assert gqa.prefill_time(2048) == mha.prefill_time(2048)
    assert gqa.decode_time(8, 8000) < mha.decode_time(8, 8000)
